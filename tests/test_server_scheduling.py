"""The scheduler's bounds over real HTTP, on the tiny model: a full queue is a 429 with Retry-After;
a request that waits past its time limit ends in the queue (a 504, never admitted); the KV pool
admits only what fits, gives everything back when requests end or are cancelled, and ends a request
that outgrows it with finish_reason "length"; `max_model_len` refuses long prompts before they are
queued and caps prompt + new tokens; prompts are tokenized off the worker; and a long prompt is
prefilled in chunks between a short request's decode steps (asserted on the scheduler's turns, not
on wall time); a request's `n` choices are queued all together or not at all."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import torch
import openai
import pytest
from server_helpers import MODEL, LocalServer, expected_text, slow, tiny_engine

from verispec.engine import Generation, GenerationConfig
from verispec.serving.http import create_app

PROMPT = "t20 t21 t22 t20 t21"  # loops: no EOS within 100 tokens
LONG = " ".join(f"t{2 + (i * 7) % 46}" for i in range(100))  # over 100 tokens (the tiny context is 128)


def completion(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": MODEL, "temperature": 0, **body}, timeout=60)


def health(url: str) -> dict:
    return httpx.get(url + "/health").json()


def wait_for(condition, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def test_a_full_queue_is_a_429_with_retry_after(tiny_target):
    """One running, one waiting (max_batch 1, max_queue 1): the third gets 429 + Retry-After through the
    official client. Fails without the header."""
    app = create_app(slow(tiny_engine(tiny_target), 0.05), model_name=MODEL, max_batch=1, max_queue=1)
    with LocalServer(app) as server:
        first = threading.Thread(target=completion, args=(server.url,), kwargs={"prompt": PROMPT, "max_tokens": 60})
        first.start()
        wait_for(lambda: health(server.url)["active"] == 1)
        second = threading.Thread(target=completion, args=(server.url,), kwargs={"prompt": PROMPT, "max_tokens": 5})
        second.start()
        wait_for(lambda: health(server.url)["queued"] == 1)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.RateLimitError) as error:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
        assert error.value.status_code == 429 and "at capacity" in error.value.body["message"]
        assert 1 <= int(error.value.response.headers["retry-after"]) <= 60
        first.join(60)
        second.join(60)
        wait_for(lambda: health(server.url)["kv_pool_reserved_tokens"] == 0)


def test_n_choices_queue_together_or_not_at_all(tiny_target):
    """max_batch 1, max_queue 2, one request running: n = 3 choices do not fit the queue, so the request is a
    429 and none of its choices stays queued; n = 2 fits, and its choices run one after the other."""
    app = create_app(slow(tiny_engine(tiny_target), 0.05), model_name=MODEL, max_batch=1, max_queue=2)
    with LocalServer(app) as server:
        first = threading.Thread(target=completion, args=(server.url,), kwargs={"prompt": PROMPT, "max_tokens": 30})
        first.start()
        wait_for(lambda: health(server.url)["active"] == 1)
        refused = completion(server.url, prompt=PROMPT, max_tokens=3, n=3)
        assert refused.status_code == 429, refused.text
        first.join(60)
        answered = completion(server.url, prompt=PROMPT, max_tokens=3, n=2)
        assert answered.status_code == 200 and [c["index"] for c in answered.json()["choices"]] == [0, 1]
        wait_for(lambda: health(server.url)["queued"] == 0 and health(server.url)["active"] == 0)
    admitted = [turn for turn in app.state.scheduler.turns if turn.prefilled]
    assert len(admitted) == 3  # the first request and the two choices: nothing of the refused one


def test_a_request_that_waits_past_its_time_limit_ends_while_still_queued(tiny_target):
    """max_batch 1: a long request runs (60 passes of ≥ 50 ms) while a second, with a 0.3 s limit, waits.
    The second is a 504 while the first still runs, and it was never admitted. Fails if expiry is
    checked only for running requests (the second would end after the first)."""
    app = create_app(slow(tiny_engine(tiny_target), 0.05), model_name=MODEL, max_batch=1, max_queue=4)
    with LocalServer(app) as server:
        first = threading.Thread(target=completion, args=(server.url,), kwargs={"prompt": PROMPT, "max_tokens": 60})
        first.start()
        wait_for(lambda: health(server.url)["active"] == 1)
        app.state.scheduler.request_timeout = 0.3  # for requests submitted from now on
        waited = completion(server.url, prompt=PROMPT, max_tokens=5)
        assert first.is_alive(), "the queued request ended only after the running one"
        assert waited.status_code == 504 and "without starting" in waited.json()["error"]["message"], waited.text
        first.join(60)
    assert len([turn for turn in app.state.scheduler.turns if turn.prefilled]) == 1  # only the first was admitted


def test_the_pool_returns_to_zero_after_requests_end_or_are_cancelled(tiny_target):
    """Finished, failed-by-timeout and abandoned streams all give their reservation back. Fails if a
    removal path forgets to give it back."""
    # margin for a loaded CI; a step of γ 3 (prompt lookup on looping text) may emit 4 tokens
    app = create_app(slow(tiny_engine(tiny_target), 0.08), model_name=MODEL, request_timeout=1.5)
    with LocalServer(app) as server:
        scheduler = app.state.scheduler
        assert completion(server.url, prompt=PROMPT, max_tokens=5).status_code == 200
        assert scheduler.reserved_tokens == 0
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": PROMPT, "max_tokens": 100, "stream": True}) as response:
            for line in response.iter_lines():
                if '"token_id"' in line:
                    break  # running: it holds a reservation
            assert scheduler.reserved_tokens > 0
        # the client went away mid-stream
        timed_out = completion(server.url, prompt=PROMPT, max_tokens=100)  # ≥ 25 steps × 0.08 s > 1.5 s
        assert timed_out.status_code == 504
        wait_for(lambda: scheduler.active_count == 0)
        assert scheduler.reserved_tokens == 0 and health(server.url)["kv_pool_reserved_tokens"] == 0


def test_the_pool_admits_only_what_fits(tiny_target):
    """A pool with room for one request's prompt + spare: the second waits, then runs; they never step
    together, and both answer as the engine alone would. Fails if admission ignores the pool."""
    engine = tiny_engine(tiny_target)
    need = Generation.capacities(engine, len(engine.prompt_ids(PROMPT, chat=False)), GenerationConfig(max_new_tokens=20))[0]
    app = create_app(tiny_engine(tiny_target), model_name=MODEL, kv_pool_tokens=need + need // 2)

    async def both(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 20, "temperature": 0}
            return await asyncio.gather(http.post("/v1/completions", json=body), http.post("/v1/completions", json=body))

    with LocalServer(app) as server:
        answers = asyncio.run(both(server.url))
        want = expected_text(engine, PROMPT, 20)
        assert [a.json()["choices"][0]["text"] for a in answers] == [want, want]
        turns = list(app.state.scheduler.turns)
        assert turns and all(len(turn.stepped) <= 1 for turn in turns)
        assert len({job for turn in turns for job in turn.stepped}) == 2


def test_a_request_that_outgrows_the_pool_ends_with_length(tiny_target, monkeypatch):
    """Its reservation cannot double inside the pool: it stops early with finish_reason "length", the
    text so far being the engine's own prefix; a prompt whose start alone exceeds the pool is a 400.
    Fails if the server over-commits (all 60 tokens) or crashes."""
    monkeypatch.setattr(Generation, "INITIAL_SPARE", 8)  # the tiny context (128) is below the real spare
    engine = tiny_engine(tiny_target)
    app = create_app(tiny_engine(tiny_target), model_name=MODEL, kv_pool_tokens=40)
    with LocalServer(app) as server:
        answer = completion(server.url, prompt=PROMPT, max_tokens=60).json()
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "length" and 0 < answer["usage"]["completion_tokens"] < 60
        assert expected_text(engine, PROMPT, 60).startswith(choice["text"])
        assert app.state.scheduler.reserved_tokens == 0
        refused = completion(server.url, prompt=LONG[:200], max_tokens=5)
        assert refused.status_code == 400 and "pool holds 40" in refused.json()["error"]["message"]


def test_max_model_len_refuses_long_prompts_before_the_queue_and_caps_new_tokens(tiny_target):
    """A prompt of max_model_len tokens or more is a 400 and never reaches the worker; prompt + new tokens
    stop at max_model_len. Prompts are tokenized off the worker thread. Fails on the old server (the
    worker tokenized, nothing capped below the context)."""
    engine = tiny_engine(tiny_target)
    threads = []
    prompt_ids = engine.prompt_ids
    engine.prompt_ids = lambda *args, **kwargs: threads.append(threading.current_thread().name) or prompt_ids(*args, **kwargs)
    app = create_app(engine, model_name=MODEL, max_model_len=30)
    with LocalServer(app) as server:
        refused = completion(server.url, prompt=" ".join(["t5"] * 30), max_tokens=2)
        assert refused.status_code == 400 and "at most 30 positions" in refused.json()["error"]["message"]
        assert app.state.scheduler.metrics.prompt_tokens == 0  # nothing admitted
        answer = completion(server.url, prompt=PROMPT, max_tokens=60).json()
        assert answer["usage"]["completion_tokens"] == 30 - 5 and answer["choices"][0]["finish_reason"] == "length"
        assert threads and "verispec-scheduler" not in threads


def _interleaving(tiny_target, chunk: int):
    """A short request decoding (streamed) while the long prompt arrives; the scheduler's turns and
    the job ids of the long and the short request, and the long answer's text."""
    app = create_app(slow(tiny_engine(tiny_target), 0.01), model_name=MODEL, prefill_chunk=chunk)
    with LocalServer(app) as server:
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": PROMPT, "max_tokens": 90, "temperature": 0, "stream": True}) as short:
            lines = short.iter_lines()
            next(line for line in lines if '"token_id"' in line)  # decoding
            long = completion(server.url, prompt=LONG, max_tokens=4)
            for _ in lines:
                pass
        turns = list(app.state.scheduler.turns)
    assert long.status_code == 200, long.text
    jobs = {job for turn in turns for job in turn.prefilled}
    long_id = max(jobs)
    short_id = min(jobs)
    return turns, long_id, short_id, long.json()["choices"][0]["text"]


