"""The OpenAI-compatible HTTP API: `create_app(engine_or_loader)` builds the FastAPI app.

Endpoints: /v1/models, /v1/completions, /v1/chat/completions (streaming as SSE or not), /tokenize and
/detokenize (as vLLM's: a prompt's or chat's ids as generation encodes them, and back), /health, /metrics
(Prometheus text) and the playground at /. Handlers validate, hand the request to the
`Scheduler` (which owns the models on its worker thread) and relay its updates. Every error is
`{"error": {"message", "type", "param", "code"}}` with a status that says whose fault it was:
400/422 bad request (the message names the field), 401 no or wrong API key, 408 body too slow to
arrive, 413 body too large, 429 server full, 503 server shutting down, 504 too slow, 500 a failure inside
this one generation. `/health` is 503 "degraded" while the scheduler has work but has not gone round its
loop for `stall_seconds`, and 503 "stopping" once a shutdown has begun.

Shutdown (`begin_shutdown`, which `verispec.serving.http.server` calls on SIGTERM or Ctrl-C): new
requests are 503s at once; running ones go on for at most `shutdown_grace` seconds, then the scheduler
stops and ends them with their text so far — a stream with a last chunk whose finish_reason is
"shutdown", a non-streamed request with a 503 — and fails the queued ones with a 503. The engine's
prompt cache, where its backend keeps one, is then saved for the next process (as `verispec generate` does).

Limits (`verispec.serving.http.limits.ServerLimits`): `api_key` (every path but /health and /;
`verispec.serving.http.guard`), `max_body_bytes`, `body_timeout`, `max_tokens_limit` (a request asking
for more new tokens is refused, not capped), `max_queue` (429 with Retry-After), `max_model_len` (prompt +
new tokens per request), `kv_pool_tokens` (the target cache positions running requests share) and
`prefill_chunk` (see `Scheduler`); a request's drafter may use only the loaded models and no spec that
reads files (`verispec.serving.request.check_request_drafter`). `cors_origins` allows those browser origins.

Prompts are tokenized in the handler, on one tokenizer thread of their own (never on the
scheduler's worker), and a prompt longer than `max_model_len` is a 400 before it is queued.

`n` choices (at most `MAX_CHOICES`) are n requests to the scheduler, queued together (all or none) and
batched like any others, so each choice is what it would be alone; with a `seed`, choice i samples with
seed + i. A streamed response interleaves their chunks (each names its `index`); `usage` counts the prompt
once and every choice's tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse

from verispec.engine import Engine
from verispec.errors import PromptError, VerispecError
from verispec.serving.request import chat_prompt_ids, check_request_drafter, request_config
from verispec.serving.http.errors import describe_invalid, error_response
from verispec.serving.http.formats import ChatFormat, CompletionFormat, Echo, merged_stats, sse
from verispec.serving.http.guard import Guard
from verispec.serving.http.limits import ServerLimits
from verispec.serving.http.metrics import Metrics
from verispec.serving.http.scheduler import (
    SHUTDOWN_FINISH_REASON, Job, JobUpdate, QueueFullError, RequestTimeoutError, Scheduler,
    ServerStoppingError,
)
from verispec.serving.http.schemas import (
    ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse, DetokenizeRequest,
    DetokenizeResponse, ErrorResponse, ModelList, TokenizeRequest, TokenizeResponse, template_tools,
)
from verispec.types import GenerationStats

__all__ = ["create_app", "begin_shutdown"]

STATIC = Path(__file__).parent / "static"
DISCONNECT_POLL_SECONDS = 0.25
STOP_POLL_SECONDS = 0.1
ERROR_RESPONSES = {code: {"model": ErrorResponse} for code in (400, 401, 408, 413, 422, 429, 500, 503, 504)}


class ClientDisconnected(Exception):
    """The client went away before its answer was ready."""


def _error_headers(error: BaseException) -> dict[str, str] | None:
    """Retry-After on a 429: when a queue place is likely free."""
    return {"Retry-After": str(error.retry_after)} if isinstance(error, QueueFullError) else None


def _error_status(error: BaseException) -> tuple[int, str, str | None]:
    """(status, message, param) for an exception raised while serving one request."""
    if isinstance(error, QueueFullError):
        return 429, str(error), None
    if isinstance(error, RequestTimeoutError):
        return 504, str(error), None
    if isinstance(error, ServerStoppingError):
        return 503, str(error), None
    if isinstance(error, PromptError):  # about the request's prompt unless it names another field
        return 400, str(error), error.param or "prompt"
    if isinstance(error, VerispecError):
        return 400, str(error), error.param
    return 500, f"internal error in this generation ({type(error).__name__}: {error}); other requests are unaffected", None


def _submit(scheduler: Scheduler, prompts: list[list[int]], config, n: int) -> list[Job]:
    """Queue the request's `n` choices of each prompt together (answer i = prompt i // n, seeded seed + i), or none."""
    jobs: list[Job] = []
    try:
        for index, ids in enumerate(ids for ids in prompts for _ in range(n)):
            seed = None if config.seed is None else config.seed + index
            jobs.append(scheduler.submit(ids, dataclasses.replace(config, seed=seed)))
    except BaseException:
        for job in jobs:
            job.cancel()
        raise
    return jobs


