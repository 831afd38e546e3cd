"""Small shared helpers: progress bars and logging setup (rich), reading the files users name."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Callable, Iterator


@contextlib.contextmanager
def progress_bar(enabled: bool, description: str, total: int) -> Iterator[Callable[[int], None]]:
    """A rich progress bar (or nothing when disabled); yields `advance(n=1)`."""
    if not enabled:
        yield lambda n=1: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n=1: bar.advance(task, n)


@contextlib.contextmanager
def transformers_bars(shown: bool) -> Iterator[None]:
    """transformers' own progress bars off unless `shown` (its logging's, and the GGUF reader's plain tqdm, which
    that setting does not reach), as they were afterwards."""
    import functools
    import importlib

    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # the caller's own import of transformers says what to install
        hf_logging = None
    if shown or hf_logging is None:
        yield
        return
    try:
        gguf = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    except ImportError:
        gguf = None
    was, bar = hf_logging.is_progress_bar_enabled(), getattr(gguf, "tqdm", None)
    hf_logging.disable_progress_bar()
    if bar is not None:
        gguf.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            gguf.tqdm = bar
        if was:
            hf_logging.enable_progress_bar()


def setup_logging(level: int = logging.INFO) -> None:
    """Route pieceworks' loggers through rich (used by the CLI; libraries embedding us configure their own)."""
    from rich.logging import RichHandler

    logger = logging.getLogger("pieceworks")
    if not any(isinstance(h, RichHandler) for h in logger.handlers):
        logger.addHandler(RichHandler(show_path=False, show_time=False, markup=False))
    logger.setLevel(level)
    logger.propagate = False


def unreadable(path, exc: OSError):
    """The CheckpointError for a checkpoint file the operating system won't read (permission denied, an
    I/O error), naming the file and what to do."""
    from pieceworks.errors import CheckpointError

    why = exc.strerror or str(exc) or type(exc).__name__
    hint = ("give the user running pieceworks read access to it" if isinstance(exc, PermissionError)
            else "check the file system or re-download it")
    return CheckpointError(f"{path}: can't be read ({why}); {hint}")


def checked_stat(path, where=None):
    """`os.stat_result` of a checkpoint path, or None when nothing is there.

    Raises:
        CheckpointError: the OS won't look (`unreadable`; naming `where`, default `path`): permission
            denied on a directory on the way, which `Path.is_file` and friends raise as a bare
            PermissionError.
    """
    try:
        return path.stat()
    except (FileNotFoundError, NotADirectoryError):
        if os.path.islink(path):  # a Hugging Face cache whose blob is gone
            from pieceworks.errors import CheckpointError

            raise CheckpointError(f"{path}: a symlink to {os.readlink(path)}, which does not exist; re-download "
                                  "the model (or restore what the link points to)") from None
        return None
    except OSError as e:
        raise unreadable(where if where is not None else path, e) from None


def load_json_object(path) -> dict:
    """A checkpoint's JSON file (config.json, generation_config.json, ...) that must hold an object.

    Raises:
        CheckpointError: it is not valid JSON or not an object; the message names the file.
    """
    import json

    from pieceworks.errors import CheckpointError

    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e}); fix or re-download it") from None
    except (PermissionError, IsADirectoryError) as e:
        raise unreadable(path, e) from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object at the top level, got {type(data).__name__}")
    return data


def flag_text(flag: str, path) -> str:
    """The text of the UTF-8 file a command-line flag names (`--text`, `--dataset`).

    Raises:
        FileNotFoundError: `path` is missing or a directory (the message names the flag).
        ValueError: it is not UTF-8, or the OS won't read it.
    """
    from pathlib import Path

    path = Path(path)
    if path.is_dir():
        raise FileNotFoundError(f"{flag} {path}: is a directory; give a UTF-8 text file")
    if not path.is_file():
        raise FileNotFoundError(f"{flag} {path}: no such file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag} {path}: not UTF-8 text (byte {e.start}: {e.reason}); convert it to UTF-8") from None
    except OSError as e:
        raise ValueError(f"{flag} {path}: can't be read ({e.strerror or type(e).__name__}); check its "
                         "permissions") from None


class OneThread:
    """A guard that lets one thread in and refuses the others at once (no waiting): `claim(what)` takes it
    or raises RuntimeError(`refusal(what)`), `release()` gives it back, `held(what)` does both around a block.
    The step paths call `claim` / `release` directly: a generator context manager costs a couple of us."""

    def __init__(self, refusal: Callable[[str], str]) -> None:
        self._lock = threading.Lock()
        self._refusal = refusal

    def claim(self, what: str) -> None:
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(self._refusal(what))

    def release(self) -> None:
        self._lock.release()

    @contextlib.contextmanager
    def held(self, what: str) -> Iterator[None]:
        self.claim(what)
        try:
            yield
        finally:
            self._lock.release()
