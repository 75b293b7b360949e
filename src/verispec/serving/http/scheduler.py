"""Continuous batching: one worker thread owns the models and steps every active request together.

Requests wait in a bounded FIFO queue (full → `QueueFullError`, a 429 with a Retry-After estimate).
Every turn of the worker:
  1. drop cancelled or timed-out requests (freeing their slot, caches and pool share);
  2. admit waiting requests, in order, up to `max_batch`, while the KV pool has room for the head
     request's prompt + initial spare (`Generation.capacities`); otherwise the head waits (no
     over-commit, no overtaking). A request whose own needs exceed the whole pool is refused (400).
  3. one step for every prefilled request (`engine/together.py`): `plan()` each (drafts,
     side by side, their draft models' forwards batched; greedy requests' γ cut where the batch gains:
     `control/batch.py`) → ONE `forward_ragged` target pass over every row's feed → `commit()` each.
     Acceptance is ragged: each row keeps its own prefix.
  4. and ONE prefill chunk of at most `prefill_chunk` prompt tokens to the prefilling request with
     the fewest prompt tokens left (a short prompt is not held behind a long one; a prompt passed
     over STARVATION_TURNS turns in a row goes next; 0: a whole prompt at once): in the step's own pass where
     the target computes every row as it would alone and a prompt's cache however it is cut
     (`engine/together.mixes_prompts`: kquant; the weights are read once for both), else in a pass of its own
     after the step (a draft model's prefill always: `Turn.mixed` says which). So a long prompt
     delays the decoding requests by at most one chunk per turn; the chunk with the prompt's last
     token gives the first new token (sent at once); when the target's prefill completes the request
     opens its drafter's session, whose own prefill (the `model` drafter's) follows in chunks the same
     way (other drafters prefill their draft whole then; `hybrid`'s draft model reads the prompt at its first
     proposal, which prompt lookup or a busy batch may spare it). With a prompt cache (`models/prefixes.py`), a
     request starts from the longest prefix of its prompt that a running request's cache or the store
     holds, and one that has not begun waits while another request is prefilling at least `MIN_REUSE`
     tokens it shares (`_donor`), which then goes before other prompts: requests over one document, or
     a request's n choices, prefill what they share once.

The chunk is a time budget: by default (`prefill_chunk=None`) the most tokens, a power of two in
8…512, that the target prefills in `PREFILL_BUDGET_SECONDS` on this CPU, or where the chunk rides in the
decoding requests' pass, that it adds to that pass in those seconds (each size timed once per model and CPU
and cached, so it is the same at every start). While no request decodes, a prompt's own
part is fed in chunks sized to `IDLE_PREFILL_BUDGET_SECONDS` instead (what a request arriving then waits
for at most), but only on a `prefix_invariant` target, whose cache holds the same bits however a prompt
is cut (`prefill_chunks`): elsewhere (llama.cpp, torch's batched prefill) the cut changes a prompt's
rounding, and a request must get the same answer alone or among others, so the chunk never follows the
load there. A lone request on a quiet server then prefills in the backend's efficient pieces (each chunk
reads every weight once: a 700-token prompt in chunks of 32 reads them 22 times).

KV pool: `kv_pool_tokens` cache positions of the target shared by the running requests. A request
holds its reservation (prompt + initial spare at admission); when a step would write past it, the
reservation grows as the cache does (doubling, capped at what the request can use, never less than
the step needs). If the pool cannot give that, the request finishes with finish_reason "length"
(its text so far is kept). Reservations return to the pool when requests end, fail or are
cancelled. Draft models' caches are not counted (they grow the same way, at their own size per
position). `max_model_len` caps prompt + new tokens.

Every request owns its `torch.Generator`, so a seeded request gives the same tokens alone or
batched. An exception inside one request fails that request only; a request refused for its own
input (a prompt too long, an unknown drafter) is not counted as a generation. The worker notes when
it last went round its loop (`stalled_seconds`) and keeps the last turns' work (`turns`: which
requests were prefilled by how many tokens, which were stepped) for tests and debugging.

Stopping (`stop()`, the server's graceful shutdown): running requests end at once with finish
reason "shutdown" and their text so far; waiting ones fail with `ServerStoppingError` (503).

Results travel to the request's asyncio loop as `JobUpdate`s through `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from verispec.control.costs import prefill_seconds_per_token, riding_seconds
from verispec.engine import Engine, Generation, GenerationConfig, StepPlan
from verispec.engine.loop import PromptChunk
from verispec.engine.together import StepAccount, draft_plans, forward_rows, mixes_prompts, prompt_row, verification_row
from verispec.errors import PromptError, VerispecError
from verispec.models.openmp import release_thread_pool
from verispec.models.prefixes import MIN_REUSE, shared_length
from verispec.models.runner import Cache
from verispec.serving.http.limits import ServerLimits
from verispec.serving.http.metrics import Metrics
from verispec.types import GenerationStats, TokenEvent

__all__ = ["Scheduler", "Job", "JobUpdate", "QueueFullError", "RequestTimeoutError", "ServerStoppingError", "Turn", "live_stats",
           "SHUTDOWN_FINISH_REASON", "auto_prefill_chunk", "default_kv_pool_tokens", "kv_bytes_per_token",
           "memory_limits", "prefill_chunks"]

Encoder = Callable[[Engine], list[int]]  # runs on the worker: request → prompt token ids
PREFILL_BUDGET_SECONDS = 0.15  # what one prefill chunk may add to the decoding requests' step
IDLE_PREFILL_BUDGET_SECONDS = 1.5  # a chunk while nothing decodes: what a request arriving then may wait for its turn
STARVATION_TURNS = 4  # a prompt passed over for shorter ones this many prefill turns in a row goes next
POOL_TOKENS_PER_SLOT = 2048  # the default pool: this many positions per batch slot (at least one full-length request)
POOL_HEADROOM = 64  # a full-length request's draft positions past max_model_len


def default_kv_pool_tokens(max_model_len: int, max_batch: int) -> int:
    """The pool `serve` uses unless told: room for one request of `max_model_len` positions, or
    `POOL_TOKENS_PER_SLOT` per batch slot, whichever is more."""
    return max(max_model_len + POOL_HEADROOM, POOL_TOKENS_PER_SLOT * max_batch)


def auto_prefill_chunk(engine: Engine, budget: float = PREFILL_BUDGET_SECONDS, riding: bool = False) -> int:
    """The most prompt tokens (a power of two in 8…512) the target prefills within `budget` seconds, each size
    timed as it is (a small chunk costs more per token than a large one); `riding`: that a chunk adds to the
    decoding requests' pass it rides in (`riding_seconds`: less, the weights being read for them anyway)."""
    def seconds(chunk: int) -> float:
        return riding_seconds(engine.target, chunk) if riding else prefill_seconds_per_token(engine.target, chunk) * chunk

    chunk = 8
    while chunk < 512 and seconds(2 * chunk) <= budget:
        chunk *= 2
    return chunk