def test_a_long_prompt_is_prefilled_in_chunks_between_the_short_requests_steps(tiny_target):
    """With --prefill-chunk 8 the long request's prompt positions arrive in
    turns of ≤ 8 tokens, and the short request, decoding meanwhile, steps in every one of them; the
    long answer is the engine's own. Control: with --prefill-chunk 0 (the old whole prefill) one turn
    takes them all, so this assertion tells the two apart."""
    positions = len(tiny_engine(tiny_target).prompt_ids(LONG, chat=False))  # the last token's pass gives the first new one
    turns, long_id, short_id, text = _interleaving(tiny_target, 8)
    fed = [turn for turn in turns if long_id in turn.prefilled]
    assert sum(turn.prefilled[long_id] for turn in fed) == positions
    assert len(fed) >= positions // 8 and all(turn.prefilled[long_id] <= 8 for turn in fed)
    assert all(short_id in turn.stepped for turn in fed), "the short request waited for the long prefill"
    assert not any(turn.mixed for turn in turns)  # float32 promises no row its bits whatever the pass: a pass of its own
    assert text == expected_text(tiny_engine(tiny_target), LONG, 4)

    turns, long_id, short_id, _ = _interleaving(tiny_target, 0)
    assert [turn.prefilled[long_id] for turn in turns if long_id in turn.prefilled] == [positions]


