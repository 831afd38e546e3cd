"""Where `pieceworks quantize` writes: the checks on SRC and DST before anything is written (DST new or
empty, not SRC nor inside it, on a disk with room for the output) and the cleanup after a failed run
(the files it wrote, the directories it created)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from pieceworks.models.checkpoint import INDEX_FILE, SINGLE_FILE, CheckpointReader


def check_dirs(src: Path, dst: Path, reader: CheckpointReader) -> dict:
    config = reader.config()
    qc = config.get("quantization_config")
    if qc is not None or (src / "hf_quant_config.json").exists():
        method = qc.get("quant_method") if isinstance(qc, dict) else "modelopt"
        raise ValueError(
            f"{src}: already quantized (quant_method {method!r}); quantize needs a bf16, fp16 or fp32 "
            "checkpoint"
        )
    # Compared by inode after resolving, so symlinks, `..`, relative paths and bind mounts all count.
    src_stat = src.stat()
    real = dst.resolve()
    for i, d in enumerate((real, *real.parents)):
        if d.exists() and os.path.samestat(d.stat(), src_stat):
            if i == 0:
                raise ValueError(f"{dst}: the destination is the source {src} (quantize writes a new checkpoint "
                                 "and keeps the bf16 one); choose a new or empty directory outside SRC")
            raise ValueError(f"{dst}: the destination lies inside the source {src} (the NVFP4 checkpoint would be "
                             "mixed into the bf16 one: copying or uploading SRC takes it along); choose a directory "
                             "outside it")
    if dst.is_symlink() and not dst.exists():
        raise ValueError(f"{dst}: a symlink to {os.readlink(dst)}, which does not exist; create that directory or "
                         "choose another DST")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"{dst}: exists and is not an empty directory; choose a new one")
    return config


def check_space(dst: Path, nbytes: int) -> None:
    """Refuse before writing when the file system that would hold dst has less than nbytes free."""
    where = next(d for d in (dst.absolute(), *dst.absolute().parents) if d.exists())
    usage = shutil.disk_usage(where)
    if usage.total and usage.free < nbytes:  # total 0: a file system that keeps no count
        raise ValueError(f"{dst}: the NVFP4 checkpoint needs {_size(nbytes)} and {where} has {_size(usage.free)} "
                         "free; free some space or choose a DST on another disk")


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 10**8 else f"{nbytes / 1e6:.2f} MB"


def copied_files(src: Path) -> list[Path]:
    """The source's files that go to the output as they are (tokenizer, generation config, ...)."""
    skip = {SINGLE_FILE, INDEX_FILE, "config.json", "hf_quant_config.json"}
    return sorted(
        f for f in src.iterdir() if f.is_file() and f.name not in skip and not f.name.endswith(".safetensors")
    )


def remove_written(files: list[Path], created: list[Path]) -> None:
    """After a failed run: the files it wrote besides the weights (the writer removes those), then the
    directories it created, deepest first. Best effort: the run's own error is the one to report."""
    for f in files:
        try:
            f.unlink(missing_ok=True)
        except OSError:
            pass
    for d in created:
        try:
            d.rmdir()
        except OSError:
            break