def prefill_chunks(engine: Engine, prefill_chunk: int | None) -> tuple[int, int]:
    """(prompt tokens a turn feeds while requests decode, while none does; 0: a whole prompt). A set
    `prefill_chunk` is both; None: `auto_prefill_chunk` within PREFILL_BUDGET_SECONDS (what the chunk adds to the
    pass it rides in where the target `mixes_prompts`), and while nothing decodes within IDLE_PREFILL_BUDGET_SECONDS
    where the target is `prefix_invariant` (elsewhere the same)."""
    if prefill_chunk is not None:
        return prefill_chunk, prefill_chunk
    busy = auto_prefill_chunk(engine, riding=mixes_prompts(engine.target.runner))
    if not engine.target.runner.prefix_invariant:
        return busy, busy
    return busy, auto_prefill_chunk(engine, IDLE_PREFILL_BUDGET_SECONDS)


def memory_limits(engine: Engine, max_batch: int, kv_pool_tokens: int | None, max_model_len: int | None) -> tuple[int, int]:
    """(KV pool positions, most positions per request) as a server runs them: the defaults filled in
    (`default_kv_pool_tokens`, the target's context) and both checked. Raises ValueError."""
    context = engine.target.context_length
    max_model_len = context if max_model_len is None else max_model_len
    if not 2 <= max_model_len <= context:
        raise ValueError(f"max_model_len must lie in 2…{context} (the target's context), got {max_model_len}")
    kv_pool_tokens = default_kv_pool_tokens(max_model_len, max_batch) if kv_pool_tokens is None else kv_pool_tokens
    if kv_pool_tokens < 1:
        raise ValueError(f"kv_pool_tokens must be ≥ 1, got {kv_pool_tokens}")
    return kv_pool_tokens, max_model_len


