"""The bundled demo models by name (`model.path=smollm2-135m` / `smollm2-135m-fp4`): where their cached conversion
is, and what to do when that cache is damaged."""

from __future__ import annotations

import stat
from pathlib import Path

from pieceworks.errors import CheckpointError
from pieceworks.util import checked_stat

DEMO_MODELS = ("smollm2-135m", "smollm2-135m-fp4")


def demo_model_damaged(exc: CheckpointError, model_dir: Path) -> CheckpointError:
    """`exc`, raised reading a demo model's cached conversion, with the fix that applies to it: the user never
    downloaded or exported that directory, pieceworks built it, and builds it again once it is gone."""
    from pieceworks.models.checkpoint import REDOWNLOAD

    fix = f"pieceworks built this demo model in {model_dir}: delete that directory and the next run rebuilds it"
    text = str(exc)
    return CheckpointError(text.replace(REDOWNLOAD, fix) if REDOWNLOAD in text else f"{text}; {fix}")


def resolve_model_path(path: str, progress: bool = True, cache_dir: Path | None = None) -> Path:
    """A model directory: the path itself, or the cached conversion of a bundled demo model (in cache_dir;
    None: `smollm2.default_cache_dir()`).

    Raises:
        CheckpointError: `path` is neither a demo model's name nor a directory (as `read_config`).
    """
    if path in DEMO_MODELS:
        from pieceworks.models import smollm2

        ensure = smollm2.ensure_smollm2_fp4 if path.endswith("fp4") else smollm2.ensure_smollm2
        return ensure(cache_dir, progress=progress)
    p = Path(path).expanduser()
    st = checked_stat(p)
    if st is None or not stat.S_ISDIR(st.st_mode):
        raise CheckpointError(
            f"model.path={path!r} is not a directory; give a Hugging Face-format model directory "
            f"(config.json + *.safetensors) or one of {', '.join(DEMO_MODELS)}"
        )
    return p