def test_the_soak_and_interference_commands_run(tiny_target, capsys):
    """Both new load-test modes, briefly, against a tiny server (their numbers mean nothing here): the
    soak's bad requests are 4xx, nothing is lost, garbled or a 5xx; the interference run measures
    tokens in both phases."""
    import json
    import os

    from verispec.tools.bench.loadtest import main

    app = create_app(tiny_engine(tiny_target), model_name=MODEL, prefill_chunk=8)
    with LocalServer(app) as server:
        common = ["--url", server.url, "--long-tokens", "60", "--max-tokens", "8", "--prompt", PROMPT, "--json"]
        assert main(["--mode", "soak", "--clients", "3", "--minutes", "0.04", "--server-pid", str(os.getpid()), *common]) == 0
        soak = json.loads(capsys.readouterr().out.splitlines()[-1])
        assert soak["requests"] > 0 and soak["lost"] == soak["server_errors"] == soak["garbled"] == 0
        assert soak["statuses"]["200"] > 0 and soak["statuses"]["400"] > 0 and soak["server_rss_peak_mib"] > 0
        assert main(["--mode", "interference", "--short-clients", "2", "--long-repeats", "1", "--baseline-seconds", "0.5",
                     *common]) == 0
        lines = capsys.readouterr().out.splitlines()
        row = json.loads(lines[-1])
        assert lines[0].startswith("client on ") and row["long_prompt_tokens"] > 50
        assert row["seconds_per_output_token_alone"]["n"] > 0 and "n" in row["seconds_per_output_token_during_long_prefill"]