def kv_bytes_per_token(engine: Engine) -> int | None:
    """Bytes one target cache position takes (keys + values of every layer), where the runner says
    (verispec's own runner); None otherwise (llama.cpp and Hugging Face keep their own caches)."""
    return engine.target.runner.cache_bytes_per_position


class QueueFullError(VerispecError):
    """Every slot and every queue place is taken; `retry_after` seconds is a guess of when one frees."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class RequestTimeoutError(VerispecError):
    """A request ran past the server's per-request time limit."""


class ServerStoppingError(VerispecError):
    """The server is shutting down: the request is refused, or was stopped (a 503)."""

    def __init__(self, message: str = "the server is shutting down: retry on another server or later"):
        super().__init__(message)


SHUTDOWN_FINISH_REASON = "shutdown"  # of the requests still running when the scheduler stops


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
    prompt_logprobs: list | None = None  # "finished": each prompt token's (`GenerationConfig.prompt_logprobs`)


@dataclass(frozen=True)
class Turn:
    """What one turn of the worker did: prompt tokens fed per job id, the job ids stepped, and whether the prompt
    chunk rode in the step's pass (`mixes_prompts`)."""

    prefilled: dict[int, int]
    stepped: tuple[int, ...]
    mixed: bool = False


def live_stats(stats: GenerationStats) -> dict:
    return {
        "steps": stats.steps,
        "mean_accepted_length": round(stats.mean_accepted_length, 4),
        "acceptance_rate": round(stats.acceptance_rate, 4),
        "per_position_acceptance": [round(x, 4) for x in stats.per_position_acceptance],
    }


class Job:
    """One request as the worker sees it, and the asyncio side's handle to its updates.

    `encode` is the prompt's token ids, or a function that makes them on the worker (the HTTP server
    tokenizes in its handlers, off the worker; the Ray batch job lets the worker do it)."""

    _ids = itertools.count(1)

    def __init__(self, encode: Encoder | list[int], config: GenerationConfig, loop: asyncio.AbstractEventLoop, deadline: float):
        self.encode, self.config, self.loop, self.deadline = encode, config, loop, deadline
        self.id = next(Job._ids)
        self.prompt_ids: list[int] | None = list(encode) if isinstance(encode, list) else None
        self.updates: asyncio.Queue[JobUpdate] = asyncio.Queue()
        self.generation: Generation | None = None
        self.reserved = 0  # KV pool positions this request holds
        self.last_prefill_turn = 0  # the scheduler's prefill turn that last fed (or admitted) this request
        self.admitted_at = 0.0
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


class _Rider(NamedTuple):
    """A prompt chunk riding in a turn's step pass: whose, which ids, and `Scheduler._fed_mark` before it."""

    job: Job
    chunk: PromptChunk
    mark: tuple[int, int]


