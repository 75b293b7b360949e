"""Progress displays for long work (installing, assembling, converting, benchmarking), on stderr."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

console = Console(stderr=True)


@contextmanager
def status(message: str) -> Iterator[None]:
    """A spinner with `message` while the block runs."""
    with console.status(message):
        yield
    console.log(f"{message}: done")


@contextmanager
def byte_progress(description: str, total: int) -> Iterator[Callable[[int], None]]:
    """A byte-counting progress bar; yields `advance(n_bytes)`."""
    columns = ("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
               TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n: progress.advance(task, n)
