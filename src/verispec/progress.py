"""Progress displays for long work (installing, assembling, converting, benchmarking), on stderr."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn
from rich.status import Status

console = Console(stderr=True)


_running: list[str] = []  # the messages of the blocks running now, oldest first (threads may overlap them)
_spinner: list[Status] = []  # the one spinner they share while any runs
_lock = threading.Lock()


@contextmanager
def status(message: str) -> Iterator[None]:
    """A spinner with `message` while the block runs. Blocks running at once on several threads (a compile
    beside a file's reading) share one spinner showing every message: a terminal has one live display."""
    with _lock:
        _running.append(message)
        if not _spinner:
            _spinner.append(console.status(message))
            _spinner[0].start()
        _spinner[0].update(" · ".join(_running))
    try:
        yield
    finally:
        with _lock:
            _running.remove(message)
            if _running:
                _spinner[0].update(" · ".join(_running))
            else:
                _spinner.pop().stop()
    console.log(f"{message}: done")


@contextmanager
def byte_progress(description: str, total: int) -> Iterator[Callable[[int], None]]:
    """A byte-counting progress bar; yields `advance(n_bytes)`."""
    columns = ("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
               TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n: progress.advance(task, n)