async def _merged(jobs: list[Job]) -> AsyncIterator[tuple[int, JobUpdate]]:
    """Every job's updates as they come, each with its job's index, until every job has finished."""
    queue: asyncio.Queue[tuple[int, JobUpdate | None, BaseException | None]] = asyncio.Queue()

    async def relay(index: int, job: Job) -> None:
        try:
            while (update := await job.next()).kind in ("admitted", "tokens"):
                await queue.put((index, update, None))
            await queue.put((index, update, None))
        except BaseException as error:  # noqa: BLE001 — handed to the reader, which raises it
            await queue.put((index, None, error))

    relays = [asyncio.create_task(relay(index, job)) for index, job in enumerate(jobs)]
    try:
        running = len(jobs)
        while running:
            index, update, error = await queue.get()
            if error is not None:
                raise error
            running -= update.kind not in ("admitted", "tokens")
            yield index, update
    finally:
        for task in relays:
            task.cancel()


async def _next(job: Job, request: Request) -> JobUpdate:
    """The job's next update; cancels the job if the client disconnects while waiting."""
    while True:
        try:
            return await asyncio.wait_for(job.next(), DISCONNECT_POLL_SECONDS)
        except TimeoutError:
            if await request.is_disconnected():
                job.cancel()
                raise ClientDisconnected from None


def _tokenizer(request: Request):
    """The served target's tokenizer (token strings in log-probabilities)."""
    return request.app.state.scheduler.engine.target.tokenizer


def begin_shutdown(app: FastAPI) -> None:
    """Stop serving gracefully (safe from a signal handler or any thread): see the module docstring."""
    app.state.stopping.set()


async def _stop_when_asked(scheduler: Scheduler, stopping: threading.Event, grace: float) -> None:
    """Once `stopping` is set: wait until the scheduler has no work or `grace` seconds have passed, then
    stop it (it ends the running requests and fails the queued ones)."""
    while not stopping.is_set():
        await asyncio.sleep(STOP_POLL_SECONDS)
    deadline = time.monotonic() + grace
    while (scheduler.active_count or scheduler.queue_length) and time.monotonic() < deadline:
        await asyncio.sleep(STOP_POLL_SECONDS)
    await asyncio.to_thread(scheduler.stop)