@pytest.mark.parametrize("seconds_per_token, chunk", [(0.1, 8), (0.02, 8), (0.001, 128), (1e-6, 512)])
def test_the_default_prefill_chunk_is_what_fits_the_time_budget(tiny_target, monkeypatch, seconds_per_token, chunk):
    """By default a prefill chunk is the most tokens (a power of two in 8…512) the target prefills in
    PREFILL_BUDGET_SECONDS (0.15 s): a slow CPU gets small chunks, so decoding requests wait little."""
    import verispec.serving.http.scheduler as scheduler

    monkeypatch.setattr(scheduler, "prefill_seconds_per_token", lambda model, chunk: seconds_per_token)
    engine = tiny_engine(tiny_target)
    assert scheduler.auto_prefill_chunk(engine) == chunk
    # float32 is not prefix-invariant (its batched prefill rounds a chunk as it is cut): no larger chunk when idle
    assert not engine.target.runner.prefix_invariant and scheduler.prefill_chunks(engine, None) == (chunk, chunk)
    assert scheduler.prefill_chunks(engine, 24) == (24, 24) and scheduler.prefill_chunks(engine, 0) == (0, 0)


@pytest.mark.parametrize("riding", [False, True])
def test_a_chunk_that_rides_is_sized_by_what_it_adds_to_the_pass(tiny_target, monkeypatch, riding):
    """Where a chunk rides in the decoding requests' pass, the budget holds what it adds there (`riding_seconds`),
    not what it costs in a pass of its own: here 64 tokens add 0.12 s riding but take 0.16 s alone."""
    import verispec.serving.http.scheduler as scheduler

    monkeypatch.setattr(scheduler, "prefill_seconds_per_token", lambda model, chunk: 0.0025)
    monkeypatch.setattr(scheduler, "riding_seconds", lambda model, chunk: chunk * 0.0025 - 0.04)
    assert scheduler.auto_prefill_chunk(tiny_engine(tiny_target), riding=riding) == (64 if riding else 32)


def test_what_a_riding_chunk_adds_is_measured_once_and_kept(tiny_target):
    """`riding_seconds`: the pass of one decoding row with the chunk less the pass without it, timed once (cached per
    model and CPU, so a server sizes its chunks the same at every start)."""
    from verispec.control.costs import riding_seconds

    target = tiny_engine(tiny_target).target
    first = riding_seconds(target, 32)
    assert first > 0 and riding_seconds(target, 32) == first


def test_a_server_measures_its_prefill_chunk_once_and_keeps_it(tiny_target):
    """Without --prefill-chunk the scheduler sizes chunks from the target's measured prefill speed
    (cached per model and CPU: the same size at the next start, so answers do not change)."""
    from verispec.control.costs import prefill_seconds_per_token

    engine = tiny_engine(tiny_target)
    first = prefill_seconds_per_token(engine.target)
    assert first > 0 and prefill_seconds_per_token(engine.target) == first  # from the cache
    app = create_app(engine, model_name=MODEL)
    with LocalServer(app):
        chunk = app.state.scheduler.prefill_chunk
    assert 8 <= chunk <= 512 and chunk & (chunk - 1) == 0


def _identity(server, capsys) -> tuple[int, dict]:
    import json

    from verispec.tools.bench.loadtest import main

    code = main(["--mode", "identity", "--url", server.url, "--rounds", "2", "--clients", "3", "--long-tokens", "60",
                 "--max-tokens", "8", "--prompt", PROMPT, "--json"])
    return code, json.loads(capsys.readouterr().out.splitlines()[-1])


def test_the_identity_command_finds_the_same_answer_alone_and_under_load(tiny_target, capsys):
    """`loadtest --mode identity`: the request alone and among 3 others gives the same text each round."""
    with LocalServer(create_app(tiny_engine(tiny_target), model_name=MODEL, prefill_chunk=8)) as server:
        code, row = _identity(server, capsys)
    assert code == 0 and row["loaded_equal_to_alone"] == row["rounds"] == 2 and row["first_difference"] is None


