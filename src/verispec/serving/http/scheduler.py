"""Continuous batching: one worker thread owns the models and steps every active request together.

Requests wait in a bounded queue (full → `QueueFullError`, a 429). Between steps the worker admits
waiting requests (tokenize + prefill) up to `max_batch`, drops cancelled or timed-out ones (freeing
their slot and caches), then runs one step for all of them: `plan()` each (drafts) → ONE
`forward_ragged` target pass over every row's feed → `commit()` each. Acceptance is ragged: each row
keeps its own accepted prefix. Every request owns its `torch.Generator`, so a seeded request gives
the same tokens alone or batched. An exception inside one request fails that request only; a request
refused for its own input (a prompt too long, an unknown drafter) is not counted as a generation.
The worker notes when it last went round its loop, so that `stalled_seconds` can tell a stuck step.

Results travel to the request's asyncio loop as `JobUpdate`s through `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from verispec.engine import Engine, Generation, GenerationConfig, StepPlan
from verispec.errors import VerispecError
from verispec.serving.http.metrics import Metrics
from verispec.types import GenerationStats, TokenEvent

__all__ = ["Scheduler", "Job", "JobUpdate", "QueueFullError", "RequestTimeoutError", "live_stats"]

Encoder = Callable[[Engine], list[int]]  # runs on the worker: request → prompt token ids


class QueueFullError(VerispecError):
    """Every slot and every queue place is taken."""


class RequestTimeoutError(VerispecError):
    """A request ran past the server's per-request time limit."""


@dataclass
class JobUpdate:
    """One message from the worker: admitted, some tokens, finished, or failed."""

    kind: str  # "admitted" | "tokens" | "finished" | "failed"
    events: list[TokenEvent] = field(default_factory=list)
    prompt_tokens: int = 0
    live: dict | None = None  # speculative statistics so far (for streamed chunks)
    finish_reason: str | None = None
    stats: GenerationStats | None = None
    error: BaseException | None = None


def live_stats(stats: GenerationStats) -> dict:
    return {
        "steps": stats.steps,
        "mean_accepted_length": round(stats.mean_accepted_length, 4),
        "acceptance_rate": round(stats.acceptance_rate, 4),
        "per_position_acceptance": [round(x, 4) for x in stats.per_position_acceptance],
    }


class Job:
    """One request as the worker sees it, and the asyncio side's handle to its updates."""

    def __init__(self, encode: Encoder, config: GenerationConfig, loop: asyncio.AbstractEventLoop, deadline: float):
        self.encode, self.config, self.loop, self.deadline = encode, config, loop, deadline
        self.updates: asyncio.Queue[JobUpdate] = asyncio.Queue()
        self.generation: Generation | None = None
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """Ask the worker to drop this request (client gone); safe from any thread."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    async def next(self) -> JobUpdate:
        """The next update; raises the request's error if it failed."""
        update = await self.updates.get()
        if update.kind == "failed":
            raise update.error
        return update

    def push(self, update: JobUpdate) -> None:
        try:
            self.loop.call_soon_threadsafe(self.updates.put_nowait, update)
        except RuntimeError:  # the request's event loop is gone (server shutting down)
            self.cancel()


