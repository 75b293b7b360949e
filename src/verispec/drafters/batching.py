"""Several requests draft side by side, their draft models' forwards batched: one pass of k rows, not k passes.

A server step verifies every running request in one target pass (`engine/together.py`), but each request drafts on
its own, and a draft model runs a forward per drafted token: with k requests, k passes of one row, where one pass of
k rows costs little more on a memory-bound CPU (`benchmarks/probes/ragged_pass.py`).

`draft_together(tasks)` runs each task (a request's `Generation.plan`, where its drafter declares `batches_drafts`:
its model runs only through `ModelSession._feed`) on a thread of its own. `_feed` calls `feed` here, which on such a
thread hands its tokens to the step's `_Gate` and waits. Once every task still running waits there, the calling
thread runs the waiting feeds: ONE `forward_ragged` per draft runner over those it may batch, the others one by
one; then it wakes the tasks, which go on to their next forward or finish. So every forward runs on the calling
thread (never two at once), and the drafting code itself is unchanged: a session's forwards happen in its order,
only in company.

Exact: feeds share a pass only on a runner that declares `batch_invariant` (a row's bits do not depend on the rest
of the pass) and only up to its `exact_positions`, so a request drafts the same tokens with the same probabilities
alone or among others, and its sampled output for a seed stays its own. A failing shared pass is retried feed by
feed, so only a faulty request's task fails.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from verispec.models.openmp import serial_thread
from verispec.models.runner import Cache, Runner

__all__ = ["draft_together", "feed"]

T = TypeVar("T")
_local = threading.local()  # .gate: the step's gate on a task's thread


def feed(runner: Runner, cache: Cache, tokens: torch.Tensor, logits: str) -> torch.Tensor | None:
    """`runner.forward(cache, tokens, logits=logits)`; on a thread drafting inside `draft_together`, run by the
    calling thread with the other tasks' feeds (in one pass where the runner batches exactly)."""
    gate: _Gate | None = getattr(_local, "gate", None)
    if gate is None:
        return runner.forward(cache, tokens, logits=logits)
    return gate.feed(_Feed(runner, cache, tokens, logits))


def draft_together(tasks: list[Callable[[], T]], batched: list[bool] | None = None) -> list[T | BaseException]:
    """Run `tasks` side by side, their draft forwards batched (module docstring); per task its result or the
    exception it raised, in order. `batched[i]` False (`Generation.batches_drafts`: a drafter that runs no model, or
    runs it outside `_feed`) runs task i here first, as does a lone task; the others each on a thread of its own (kept
    for the next call)."""
    batched = batched if batched is not None else [True] * len(tasks)
    results: list = [None] * len(tasks)
    together = [i for i, flag in enumerate(batched) if flag]
    for i in range(len(tasks)):
        if not batched[i] or len(together) == 1:
            results[i] = _run(tasks[i])
    if len(together) < 2:
        return results
    gate = _Gate(len(together))

    def run_at(i: int) -> None:
        _local.gate = gate
        try:
            results[i] = _run(tasks[i])
        finally:
            _local.gate = None
            gate.finished()

    for i in together:
        _workers.submit(lambda i=i: run_at(i))
    gate.serve()
    return results


@dataclass
class _Feed:
    runner: Runner
    cache: Cache
    tokens: torch.Tensor  # [n]
    logits: str
    done: bool = False
    out: torch.Tensor | None = None
    error: BaseException | None = None

    @property
    def batchable(self) -> bool:
        """Whether this feed may share a pass: a runner that batches exactly, a feed within its exact width."""
        exact = self.runner.exact_positions
        return self.runner.batch_invariant and exact is not None and self.tokens.shape[0] <= exact


class _Gate:
    """Where one step's tasks meet: `running` counts the tasks neither waiting here nor finished."""

    def __init__(self, tasks: int):
        self.changed = threading.Condition()
        self.running = tasks
        self.waiting: list[_Feed] = []

    def feed(self, item: _Feed) -> torch.Tensor | None:  # on a task's thread
        with self.changed:
            self.waiting.append(item)
            self.running -= 1
            self.changed.notify_all()
            while not item.done:
                self.changed.wait()
        if item.error is not None:
            raise item.error
        return item.out

    def finished(self) -> None:  # on a task's thread, as it ends
        with self.changed:
            self.running -= 1
            self.changed.notify_all()

    def serve(self) -> None:
        """On the calling thread: whenever every running task waits here, their feeds in one pass per runner;
        returns once every task has finished."""
        while True:
            with self.changed:
                self.changed.wait_for(lambda: self.running == 0)
                batch, self.waiting = self.waiting, []
            if not batch:
                return
            shared = [item for item in batch if item.batchable]
            for item in batch:
                if not item.batchable:
                    _forward([item])
            for runner in {id(item.runner): item.runner for item in shared}.values():
                _forward([item for item in shared if item.runner is runner])
            with self.changed:
                for item in batch:
                    item.done = True
                self.running += len(batch)
                self.changed.notify_all()


def _forward(items: list[_Feed]) -> None:
    """`items` (feeds of one runner) in one pass, each scored as it asks (`row_logits`): its logits as `forward` gives
    them. A lone item, or each item if the pass fails (a cache moves only when its forward succeeds), through `forward`
    itself."""
    runner = items[0].runner
    if len(items) > 1:
        try:
            rows = runner.forward_ragged([item.cache for item in items], [item.tokens for item in items],
                                         logits=[item.logits for item in items])
        except Exception:  # noqa: BLE001 - each item alone below: only the faulty one fails
            rows = None
        if rows is not None:
            for item, logits in zip(items, rows):
                item.out = logits
            return
    for item in items:
        try:
            item.out = runner.forward(item.cache, item.tokens, logits=item.logits)
        except Exception as error:  # noqa: BLE001
            item.error = error


def _run(task: Callable[[], T]) -> T | BaseException:
    try:
        return task()
    except Exception as error:  # noqa: BLE001 - the caller fails that request only
        return error


class _Workers:
    """Threads kept for the next step (starting one costs about 75 µs). A task never waits for a free one: with none
    idle a new one starts, so a step's tasks all run at once (a fixed pool could leave a task queued behind tasks
    that wait at the gate for it)."""

    def __init__(self):
        self._idle: list[queue.SimpleQueue] = []
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), name="verispec-draft", daemon=True).start()
        inbox.put(job)

    def _serve(self, inbox: queue.SimpleQueue) -> None:
        serial_thread()  # a drafting thread's own work is small: a pool of its own would slow every pass (`models/openmp.py`)
        while True:
            inbox.get()()
            with self._lock:
                self._idle.append(inbox)


_workers = _Workers()