def create_app(
    engine_or_loader: Engine | Callable[[], Engine],
    *,
    model_name: str | None = None,
    default_max_tokens: int = 256,
    limits: ServerLimits | None = None,
    **settings,
) -> FastAPI:
    """An app serving one engine. Pass a loader to load the models when the server starts.

    limits: the server's limits (default: `ServerLimits()`'s), each field also settable by keyword
    (`create_app(engine, max_batch=4)`); an impossible one is an InvalidParameterError now."""
    limits = ServerLimits(**settings) if limits is None else dataclasses.replace(limits, **settings)
    metrics = Metrics()
    tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="verispec-tokenizer")  # one: a tokenizer is not shared

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = engine_or_loader if isinstance(engine_or_loader, Engine) else engine_or_loader()
        engine.prepare()  # every measurement the engine's own drafter needs: now, not inside the first request
        if engine.drafter is not None:  # and what its sampled proposals need (`Drafter.prepare_sampling`)
            engine.drafter.prepare_sampling()
        if limits.max_batch > 1:  # and what a batch's pass costs (`control/batch.py`), not inside the first batch
            try:
                engine.costs_for(engine.drafter, engine.gamma_policy).prepare_batches()
            except Exception as error:  # noqa: BLE001 - batches then priced on the curve alone
                warnings.warn(f"a batch's pass costs could not be measured: {error}", RuntimeWarning, stacklevel=1)
        app.state.model_name = model_name or engine.target.name
        app.state.created = int(time.time())
        app.state.scheduler = Scheduler(engine, metrics, limits.max_batch, limits.max_queue, limits.request_timeout,
                                        limits.prefill_chunk, limits.kv_pool_tokens, limits.max_model_len)
        app.state.scheduler.start()
        stopper = asyncio.create_task(_stop_when_asked(app.state.scheduler, app.state.stopping, limits.shutdown_grace))
        try:
            yield
        finally:
            stopper.cancel()
            app.state.scheduler.stop()
            tokenizer_thread.shutdown(wait=False, cancel_futures=True)
            if engine.prefixes is not None:  # the prompt cache, for the next server or command (`models/prefixes.py`)
                await asyncio.to_thread(engine.prefixes.save)

    app = FastAPI(title="verispec", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible server for lossless speculative decoding")
    app.state.metrics = metrics
    app.state.model_name = None  # known once the models are loaded
    app.state.stopping = threading.Event()  # set by begin_shutdown
    app.state.shutdown_grace = limits.shutdown_grace
    app.add_middleware(Guard, api_key=limits.api_key, max_body_bytes=limits.max_body_bytes, body_timeout=limits.body_timeout)
    if limits.cors_origins:  # outermost: preflights and error answers get the CORS headers too
        app.add_middleware(CORSMiddleware, allow_origins=list(limits.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])

    default_openapi = app.openapi

    def openapi() -> dict:
        """FastAPI's schema, with `model` limited to the one model this server serves (known once loaded) or left out."""
        schema = default_openapi()
        name = app.state.model_name
        if name is not None:
            for body in ("CompletionRequest", "ChatCompletionRequest"):
                schema["components"]["schemas"][body]["properties"]["model"]["enum"] = [name, None]
        return schema

    app.openapi = openapi

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(*describe_invalid(exc.errors()))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", headers=exc.headers)

    def unknown_model(request: Request, model: str | None) -> JSONResponse | None:
        """The 400 for a `model` that is not the served one (None, left out, is the served one), else None."""
        served = request.app.state.model_name
        if model in (None, served):
            return None
        return error_response(400, f"model: unknown model {model!r}; this server serves {served!r} (see /v1/models)",
                              param="model", code="model_not_found")

    async def serve(request: Request, body: CompletionRequest | ChatCompletionRequest, endpoint: str,
                    encode: Callable[[Engine], list[list[int]]], fmt: CompletionFormat) -> Response:
        started = time.perf_counter()
        scheduler: Scheduler = request.app.state.scheduler
        if (response := unknown_model(request, body.model)) is None:
            jobs: list[Job] = []
            try:
                check_request_drafter(body.drafter, scheduler.engine.drafter_spec)
                config = request_config(body, default_max_tokens, limits.max_tokens_limit)
                fmt.with_logprobs = config.logprobs is not None
                # a drafter of the request's own is built (and its costs measured) here, not on the scheduler's thread
                await asyncio.to_thread(scheduler.engine.prepare, config.drafter, config.gamma_policy)
                prompts = await asyncio.get_running_loop().run_in_executor(tokenizer_thread, encode, scheduler.engine)
                if request.app.state.stopping.is_set():  # checked with no await before submit: a stopped scheduler admits none
                    raise ServerStoppingError()
                jobs = _submit(scheduler, prompts, config, body.n)
                await _next(jobs[0], request)  # "admitted": a batch slot and pool room (the prefill follows in chunks)
                if body.stream:
                    include_usage = body.stream_options is not None and body.stream_options.include_usage
                    return StreamingResponse(stream(jobs, body.n, fmt, endpoint, started, include_usage), media_type="text/event-stream")
                echoes = None
                if getattr(body, "echo", False):  # completions: the prompt before the answer
                    echoes = [Echo(prompt if isinstance(prompt, str) else _tokenizer(request).decode(ids), ids)
                              for prompt, ids in zip(body.prompts(), prompts)]
                response = JSONResponse(await collect(jobs, body.n, request, fmt, echoes))
            except ClientDisconnected:
                for job in jobs:
                    job.cancel()
                response = Response(status_code=499)
            except Exception as error:  # noqa: BLE001 — one request's failure is that request's answer
                for job in jobs:
                    job.cancel()  # whatever went wrong here, free their slots
                status, message, param = _error_status(error)
                response = error_response(status, message, param, headers=_error_headers(error))
        metrics.record_request(endpoint, response.status_code, time.perf_counter() - started)
        return response

    async def collect(jobs: list[Job], n: int, request: Request, fmt: CompletionFormat, echoes: list[Echo] | None = None) -> dict:
        choices, stats = [], []
        for index, job in enumerate(jobs):  # the others run meanwhile: their updates wait in their queues
            events = []
            while (update := await _next(job, request)).kind != "finished":
                events += update.events  # none in a later choice's "admitted"
            if update.finish_reason == SHUTDOWN_FINISH_REASON:
                raise ServerStoppingError(f"the server is shutting down and stopped this request after {len(events)} tokens: "
                                          "retry on another server or later")
            echoed = None if echoes is None else dataclasses.replace(echoes[index // n], logprobs=update.prompt_logprobs)
            choices.append(fmt.for_choice(index).choice(events, update.finish_reason, echoed))
            stats.append(update.stats)
        return fmt.response(choices, merged_stats(stats, n))

    async def stream(jobs: list[Job], n: int, fmt: CompletionFormat, endpoint: str, started: float,
                     include_usage: bool) -> AsyncIterator[str]:
        status, first = 200, True
        formats = [fmt.for_choice(index) for index in range(len(jobs))]
        finished: list[GenerationStats | None] = [None] * len(jobs)  # by answer index
        try:
            for choice in formats:
                for chunk in choice.opening_chunks():
                    yield sse(chunk)
            async for index, update in _merged(jobs):
                if update.kind == "finished":
                    finished[index] = update.stats
                    yield sse(formats[index].final_chunk(update.finish_reason, update.stats))
                    continue
                if first and update.events:
                    metrics.record_first_token(time.perf_counter() - started)
                    first = False
                for event in update.events:
                    yield sse(formats[index].token_chunk(event, update.live))
            if include_usage:
                yield sse(fmt.usage_chunk(merged_stats(finished, n)))
        except Exception as error:  # noqa: BLE001 — headers are sent: report the failure in-band
            status, message, _ = _error_status(error)
            yield sse({"error": {"message": message, "type": "server_error", "code": str(status)}})
        finally:
            for job in jobs:
                job.cancel()  # frees the slots if the client left mid-stream; a no-op once finished
            metrics.record_request(endpoint, status, time.perf_counter() - started)
        yield sse("[DONE]")

    @app.post("/v1/completions", responses={200: {"model": CompletionResponse}, **ERROR_RESPONSES})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        def encode(engine: Engine) -> list[list[int]]:
            return [engine.prompt_ids(prompt, chat=False, suffix=body.infill()) for prompt in body.prompts()]
        return await serve(request, body, "completions", encode, CompletionFormat(request.app.state.model_name, _tokenizer(request)))

    @app.post("/v1/chat/completions", responses={200: {"model": ChatCompletionResponse}, **ERROR_RESPONSES})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        messages = body.messages
        return await serve(request, body, "chat", lambda engine: [chat_prompt_ids(engine, messages, body.offered_tools())],
                           ChatFormat(request.app.state.model_name, _tokenizer(request), tools=body.calls_tools))

    async def on_tokenizer_thread(request: Request, model: str | None, work: Callable[[Engine], dict]) -> JSONResponse:
        """`work` on the served engine, on the tokenizer thread: its answer, or the error naming the field."""
        if (refused := unknown_model(request, model)) is not None:
            return refused
        try:
            return JSONResponse(await asyncio.get_running_loop().run_in_executor(
                tokenizer_thread, work, request.app.state.scheduler.engine))
        except VerispecError as error:
            return error_response(*_error_status(error))

    @app.post("/tokenize", responses={200: {"model": TokenizeResponse}, **ERROR_RESPONSES})
    async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
        """The token ids the prompt (or the chat, with its tools) makes, as generation would encode it."""
        def encode(engine: Engine) -> dict:
            if body.messages is not None:
                ids = chat_prompt_ids(engine, body.messages, template_tools(body.tools))
            else:
                ids = engine.prompt_ids(body.prompt, chat=False)
            return {"tokens": ids, "count": len(ids), "max_model_len": request.app.state.scheduler.max_model_len}
        return await on_tokenizer_thread(request, body.model, encode)

    @app.post("/detokenize", responses={200: {"model": DetokenizeResponse}, **ERROR_RESPONSES})
    async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
        """The text of token ids (special tokens kept)."""
        def decode(engine: Engine) -> dict:
            vocab = engine.target.vocab_size
            if any(token >= vocab for token in body.tokens):
                raise PromptError(f"token ids must lie in [0, {vocab})", param="tokens")
            return {"prompt": engine.target.tokenizer.decode(body.tokens)}
        return await on_tokenizer_thread(request, body.model, decode)

    @app.get("/v1/models", response_model=ModelList)
    async def models(request: Request) -> dict:
        return {"object": "list", "data": [{"id": request.app.state.model_name, "object": "model",
                                            "created": request.app.state.created, "owned_by": "verispec"}]}

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        scheduler: Scheduler = request.app.state.scheduler
        engine = scheduler.engine
        stalled = scheduler.stalled_seconds
        status = ("stopping" if request.app.state.stopping.is_set() else "stopped" if not scheduler.running
                  else "degraded" if stalled > limits.stall_seconds else "ok")
        body = {"status": status, "model": request.app.state.model_name,
                "drafter": engine.drafter.name if engine.drafter else "none", "drafter_spec": engine.drafter_spec,
                "gamma": engine.gamma,
                "gamma_policy": engine.gamma_policy, "max_batch": scheduler.max_batch,
                "active": scheduler.active_count, "queued": scheduler.queue_length, "stalled_seconds": round(stalled, 3),
                "max_model_len": scheduler.max_model_len, "prefill_chunk": scheduler.prefill_chunk,
                "idle_prefill_chunk": scheduler.idle_prefill_chunk, "kv_pool_tokens": scheduler.kv_pool_tokens,
                "kv_pool_reserved_tokens": scheduler.reserved_tokens}
        if status == "degraded":
            body["reason"] = (f"the scheduler has not advanced for {stalled:.1f} s (limit {limits.stall_seconds:g} s) "
                              "with requests waiting or running")
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/", include_in_schema=False)
    async def playground() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    return app
