"""Several requests draft side by side, their draft models' forwards batched: one pass of k rows, not k passes.

A server step verifies every running request in one target pass (`serving/http/scheduler.py`), but each request
drafts on its own, and a draft model runs a forward per drafted token: with k requests, k passes of one row,
where one pass of k rows costs little more on a memory-bound CPU (`benchmarks/probes/ragged_pass.py`).

`draft_together(tasks)` runs each task (a request's `Generation.plan`) in a thread of its own. The only place a
draft model runs, `ModelSession._feed`, calls `feed` here, which on such a thread hands its tokens to the step's
`_Gate` and waits. Once every task still running waits there, the calling thread runs ONE `forward_ragged` per
draft runner over the waiting feeds and wakes them; they go on to their next forward or finish. The drafting
code itself is unchanged: a session's forwards happen in its order, only in company.

Exact: feeds are batched only on a runner that declares `batch_invariant` (a row's bits do not depend on the
rest of the pass) and only up to its `exact_positions`, so a request drafts the same tokens with the same
probabilities alone or among others, and its sampled output for a seed stays its own; other feeds run alone,
as without a gate. A failing batched pass is retried row by row, so only a faulty request's task fails.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from verispec.models.runner import Cache, Runner

__all__ = ["draft_together", "feed"]

T = TypeVar("T")
_local = threading.local()  # .gate: the step's gate on a task's thread


def feed(runner: Runner, cache: Cache, tokens: torch.Tensor, logits: str) -> torch.Tensor | None:
    """`runner.forward(cache, tokens, logits=logits)`, batched with the other tasks' feeds where this thread drafts
    inside `draft_together` and the runner batches exactly."""
    gate: _Gate | None = getattr(_local, "gate", None)
    exact = runner.exact_positions
    if gate is None or not runner.batch_invariant or exact is None or tokens.shape[0] > exact:
        return runner.forward(cache, tokens, logits=logits)
    return gate.feed(_Feed(runner, cache, tokens, logits))


def draft_together(tasks: list[Callable[[], T]], batched: list[bool] | None = None) -> list[T | BaseException]:
    """Run `tasks` side by side, their draft forwards batched (module docstring); per task its result or the
    exception it raised, in order. `batched[i]` False (a request whose drafter runs no model: nothing to batch) runs
    task i here first, as does a lone task; the others each on a thread of its own (kept for the next call)."""
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
            for runner in {id(item.runner): item.runner for item in batch}.values():
                _forward([item for item in batch if item.runner is runner])
            with self.changed:
                for item in batch:
                    item.done = True
                self.running += len(batch)
                self.changed.notify_all()


def _forward(items: list[_Feed]) -> None:
    """One pass over `items` (feeds of one runner), each item's logits as `forward` gives them; if the pass fails,
    each item alone (a cache moves only when its forward succeeds)."""
    runner = items[0].runner
    wanted = "all" if any(item.logits == "all" for item in items) else "last"
    try:
        rows = runner.forward_ragged([item.cache for item in items], [item.tokens for item in items], logits=wanted)
    except Exception:  # noqa: BLE001 - find the faulty row
        for item in items:
            try:
                item.out = runner.forward(item.cache, item.tokens, logits=item.logits)
            except Exception as error:  # noqa: BLE001
                item.error = error
        return
    for item, logits in zip(items, rows):
        item.out = None if item.logits == "none" else logits[-1:] if item.logits == "last" else logits


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
        while True:
            inbox.get()()
            with self._lock:
                self._idle.append(inbox)


_workers = _Workers()