def test_the_identity_command_catches_a_batch_dependent_runner(tiny_target, capsys):
    """Positive control: a runner whose logits shift when a pass holds several requests is reported
    (exit 1, the first difference named)."""
    engine = tiny_engine(tiny_target)
    runner = engine.target.runner
    ragged = runner.forward_ragged

    def batch_dependent(caches, feeds, *rest):
        rows = ragged(caches, feeds, *rest)
        if len(caches) > 1:
            generator = torch.Generator().manual_seed(len(caches))
            rows = [row + 3 * torch.randn(row.shape, generator=generator) for row in rows]
        return rows
    runner.forward_ragged = batch_dependent
    with LocalServer(create_app(slow(engine, 0.1), model_name=MODEL, prefill_chunk=8)) as server:  # the others outlast 0.5 s
        code, row = _identity(server, capsys)
    assert code == 1 and row["loaded_equal_to_alone"] < 2 and row["first_difference"].startswith("round")


def test_the_shortest_prompt_is_prefilled_first_and_a_long_one_is_not_starved(tiny_target):
    """Prefill turns, on the worker's own methods (no thread): three 8-token prompts admitted while a
    60-token one is being prefilled go first, 4 tokens a turn, except that the long one gets a turn once
    it has been passed over STARVATION_TURNS turns in a row. Round-robin or FIFO fail the first part,
    shortest-first without aging the second."""
    from verispec.serving.http.scheduler import STARVATION_TURNS, Scheduler

    assert STARVATION_TURNS == 4  # the expected order below counts on it
    engine = tiny_engine(tiny_target)
    scheduler, loop = Scheduler(engine, prefill_chunk=4), asyncio.new_event_loop()
    config = GenerationConfig(max_new_tokens=2)
    long = scheduler.submit([2 + (i * 7) % 46 for i in range(60)], config, loop)
    scheduler._admit()
    assert list(scheduler._prefill()) == [long.id]
    shorts = [scheduler.submit([20 + i, 21, 22, 20, 21, 5, 9, 13], config, loop) for i in range(3)]
    scheduler._admit()
    fed = [next(iter(scheduler._prefill())) for _ in range(9)]
    s0, s1, s2 = (job.id for job in shorts)
    assert fed == [s0, s0, s1, s1, s2, long.id, s2, long.id, long.id]
    loop.close()


@pytest.mark.parametrize("draft", ["ngram", "self"], ids=["ngram", "draft-model"])
def test_a_request_whose_first_token_ends_it_finishes_at_once(tiny_target, draft):
    """The prefill's token is EOS (a logit bias forces it): the request finishes then, with no tokens, as
    the engine alone does — it used to stay on the worker, neither finished nor stepped, until its time
    limit (with a draft model still to prefill), or waited for a step to notice (with prompt lookup)."""
    from server_helpers import token_ids

    from verispec import SamplingParams
    from verispec.serving.http.scheduler import Scheduler

    engine = tiny_engine(tiny_target, draft=tiny_target if draft == "self" else "ngram")
    scheduler, loop = Scheduler(engine, prefill_chunk=4), asyncio.new_event_loop()
    config = GenerationConfig(max_new_tokens=8, sampling=SamplingParams(logit_bias={0: 100.0}))
    prompt = [20, 21, 22, 20, 21, 5]
    alone = Generation(engine, prompt, config)
    assert alone.finish_reason == "stop" and alone.take_held() == []  # no events: EOS ends it unseen
    chunked = Generation(engine, prompt, config, prefill=False)
    assert [chunked.prefill_step(4) for _ in range(2)] == [False, True]  # the chunk with the first token ends the prefill
    job = scheduler.submit(prompt, config, loop)
    scheduler._admit()
    stepped = []
    for _ in range(6):  # prompt chunks, the draft's own prefill, and spare turns
        if (turn := scheduler._turn()) is not None:
            stepped += turn.stepped
    assert scheduler.active_count == 0 and scheduler.reserved_tokens == 0 and stepped == []  # ended by its prefill
    assert loop.run_until_complete(asyncio.wait_for(token_ids([job]), 5)) == [[]]
    loop.close()