class Scheduler:
    """Owns the engine on one worker thread; `submit` from any thread or event loop.

    prefill_chunk: most prompt tokens fed per worker turn (None: `prefill_chunks`, measured now, and larger
    while no request decodes; 0: a whole prompt at once);
    kv_pool_tokens: target cache positions all running requests may hold together (default:
    `default_kv_pool_tokens`); max_model_len: most positions (prompt + new tokens) per request
    (default and at most: the target's context).
    """

    TURNS_KEPT = 4096

    def __init__(self, engine: Engine, metrics: Metrics | None = None, max_batch: int = ServerLimits.max_batch,
                 max_queue: int = ServerLimits.max_queue, request_timeout: float = ServerLimits.request_timeout,
                 prefill_chunk: int | None = ServerLimits.prefill_chunk, kv_pool_tokens: int | None = None,
                 max_model_len: int | None = None):
        ServerLimits(max_batch=max_batch, max_queue=max_queue, request_timeout=request_timeout, prefill_chunk=prefill_chunk,
                     kv_pool_tokens=kv_pool_tokens, max_model_len=max_model_len)  # their checks, with the server's
        kv_pool_tokens, max_model_len = memory_limits(engine, max_batch, kv_pool_tokens, max_model_len)
        self.engine, self.metrics = engine, metrics or Metrics()
        self.max_batch, self.max_queue, self.request_timeout = max_batch, max_queue, request_timeout
        self.prefill_chunk, self.idle_prefill_chunk = prefill_chunks(engine, prefill_chunk)
        self.mixes_prompts = mixes_prompts(engine.target.runner)  # a prompt chunk rides in the decoding requests' pass
        self.kv_pool_tokens, self.max_model_len = kv_pool_tokens, max_model_len
        self._waiting: deque[Job] = deque()
        self._work = threading.Condition()  # guards _waiting; notified on submit
        self._active: list[Job] = []
        self._prefilling: deque[Job] = deque()  # active jobs whose prompt is not all in, in admission order
        self._prefill_turns = 0  # prefill chunks fed so far (`Job.last_prefill_turn` counts in them)
        self.reserved_tokens = 0  # KV pool positions held by the active jobs
        self.turns: deque[Turn] = deque(maxlen=self.TURNS_KEPT)
        self._request_seconds = 0.0  # moving average of a request's time from admission to its end
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_turn = time.monotonic()  # when the worker last went round its loop
        self.metrics.add_gauge("verispec_queue_length", "Requests waiting for a batch slot.", lambda: len(self._waiting))
        self.metrics.add_gauge("verispec_active_generations", "Requests being decoded now.", lambda: len(self._active))
        self.metrics.add_gauge("verispec_prefilling_generations", "Requests whose prompt is being prefilled.",
                               lambda: len(self._prefilling))
        self.metrics.add_gauge("verispec_kv_pool_reserved_tokens", "Target cache positions the running requests hold.",
                               lambda: self.reserved_tokens)
        self.metrics.add_gauge("verispec_kv_pool_tokens", "Target cache positions the server may hand out.",
                               lambda: self.kv_pool_tokens)

    @property
    def queue_length(self) -> int:
        return len(self._waiting)

    @property
    def active_count(self) -> int:
        return len(self._active)

    @property
    def stalled_seconds(self) -> float:
        """How long the worker has not gone round its loop while requests wait or run (0: no work)."""
        if not (self._active or self._waiting):
            return 0.0
        return max(0.0, time.monotonic() - self._last_turn)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the worker thread; the calling thread (the one that loaded the models) lets its OpenMP pool go,
        which would otherwise slow every step of the worker's (`models/openmp.py`), as the worker does its own
        whenever it falls idle."""
        release_thread_pool()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="verispec-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        with self._work:
            self._work.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def limit_config(self, prompt_len: int, config: GenerationConfig) -> GenerationConfig:
        """`config` with max_new_tokens capped so that prompt + new tokens ≤ max_model_len; a prompt
        that leaves no room is a PromptError (a 400)."""
        if prompt_len >= self.max_model_len:
            raise PromptError(f"the prompt has {prompt_len} tokens but this server takes at most {self.max_model_len} "
                              "positions per request (prompt + new tokens): shorten the prompt")
        room = self.max_model_len - prompt_len
        return config if config.max_new_tokens <= room else replace(config, max_new_tokens=room)

    def submit(self, encode: Encoder | list[int], config: GenerationConfig, loop: asyncio.AbstractEventLoop | None = None) -> Job:
        """Queue a request: its prompt ids (checked against max_model_len now) or a function making them
        on the worker. Raises QueueFullError when `max_queue` requests already wait."""
        if isinstance(encode, list):
            config = self.limit_config(len(encode), config)
        job = Job(encode, config, loop or asyncio.get_running_loop(), time.monotonic() + self.request_timeout)
        with self._work:
            if len(self._waiting) >= self.max_queue:  # clients that left while waiting give their place up
                gone = [waiting for waiting in self._waiting if waiting.cancelled]
                self._waiting = deque(waiting for waiting in self._waiting if not waiting.cancelled)
                for _ in gone:
                    self.metrics.record_finished("cancelled")
            if len(self._waiting) >= self.max_queue:
                raise QueueFullError(
                    f"the server is at capacity ({len(self._active)} running, {len(self._waiting)} waiting): retry later",
                    self._retry_after())
            self._waiting.append(job)
            self._work.notify()
        return job

    def _retry_after(self) -> int:
        """Seconds until a queue place is likely free: the queue's turns at the recent request time."""
        turns = math.ceil((len(self._waiting) + 1) / self.max_batch)
        return min(60, max(1, math.ceil(turns * self._request_seconds)))

    # ---- worker thread -------------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        pooled = False  # whether this thread's OpenMP pool may be alive: it has worked since it last let it go
        while not self._stop.is_set():
            self._last_turn = time.monotonic()
            try:
                self._drop_finished_early()
                self._admit()
                if (turn := self._turn()) is not None:
                    self.turns.append(turn)
                    pooled = True
                elif pooled and not self._active:  # idle: its pool would slow whichever thread works next
                    release_thread_pool()
                    pooled = False
            except Exception as error:  # noqa: BLE001 — a bug outside any one request: fail the batch, keep serving
                for job in list(self._active):
                    self._fail(job, error, "error")
        for job in list(self._active):  # stopped: running requests end now, with their text so far
            self._end_early(job, SHUTDOWN_FINISH_REASON)
        with self._work:
            waiting, self._waiting = list(self._waiting), deque()
        for job in waiting:
            job.push(JobUpdate("failed", error=ServerStoppingError()))

    def _head(self) -> Job | None:
        """The first waiting job (idle: wait a little for one instead of spinning)."""
        with self._work:
            if not self._waiting and not self._active and not self._stop.is_set():
                self._work.wait(0.05)
            return self._waiting[0] if self._waiting else None

    def _pop(self, job: Job) -> None:
        with self._work:
            self._waiting.remove(job)

    def _admit(self) -> None:
        while len(self._active) < self.max_batch and (job := self._head()) is not None:
            if job.cancelled:
                self._pop(job)
                self.metrics.record_finished("cancelled")
                continue
            try:
                if job.prompt_ids is None:  # tokenized here (callers that did not do it themselves)
                    job.prompt_ids = self.engine.prompt_ids(job.encode(self.engine))
                    job.config = self.limit_config(len(job.prompt_ids), job.config)
                need = Generation.capacities(self.engine, len(job.prompt_ids), job.config)[0]
                if need > self.kv_pool_tokens:
                    raise PromptError(f"the prompt ({len(job.prompt_ids)} tokens) and its first new tokens need {need} cache "
                                      f"positions but this server's pool holds {self.kv_pool_tokens}: shorten the prompt")
                if self.reserved_tokens + need > self.kv_pool_tokens:
                    return  # the head waits for running requests to give back room; no one overtakes it
                self._pop(job)
                job.generation = Generation(self.engine, job.prompt_ids, job.config, prefill=False)
            except Exception as error:  # noqa: BLE001 — a bad prompt fails its own request only
                if job in self._waiting:
                    self._pop(job)
                self._fail(job, error, None if isinstance(error, VerispecError) else "error")
                continue
            job.reserved = job.generation.initial_capacity
            self.reserved_tokens += job.reserved
            job.admitted_at = time.monotonic()
            self._active.append(job)
            job.last_prefill_turn = self._prefill_turns
            self._prefilling.append(job)
            self.metrics.record_admitted(job.generation.prompt_len)
            job.push(JobUpdate("admitted", prompt_tokens=job.generation.prompt_len))

    def _drop_finished_early(self) -> None:
        """Cancelled requests and those past their deadline leave, running or waiting: a request that
        waited its whole time limit in the queue ends then, not once it reaches the queue's head."""
        now = time.monotonic()
        with self._work:
            expired = [job for job in self._waiting if job.cancelled or now > job.deadline]
            self._waiting = deque(job for job in self._waiting if job not in expired)
        for job in expired:
            if job.cancelled:
                self.metrics.record_finished("cancelled")
            else:
                self._fail(job, RequestTimeoutError(
                    f"the request waited {self.request_timeout:g} s, the server's limit, without starting: "
                    "the server is busy, retry later"), "timeout")
        for job in list(self._active):
            if job.cancelled:
                self._remove(job)
                self.metrics.record_finished("cancelled")
            elif now > job.deadline:
                self._fail(job, RequestTimeoutError(
                    f"the request ran past the server's limit of {self.request_timeout:g} s: ask for fewer tokens"), "timeout")

    def _remove(self, job: Job) -> None:
        """Take an active job off the worker: close its generation, give back its pool share."""
        self._active.remove(job)
        if job in self._prefilling:
            self._prefilling.remove(job)
        job.generation.close()
        self.reserved_tokens -= job.reserved
        job.reserved = 0
        seconds = time.monotonic() - job.admitted_at
        self._request_seconds = seconds if not self._request_seconds else 0.8 * self._request_seconds + 0.2 * seconds

    def _fail(self, job: Job, error: BaseException, reason: str | None) -> None:
        """End `job` with `error`; `reason` None: refused before it started (not a finished generation)."""
        if job in self._active:
            self._remove(job)
        if reason is not None:
            self.metrics.record_finished(reason)
        job.push(JobUpdate("failed", error=error))

    def _next_prefill(self) -> Job:
        """The prompt with the fewest tokens left (the first admitted among equals), unless one has been
        passed over STARVATION_TURNS prefill turns in a row: then the one passed over longest. A prompt
        another request is prefilling already waits for it (`_donor`), and a prompt others wait for goes
        before the rest."""
        donors = {job.id: self._donor(job) for job in self._prefilling}
        ready = [job for job in self._prefilling if donors[job.id] is None]
        starved = min(ready, key=lambda job: job.last_prefill_turn)
        if self._prefill_turns - starved.last_prefill_turn > STARVATION_TURNS:
            return starved
        awaited = [job for job in ready if job in donors.values()]
        return min(awaited or ready, key=lambda job: job.generation.prompt_len - job.generation.cache.length)

    def _donor(self, job: Job) -> Job | None:
        """The request `job` waits for: `job` has not begun its prompt while that one, begun, is prefilling at least
        MIN_REUSE tokens of it that its cache does not hold yet (with a prompt cache `job` then starts from
        that one's); None: `job` is ready. A donor has begun, so it never waits: someone is always ready."""
        if self.engine.prefixes is None or job.generation.cache.length:
            return None
        most = len(job.prompt_ids) - 1  # the prompt's last token is always fed: it gives the first new token
        for other in self._prefilling:
            done = other.generation.cache.length
            if other is not job and done and done < (shared := min(shared_length(other.prompt_ids, job.prompt_ids), most)) \
                    and shared >= MIN_REUSE:
                return other
        return None

    def _running_caches(self, job: Job) -> list[tuple[list[int], Cache]]:
        """Every other running request's (tokens, target cache), to start `job`'s prefill from (a prompt cache only)."""
        if self.engine.prefixes is None or job.generation.cache.length:
            return []
        return [(other.generation.ids, other.generation.cache) for other in self._active
                if other is not job and other.generation.cache.length]

    def _turn(self) -> Turn | None:
        """One turn's passes: a step of every decoding request and a chunk of one prompt (`_next_prefill`). The chunk
        rides in the step's pass where the target mixes prompts into it (`mixes_prompts`: each answer as alone, the
        weights read once for both), else it goes in a pass of its own after the step. None: nothing to do."""
        decoding = [job for job in self._active if job.generation.prefilled]
        job, rider = self._choose_prefill(), None
        if job is not None and decoding and self.mixes_prompts:
            rider = self._rider(job)
            if rider is not None or job not in self._active:  # it rides, or making its chunk failed it
                job = None
        stepped, prefilled = self._step(decoding, rider) if decoding else ((), {})
        if job is not None:
            prefilled = self._prefill_alone(job)
        return Turn(prefilled, stepped, rider is not None) if prefilled or stepped else None

    def _choose_prefill(self) -> Job | None:
        """The prefilling request whose turn it is (`_next_prefill`), its turn counted; None: none is prefilling."""
        if not self._prefilling:
            return None
        job = self._next_prefill()
        self._prefill_turns += 1
        job.last_prefill_turn = self._prefill_turns
        return job

    def _prefill(self) -> dict[int, int]:
        """Feed one chunk of one prefilling request's prompt (`_next_prefill`) in a pass of its own; {job id: tokens fed}."""
        job = self._choose_prefill()
        return {} if job is None else self._prefill_alone(job)

    def _prefill_alone(self, job: Job) -> dict[int, int]:
        generation = job.generation
        mark = self._fed_mark(job)
        quiet = not any(other.generation.prefilled for other in self._active)  # no request decodes
        own_part = generation.cache.length < generation.prompt_len  # the target's prefill, not its draft's
        chunk = self.idle_prefill_chunk if quiet and own_part else self.prefill_chunk
        try:
            done = generation.prefill_step(chunk or None, self._running_caches(job))
        except Exception as error:  # noqa: BLE001
            self._fail(job, error, "error")
            return {}
        return self._prefilled(job, done, mark)

    @staticmethod
    def _fed_mark(job: Job) -> tuple[int, int]:
        """(cache positions, positions copied from a cache) before a prefill chunk: what `_prefilled` counts from."""
        return job.generation.cache.length, job.generation.stats.cached_tokens

    def _prefilled(self, job: Job, done: bool, mark: tuple[int, int]) -> dict[int, int]:
        """After a chunk of `job`'s prefill: the cached positions it took counted, the first token sent if it came, the
        request finished if that token ended it; {job id: tokens fed}."""
        generation, (before, copied) = job.generation, mark
        if done:
            self._prefilling.remove(job)
        if reused := generation.stats.cached_tokens - copied:  # positions copied from a cache, not fed
            self.metrics.record_cached(reused)
        fed = generation.cache.length - before - reused
        if held := generation.take_held():  # the first token came with the prompt's last chunk
            job.push(JobUpdate("tokens", events=held, live=live_stats(generation.stats)))
        if generation.done:  # that token ended it (an EOS ends it with no event to send)
            self._finished(job)
        return {job.id: fed}

    def _rider(self, job: Job) -> _Rider | None:
        """`job`'s next prompt chunk (busy-sized) to ride in the step's pass; None where its next prefill work is not
        the target's prompt (`Generation.prompt_chunk`) or making the chunk failed (the request then failed)."""
        mark = self._fed_mark(job)
        try:
            chunk = job.generation.prompt_chunk(self.prefill_chunk or None, self._running_caches(job))
        except Exception as error:  # noqa: BLE001
            self._fail(job, error, "error")
            return None
        return None if chunk is None else _Rider(job, chunk, mark)

    def _step(self, decoding: list[Job], rider: _Rider | None = None) -> tuple[tuple[int, ...], dict[int, int]]:
        """One step of every `decoding` request, in ONE target pass with `rider`'s prompt chunk if given:
        (the job ids stepped, {rider's job id: tokens fed})."""
        started = time.perf_counter()
        account = StepAccount()
        jobs: list[Job] = []
        plans: list[StepPlan] = []
        riding = len(rider.chunk.tokens) if rider is not None else 0  # priced with the drafts' positions
        for job, plan in zip(decoding, draft_plans([job.generation for job in decoding], account, riding)):
            if isinstance(plan, BaseException):
                self._fail(job, plan, "error")
                continue
            if self._reserve(job, job.generation.cache.length + len(plan.feed)):
                plans.append(plan)
                jobs.append(job)
        rows = [verification_row(job.generation, plan) for job, plan in zip(jobs, plans)]
        if rider is not None:
            rows.append(prompt_row(rider.job.generation, rider.chunk))
        if not rows:
            return (), {}
        target_started = time.perf_counter()
        out = forward_rows(self.engine.target.runner, rows)
        target_seconds = time.perf_counter() - target_started
        account.passed(target_seconds, rows)
        prefilled = self._rider_fed(rider, out.pop(), target_seconds) if rider is not None else {}
        for job, plan, logits in zip(jobs, plans, out):
            if isinstance(logits, BaseException):
                self._fail(job, logits, "error")
                continue
            self._commit(job, plan, logits, target_seconds)
        if jobs:
            account.total = time.perf_counter() - started
            self.metrics.record_step(len(jobs), account)
        return tuple(job.id for job in jobs), prefilled

    def _rider_fed(self, rider: _Rider, logits: torch.Tensor | None | BaseException, seconds: float) -> dict[int, int]:
        """The rider's part of the pass came back (its chunk's logits, or the error that failed it alone)."""
        job = rider.job
        try:
            if isinstance(logits, BaseException):
                raise logits
            done = job.generation.prompt_chunk_fed(logits, seconds)
        except Exception as error:  # noqa: BLE001
            self._fail(job, error, "error")
            return {}
        fed = self._prefilled(job, done, rider.mark)
        self.metrics.record_riding(fed[job.id])
        return fed

    def _reserve(self, job: Job, needed: int) -> bool:
        """Make the job's reservation cover `needed` cache positions, growing it as its cache grows
        (doubling, capped at what the request can use). Out of pool: the job finishes ("length")."""
        if needed <= job.reserved:
            return True
        grown = max(needed, min(2 * job.reserved, job.generation.max_capacity))
        if self.reserved_tokens - job.reserved + grown > self.kv_pool_tokens:
            self._end_early(job, "length")
            return False
        self.reserved_tokens += grown - job.reserved
        job.reserved = grown
        return True

    def _end_early(self, job: Job, reason: str) -> None:
        """Finish `job` now with `reason`; the text it held back for a stop string that can no longer
        come goes out first, in an event repeating the last token."""
        generation = job.generation
        if held_back := generation.cancel(reason):
            event = TokenEvent(generation.output_ids[-1], held_back, generation.origins[-1])
            job.push(JobUpdate("tokens", events=[event], live=live_stats(generation.stats)))
        self._finished(job)

    def _finished(self, job: Job) -> None:
        generation = job.generation
        self._remove(job)
        self.metrics.record_finished(generation.finish_reason)
        job.push(JobUpdate("finished", finish_reason=generation.finish_reason, stats=generation.stats,
                           prompt_logprobs=generation.prompt_logprobs))

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
            self._finished(job)