class Scheduler:
    """Owns the engine on one worker thread; `submit` from any thread or event loop."""

    def __init__(self, engine: Engine, metrics: Metrics | None = None, max_batch: int = 8, max_queue: int = 32,
                 request_timeout: float = 300.0):
        if max_batch < 1 or max_queue < 1 or request_timeout <= 0:
            raise ValueError("max_batch and max_queue must be ≥ 1 and request_timeout > 0")
        self.engine, self.metrics = engine, metrics or Metrics()
        self.max_batch, self.max_queue, self.request_timeout = max_batch, max_queue, request_timeout
        self._waiting: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self._active: list[Job] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_turn = time.monotonic()  # when the worker last went round its loop
        self.metrics.add_gauge("verispec_queue_length", "Requests waiting for a batch slot.", lambda: self._waiting.qsize())
        self.metrics.add_gauge("verispec_active_generations", "Requests being decoded now.", lambda: len(self._active))

    @property
    def queue_length(self) -> int:
        return self._waiting.qsize()

    @property
    def active_count(self) -> int:
        return len(self._active)

    @property
    def stalled_seconds(self) -> float:
        """How long the worker has not gone round its loop while requests wait or run (0: no work)."""
        if not (self._active or self._waiting.qsize()):
            return 0.0
        return max(0.0, time.monotonic() - self._last_turn)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="verispec-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, encode: Encoder, config: GenerationConfig, loop: asyncio.AbstractEventLoop | None = None) -> Job:
        job = Job(encode, config, loop or asyncio.get_running_loop(), time.monotonic() + self.request_timeout)
        try:
            self._waiting.put_nowait(job)
        except queue.Full:
            raise QueueFullError(
                f"the server is at capacity ({self.max_batch} running, {self.max_queue} waiting): retry later"
            ) from None
        return job

    # ---- worker thread -------------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stop.is_set():
            self._last_turn = time.monotonic()
            try:
                self._admit()
                self._drop_finished_early()
                if self._active:
                    self._step()
            except Exception as error:  # noqa: BLE001 — a bug outside any one request: fail the batch, keep serving
                for job in list(self._active):
                    self._fail(job, error, "error")
        for job in self._active:
            self._fail(job, RequestTimeoutError("the server is shutting down"), "cancelled")
        self._active.clear()

    def _admit(self) -> None:
        block = not self._active  # idle: wait a little for work instead of spinning
        while len(self._active) < self.max_batch:
            try:
                job = self._waiting.get(timeout=0.05) if block else self._waiting.get_nowait()
            except queue.Empty:
                return
            block = False
            if job.cancelled:
                self.metrics.record_finished("cancelled")
                continue
            try:
                ids = job.encode(self.engine)
                job.generation = self.engine.start(ids, job.config)
            except Exception as error:  # noqa: BLE001 — a bad prompt fails its own request only
                self._fail(job, error, None if isinstance(error, VerispecError) else "error")
                continue
            self._active.append(job)
            self.metrics.record_admitted(job.generation.prompt_len)
            job.push(JobUpdate("admitted", prompt_tokens=job.generation.prompt_len))

    def _drop_finished_early(self) -> None:
        now = time.monotonic()
        for job in list(self._active):
            if job.cancelled:
                self._active.remove(job)
                job.generation.close()
                self.metrics.record_finished("cancelled")
            elif now > job.deadline:
                self._fail(job, RequestTimeoutError(
                    f"the request ran past the server's limit of {self.request_timeout:g} s: ask for fewer tokens"), "timeout")

    def _fail(self, job: Job, error: BaseException, reason: str | None) -> None:
        """End `job` with `error`; `reason` None: refused before it started (not a finished generation)."""
        if job in self._active:
            self._active.remove(job)
            job.generation.close()
        if reason is not None:
            self.metrics.record_finished(reason)
        job.push(JobUpdate("failed", error=error))

    def _step(self) -> None:
        started = time.perf_counter()
        jobs: list[Job] = []
        plans: list[StepPlan] = []
        for job in list(self._active):
            try:
                plans.append(job.generation.plan())
                jobs.append(job)
            except Exception as error:  # noqa: BLE001
                self._fail(job, error, "error")
        if not jobs:
            return
        target_started = time.perf_counter()
        rows = self._verify_forward(jobs, plans)
        target_seconds = time.perf_counter() - target_started
        for job, plan, logits in zip(jobs, plans, rows):
            if isinstance(logits, BaseException):
                self._fail(job, logits, "error")
                continue
            self._commit(job, plan, logits, target_seconds)
        self.metrics.record_step(len(jobs), time.perf_counter() - started)

    def _verify_forward(self, jobs: list[Job], plans: list[StepPlan]) -> list[torch.Tensor | BaseException]:
        """One target pass for every row: [γ_i+1, vocab] logits each. If the batched pass fails, retry
        row by row so that only the faulty request fails (cache lengths move only on success)."""
        runner = self.engine.target.runner
        caches = [job.generation.cache for job in jobs]
        try:
            return runner.forward_ragged(
                caches, [plan.feed for plan in plans], [plan.positions for plan in plans], [plan.tree_mask for plan in plans]
            )
        except Exception:  # noqa: BLE001
            rows: list[torch.Tensor | BaseException] = []
            for cache, plan in zip(caches, plans):
                try:
                    rows.append(runner.forward(cache, plan.feed, plan.positions, plan.tree_mask, logits="all"))
                except Exception as error:  # noqa: BLE001
                    rows.append(error)
            return rows

    def _commit(self, job: Job, plan: StepPlan, logits: torch.Tensor, target_seconds: float) -> None:
        generation = job.generation
        try:
            events = generation.commit(plan, logits, target_seconds)
        except Exception as error:  # noqa: BLE001
            self._fail(job, error, "error")
            return
        record = generation.stats.records[-1]
        self.metrics.record_verification(record.proposed, record.accepted, len(events))
        job.push(JobUpdate("tokens", events=events, live=live_stats(generation.stats)))
        if generation.done:
            self._active.remove(job)
            self.metrics.record_finished(generation.finish_reason)
            job.push(JobUpdate("finished", finish_reason=generation.finish_reason, stats=generation.stats))
