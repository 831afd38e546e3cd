"""Small shared helpers: progress bars and logging setup (rich)."""

from __future__ import annotations

import contextlib
import logging
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


def setup_logging(level: int = logging.INFO) -> None:
    """Route pieceworks' loggers through rich (used by the CLI; libraries embedding us configure their own)."""
    from rich.logging import RichHandler

    logger = logging.getLogger("pieceworks")
    if not any(isinstance(h, RichHandler) for h in logger.handlers):
        logger.addHandler(RichHandler(show_path=False, show_time=False, markup=False))
    logger.setLevel(level)
    logger.propagate = False
