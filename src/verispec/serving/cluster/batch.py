"""`verispec batch`: generation over a file of prompts with a pool of engine actors on Ray Data.

Each record is a completion request: `id`, `prompt` (text or token ids) or `messages` (chat), and
optionally the server's sampling fields (`max_tokens`, `temperature`, `top_p`, `top_k`, `min_p`,
`eta`, `epsilon`, `repetition_penalty`, `presence_penalty`, `frequency_penalty`, `logit_bias`, `seed`, `stop`) and `chat` (wrap a text prompt in the chat
template, default true). They are validated by the server's own request schema.

The driver reads the input, skips the ids already written (a rerun resumes), and hands the rest to
`map_batches` over a fixed pool of `EngineActor`s (or, with `local`, to one EngineActor in this
process, no Ray needed: the single-process baseline): each loads the target and drafter once and runs
every batch of records through the server's continuous-batching `Scheduler` (all records of a batch
verified together in one target pass per step). Results stream back to the driver, which shows
progress and writes them as whole part files (`verispec.serving.cluster.batch_io`). A record that fails
(invalid settings, prompt too long, …) becomes an error record with its reason; at the end the
written ids are checked against the input ids, and a summary per actor and in total is printed.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, ValidationError, model_validator
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from verispec.serving.cluster.batch_io import FORMATS, IdCheck, InputRecord, PartWriter, check_ids, input_format, read_input, written_ids
from verispec.serving.cluster.cluster import require_ray, worker_threads
from verispec.errors import InvalidParameterError, VerispecError
from verispec.serving.http.schemas import ChatMessage, CompletionRequest
from verispec.types import AcceptanceStats

__all__ = ["BatchRecord", "BatchOptions", "BatchReport", "EngineActor", "Tally", "run_batch", "print_report"]

RESULT_STATS = ("prompt_tokens", "new_tokens", "steps", "proposed_tokens", "accepted_tokens", "judged_tokens",
                "mean_accepted_length", "acceptance_rate", "per_position_acceptance", "draft_seconds", "target_seconds",
                "wall_seconds", "tokens_per_second")


class BatchRecord(CompletionRequest):
    """One input record: a completion request with an id (unknown fields are refused, to catch typos)."""

    model_config = ConfigDict(extra="forbid")
    id: str | int
    model: str = Field("", description="ignored: the job's engine answers every record")
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="default: the job's --max-new-tokens")
    chat: bool = Field(True, description="wrap a text prompt in the model's chat template (when it has one)")
    logprobs: None = Field(None, description="not returned by batch jobs: absent only")
    echo: Literal[False] = Field(False, description="not returned by batch jobs: false only")

    @model_validator(mode="after")
    def _one_prompt(self) -> BatchRecord:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' (text or token ids) and 'messages' (a chat)")
        if self.n != 1:
            raise ValueError("n: a record gets one answer; repeat the record with another id for more")
        if self.suffix and self.messages is not None:
            raise ValueError("suffix: goes with a text 'prompt' (the text before the gap), not with 'messages'")
        return self


@dataclass(frozen=True)
class BatchOptions:
    actors: int = 1
    actor_cpus: float = 1.0
    batch_size: int = 8  # records per actor call, generated together
    max_tokens: int = 128  # for records without max_tokens
    temperature: float = 0.0  # for records without temperature
    output_format: str | None = None  # default: the input's
    limit: int | None = None  # run at most this many of the pending records (a rerun does the rest)
    flush_every: int = 64  # records per part file (also flushed every 10 s and at the end)
    record_timeout: float = 600.0
    local: bool = False  # one engine in this process, no Ray (same files, resume and checks)

    def __post_init__(self) -> None:
        if self.actors < 1 or self.batch_size < 1 or self.flush_every < 1 or self.actor_cpus <= 0:
            raise InvalidParameterError("--actors, --batch-size and --flush-every must be ≥ 1 and --actor-cpus > 0")
        if self.output_format not in (None, *FORMATS):
            raise InvalidParameterError(f"--output-format must be one of {', '.join(FORMATS)}, got {self.output_format!r}")
        if self.limit is not None and self.limit < 1:
            raise InvalidParameterError(f"--limit must be ≥ 1, got {self.limit}")


def _error_row(record_id: str, message: str, error_type: str, actor: str) -> dict:
    return {"id": record_id, "error": message, "error_type": error_type, "actor": actor}


class EngineActor:
    """A Ray Data actor: loads the engine once, then generates each batch of records together."""

    def __init__(self, loader: Callable, defaults: dict, max_tokens: int, batch_size: int, num_cpus: float, record_timeout: float):
        import torch

        from verispec.serving.http.scheduler import Scheduler

        torch.set_num_threads(worker_threads(num_cpus))
        self.engine = loader()
        self.defaults, self.max_tokens = defaults, max_tokens
        # a call's records all wait in the queue at once (Ray Data's batches hold batch_size; any size works)
        self.scheduler = Scheduler(self.engine, max_batch=batch_size, max_queue=max(1024, 4 * batch_size), request_timeout=record_timeout)
        self.scheduler.start()
        # the jobs' updates arrive on an event loop of our own (the calling thread may already run one)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="verispec-batch-loop", daemon=True).start()
        self.name = f"{socket.gethostname()}:{os.getpid()}"

    def __call__(self, batch: dict) -> dict:
        started = time.perf_counter()
        rows = asyncio.run_coroutine_threadsafe(self._generate(list(zip(batch["id"], batch["record"]))), self.loop).result()
        share = (time.perf_counter() - started) / max(len(rows), 1)  # this actor's busy time, split over the batch
        kinds = [row.pop("_kind") for row in rows]
        return {"id": [row["id"] for row in rows], "kind": kinds, "payload": [json.dumps(row, ensure_ascii=False) for row in rows],
                "actor": [self.name] * len(rows), "seconds": [share] * len(rows)}

    async def _generate(self, items: list[tuple[str, str]]) -> list[dict]:
        from verispec.serving.http.errors import describe_invalid
        from verispec.serving.request import chat_prompt_ids, request_config

        rows, jobs = [], []
        for record_id, raw in items:
            record_id = str(record_id)
            try:
                request = BatchRecord.model_validate({**self.defaults, **json.loads(raw)})
                config = request_config(request, self.max_tokens)
            except ValidationError as error:
                rows.append({"_kind": "errors", **_error_row(record_id, describe_invalid(error.errors())[1], "InvalidParameterError", self.name)})
                continue
            except VerispecError as error:
                rows.append({"_kind": "errors", **_error_row(record_id, str(error), type(error).__name__, self.name)})
                continue
            if request.messages is not None:
                encode = lambda engine, messages=request.messages: chat_prompt_ids(engine, messages)  # noqa: E731
            else:
                encode = lambda engine, prompt=request.prompt, chat=request.chat, suffix=request.infill(): (  # noqa: E731
                    engine.prompt_ids(prompt, chat, suffix))
            jobs.append((record_id, self.scheduler.submit(encode, config)))
        rows += await asyncio.gather(*(self._finish(record_id, job) for record_id, job in jobs))
        return rows

    async def _finish(self, record_id: str, job) -> dict:
        try:
            while (await job.next()).kind != "finished":
                pass
        except Exception as error:  # noqa: BLE001 — this record's failure is this record's answer
            return {"_kind": "errors", **_error_row(record_id, str(error) or type(error).__name__, type(error).__name__, self.name)}
        result = job.generation.result()
        stats = result.stats.to_dict()
        return {"_kind": "results", "id": record_id, "text": result.text, "token_ids": result.token_ids,
                "finish_reason": result.finish_reason, **{key: stats[key] for key in RESULT_STATS}, "actor": self.name}


@dataclass
class Tally:
    """Work done by one actor (or all of them): records, tokens, speculative statistics, busy seconds."""

    results: int = 0
    errors: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    # the records' step totals (a result row carries no per-position counts, so those stay empty)
    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)

    def add(self, kind: str, row: dict, seconds: float) -> None:
        self.seconds += seconds
        if kind == "errors":
            self.errors += 1
            return
        self.results += 1
        self.new_tokens += row["new_tokens"]
        self.acceptance.merge(AcceptanceStats.from_dict(row))

    @property
    def tau(self) -> float:
        """τ: tokens per verification step (accepted + 1)."""
        return self.acceptance.tau

    @property
    def alpha(self) -> float:
        return self.acceptance.alpha

    def to_dict(self, seconds: float | None = None) -> dict:
        acceptance = self.acceptance
        return {"results": self.results, "errors": self.errors, "new_tokens": self.new_tokens, "steps": acceptance.steps,
                "accepted": acceptance.accepted, "judged": acceptance.judged, "seconds": self.seconds,
                "tau": round(self.tau, 4), "alpha": round(self.alpha, 4),
                "tokens_per_second": round(self.tokens_per_second(seconds), 3)}

    def tokens_per_second(self, seconds: float | None = None) -> float:
        seconds = self.seconds if seconds is None else seconds
        return self.new_tokens / seconds if seconds > 0 else 0.0


@dataclass
class BatchReport:
    """What a run did and what the output directory holds afterwards."""

    skipped: int  # ids already written by earlier runs
    ran: int  # records this run handled (results + errors)
    left: int  # pending records not run (--limit)
    wall_seconds: float
    total: Tally
    actors: dict[str, Tally] = field(default_factory=dict)
    check: IdCheck | None = None
    interrupted: bool = False

    def to_dict(self) -> dict:
        return {"skipped": self.skipped, "ran": self.ran, "left": self.left, "wall_seconds": round(self.wall_seconds, 3),
                "interrupted": self.interrupted, "total": self.total.to_dict(self.wall_seconds),
                "actors": {name: t.to_dict() for name, t in self.actors.items()},
                "check": None if self.check is None else {**asdict(self.check), "complete": self.check.complete}}


class _Sink:
    """Buffers rows by kind and writes them as part files every `flush_every` rows or 10 s."""

    def __init__(self, out_dir: Path, fmt: str, flush_every: int):
        run_id = uuid.uuid4().hex[:8]
        self.writers = {kind: PartWriter(out_dir, kind, fmt, run_id) for kind in ("results", "errors")}
        self.buffers: dict[str, list[dict]] = {kind: [] for kind in self.writers}
        self.flush_every, self.flushed_at = flush_every, time.monotonic()

    def add(self, kind: str, row: dict) -> None:
        self.buffers[kind].append(row)
        if sum(map(len, self.buffers.values())) >= self.flush_every or time.monotonic() - self.flushed_at > 10:
            self.flush()

    def flush(self) -> None:
        for kind, rows in self.buffers.items():
            self.writers[kind].write(rows)
            rows.clear()
        self.flushed_at = time.monotonic()


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), TimeRemainingColumn(), console=console)


def run_batch(loader: Callable, input_path: str | Path, out_dir: str | Path, options: BatchOptions = BatchOptions(),
              console: Console | None = None) -> BatchReport:
    """Generate every record of `input_path` not yet written under `out_dir` (Ray must be initialised unless local)."""
    console = console or Console(stderr=True, highlight=False)
    input_path, out_dir = Path(input_path), Path(out_dir)
    records = read_input(input_path)
    fmt = options.output_format or input_format(input_path)
    done = written_ids(out_dir)
    already = set(done["results"]) | set(done["errors"])
    pending = [r for r in records if r.id not in already]
    left = max(0, len(pending) - options.limit) if options.limit else 0
    pending = pending[: options.limit] if options.limit else pending
    console.print(f"{len(records)} records in {input_path}: {len(already & {r.id for r in records})} already written, "
                  f"{len(pending)} to run" + (f" now, {left} left for a later run (--limit)" if left else ""))

    sink = _Sink(out_dir, fmt, options.flush_every)
    total, actors = Tally(), {}
    started = time.perf_counter()
    interrupted = False
    try:
        for record in (r for r in pending if r.record is None):  # unusable lines: errors without any model
            sink.add("errors", _error_row(record.id, record.problem, "InvalidRecordError", "driver"))
            total.add("errors", {}, 0.0)
        runnable = [r for r in pending if r.record is not None]
        if runnable:
            _generate_all(loader, runnable, options, sink, total, actors, console)
    except KeyboardInterrupt:
        interrupted = True
    except Exception as error:  # the Ray job itself failed (e.g. actors kept dying): keep what is done, say how to go on
        sink.flush()
        raise VerispecError(f"the batch job failed ({type(error).__name__}: {error}); the {total.results + total.errors} records "
                            "finished before are written: rerun the same command to resume") from error
    finally:
        sink.flush()
    wall = time.perf_counter() - started
    check = check_ids([r.id for r in records], out_dir)
    report = BatchReport(len(already), total.results + total.errors, left + (len(pending) - total.results - total.errors),
                         wall, total, actors, check, interrupted)
    (out_dir / "summary.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    return report


def _actor_args(loader: Callable, options: BatchOptions) -> tuple:
    return (loader, {"temperature": options.temperature}, options.max_tokens, options.batch_size, options.actor_cpus,
            options.record_timeout)


def _ray_batches(loader: Callable, items: list[dict], options: BatchOptions) -> Iterator[dict]:
    """Generated batches from a pool of `options.actors` EngineActors on Ray Data, as they finish."""
    ray = require_ray()
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # ours (in _generate_all) counts records and shows τ
    context.print_on_execution_start = False
    dataset = ray.data.from_items(items, override_num_blocks=min(200, -(-len(items) // options.batch_size)))
    generated = dataset.map_batches(
        EngineActor, batch_size=options.batch_size, batch_format="numpy", fn_constructor_args=_actor_args(loader, options),
        compute=ray.data.ActorPoolStrategy(size=options.actors), num_cpus=options.actor_cpus,
    )
    yield from generated.iter_batches(batch_size=None, batch_format="numpy")


def _local_batches(loader: Callable, items: list[dict], options: BatchOptions) -> Iterator[dict]:
    """The same work in this process, without Ray: one EngineActor, batch after batch."""
    actor = EngineActor(*_actor_args(loader, options))
    for start in range(0, len(items), options.batch_size):
        chunk = items[start : start + options.batch_size]
        yield actor({"id": [item["id"] for item in chunk], "record": [item["record"] for item in chunk]})


def _generate_all(loader: Callable, records: list[InputRecord], options: BatchOptions, sink: _Sink, total: Tally,
                  actors: dict[str, Tally], console: Console) -> None:
    items = [{"id": r.id, "record": json.dumps(r.record, ensure_ascii=False)} for r in records]
    batches = (_local_batches if options.local else _ray_batches)(loader, items, options)
    with _progress(console) as progress:
        task = progress.add_task("generating", total=len(items), stats="loading the models")
        for batch in batches:
            for kind, payload, actor, seconds in zip(batch["kind"], batch["payload"], batch["actor"], batch["seconds"]):
                row = json.loads(payload)
                sink.add(str(kind), row)
                total.add(str(kind), row, float(seconds))
                actors.setdefault(str(actor), Tally()).add(str(kind), row, float(seconds))
            progress.update(task, advance=len(batch["id"]),
                            stats=f"τ {total.tau:.2f} · α {total.alpha:.2f} · {total.new_tokens} tokens · {total.errors} errors")


def print_report(report: BatchReport, out_dir: Path, console: Console) -> None:
    """The per-actor and total table, then the id check."""
    table = Table(title=f"batch: {report.ran} records in {report.wall_seconds:.1f} s", title_justify="left")
    for column in ("actor", "results", "errors", "tokens", "busy s", "tok/s", "τ", "α"):
        table.add_column(column, justify="left" if column == "actor" else "right")
    def row(name: str, t: Tally, seconds: float) -> None:
        table.add_row(name, str(t.results), str(t.errors), str(t.new_tokens), f"{seconds:.1f}",
                      f"{t.tokens_per_second(seconds):.1f}", f"{t.tau:.2f}", f"{t.alpha:.2f}")

    for name, t in sorted(report.actors.items()):
        row(name, t, t.seconds)
    table.add_section()
    row("total", report.total, report.wall_seconds)
    console.print(table)
    console.print("(tok/s per actor: over the time the actor was generating; total: over the run's wall time)")
    if report.check is not None:
        style = "green" if report.check.complete else "yellow" if not (report.check.duplicated or report.check.unknown) else "red"
        console.print(f"[{style}]check:[/{style}] {report.check.describe()}")
    if report.interrupted or report.left:
        console.print(f"{report.left} records not run yet: rerun the same command to finish them (written ids are skipped)")
    console.print(f"results in {out_dir / 'results'}, errors in {out_dir / 'errors'}, summary in {out_dir / 'summary.json'}")
