"""The OpenAI-compatible server on tiny models, over real HTTP on 127.0.0.1.

Correctness: served text equals the engine's own output (greedy and seeded sampling), alone and
batched with other requests (checked to have really shared target passes). Robustness: each bad
request gets its status and a message naming the field; a full queue is a 429; a disconnect frees
the slot; a timeout is a 504; a generation that crashes fails alone. Schemathesis finds no 5xx.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest
from server_helpers import MODEL, LocalServer, chromium, expected_text, slow, tiny_engine, token_ids

from verispec import GenerationConfig, SamplingParams
from verispec.serving.http import create_app

PROMPTS = ["t5 t9 t2 t7", "t22 t3 t3 t3 t8 t2 t30 t42 t5", "t40", "t20 t21 t22 t20 t21", "t7 t7 t7", "t33 t2"]  # no word starts with "t1": the unknown token "t1" is matched inside words


@pytest.fixture(scope="module")
def reference(tiny_target):
    """An engine of its own (not the server's) to compute the expected outputs."""
    return tiny_engine(tiny_target)


@pytest.fixture(scope="module")
def server(tiny_target):
    app = create_app(tiny_engine(tiny_target), model_name=MODEL, max_batch=8, max_queue=64)
    with LocalServer(app) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, flags=re.M))


# ---- the OpenAI client ---------------------------------------------------------------------------

def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["model"] == MODEL


def test_completion_matches_the_engine(client, reference):
    response = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=0)
    assert response.choices[0].text == expected_text(reference, PROMPTS[1], 20)
    usage = response.usage.model_dump()
    assert usage["prompt_tokens"] == 9 and usage["total_tokens"] == 9 + usage["completion_tokens"]
    assert usage["steps"] >= 1 and usage["mean_accepted_length"] >= 1 and 0 <= usage["acceptance_rate"] <= 1


def test_streamed_completion_matches_and_carries_origins(client, reference):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=24, temperature=0, stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected_text(reference, PROMPTS[3], 24)
    origins = [c.choices[0].model_extra.get("origin") for c in chunks if c.choices and c.choices[0].text]
    assert origins and set(origins) <= {"accepted", "recovered", "bonus", "target"}
    assert "accepted" in origins  # the n-gram drafter hits on this looping prompt
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].usage.model_dump()["steps"] < 24  # fewer target passes than tokens


def test_chat_applies_the_template_streaming_or_not(client, reference):
    messages = [{"role": "user", "content": PROMPTS[0]}]
    want = expected_text(reference, PROMPTS[0], 16, chat=True)
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert full.choices[0].message.content == want and full.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want


def test_stop_strings_and_seeded_sampling(client, reference):
    base = expected_text(reference, PROMPTS[1], 20)
    cut_word = base.split()[3]
    stopped = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=0, stop=[cut_word, "zzz"])
    assert stopped.choices[0].text == base[: base.index(cut_word)] and stopped.choices[0].finish_reason == "stop"
    sampled = [client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=0.9, seed=s).choices[0].text
               for s in (1, 1, 2)]
    assert sampled[0] == sampled[1] == expected_text(reference, PROMPTS[1], 20, temperature=0.9, seed=1)


@pytest.mark.parametrize("drafter", ["none", "ngram:max_n=2", "stand", "self:layers=1"])
def test_a_request_picks_its_own_drafter(client, reference, drafter):
    """Any drafter built from the models in memory: the greedy text stays the target's own."""
    response = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=24, temperature=0,
                                         extra_body={"drafter": drafter, "gamma_policy": "heuristic"})
    assert response.choices[0].text == expected_text(reference, PROMPTS[3], 24)
    usage = response.usage.model_dump()
    if drafter == "none":
        assert usage["steps"] == usage["completion_tokens"] and usage["mean_accepted_length"] == 1
    else:
        assert usage["steps"] < usage["completion_tokens"]  # its drafts were accepted on this looping prompt


def test_a_request_sets_its_own_gamma(client, reference):
    def usage(gamma: int) -> dict:
        response = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=30, temperature=0,
                                             extra_body={"gamma": gamma, "gamma_policy": "constant"})
        assert response.choices[0].text == expected_text(reference, PROMPTS[3], 30)
        return response.usage.model_dump()

    one, six = usage(1), usage(6)
    assert len(one["per_position_acceptance"]) == 1 and one["mean_accepted_length"] <= 2
    assert len(six["per_position_acceptance"]) > 1 and six["steps"] < one["steps"]


# ---- batching ------------------------------------------------------------------------------------

def test_concurrent_requests_are_batched_and_exact(server, reference):
    """Six greedy and two seeded sampled requests at once: each equals its solo output, and the
    target really verified several of them in one pass."""
    jobs = [(p, 0.0, None) for p in PROMPTS] + [(PROMPTS[0], 1.0, 7), (PROMPTS[2], 0.7, 3)]
    expected = [expected_text(reference, p, 40, t, s) for p, t, s in jobs]
    batched_steps_before = metric(server, "verispec_batch_rows_count") - metric(server, 'verispec_batch_rows_bucket{le="1"}')

    async def run_all():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            async def one(prompt, temperature, seed):
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 40, "temperature": temperature, "seed": seed}
                return (await http.post("/v1/completions", json=body)).json()["choices"][0]["text"]
            return await asyncio.gather(*(one(*job) for job in jobs))

    assert asyncio.run(run_all()) == expected
    batched_steps = metric(server, "verispec_batch_rows_count") - metric(server, 'verispec_batch_rows_bucket{le="1"}')
    assert batched_steps - batched_steps_before > 0, "no target pass verified more than one request"


@pytest.mark.parametrize("draft", ["self", "model", "tree"])
def test_scheduler_batches_ragged_rows_identically_to_solo(tiny_target, tiny_draft, draft):
    """Scheduler-level, with draft models (draft_probs path): the target drafting for itself (every
    draft accepted, bonus tokens), a random draft (mostly rejected), and token trees from the target
    itself (tree masks and positions per row). Greedy and seeded sampled rows batched together give
    the tokens of solo decoding."""
    from verispec.serving.http.scheduler import Scheduler

    draft = {"self": tiny_target, "model": tiny_draft, "tree": ("tree", tiny_target)}[draft]
    engine = tiny_engine(tiny_target, draft=draft)
    scheduler = Scheduler(engine, max_batch=4)
    configs = [GenerationConfig(max_new_tokens=30), GenerationConfig(max_new_tokens=30, sampling=SamplingParams(temperature=1.0), seed=5)]
    prompts = [engine.prompt_ids(p, chat=False) for p in PROMPTS[:4]]

    async def run_all():
        scheduler.start()
        try:
            jobs = [scheduler.submit(lambda e, ids=ids: ids, configs[i % 2]) for i, ids in enumerate(prompts)]
            return await token_ids(jobs)
        finally:
            scheduler.stop()

    got = asyncio.run(run_all())
    rows = scheduler.metrics.batch_rows
    assert rows.n > rows.counts[0], "no step verified more than one row"
    solo = tiny_engine(tiny_target, draft=draft)
    for i, ids in enumerate(prompts):
        want = solo.generate(ids, configs[i % 2]).token_ids
        assert got[i] == [t for t in want if t not in engine.target.eos_ids]


def test_worker_survives_a_failure_outside_any_request(tiny_target):
    """A bug in the step loop itself fails the requests of that step; the worker keeps serving."""
    from verispec.serving.http.scheduler import Scheduler

    scheduler = Scheduler(tiny_engine(tiny_target))
    record_step, calls = scheduler.metrics.record_step, []

    def explode_once(rows, account):
        calls.append(rows)
        if len(calls) == 1:
            raise RuntimeError("metrics exploded")
        record_step(rows, account)
    scheduler.metrics.record_step = explode_once

    async def run():
        scheduler.start()
        try:
            first = scheduler.submit(lambda e: [20, 21], GenerationConfig(max_new_tokens=5))
            assert (await first.next()).kind == "admitted"
            with pytest.raises(RuntimeError, match="metrics exploded"):
                while True:
                    await first.next()
            second = scheduler.submit(lambda e: [20, 21], GenerationConfig(max_new_tokens=5))
            while (update := await second.next()).kind != "finished":
                pass
            return update
        finally:
            scheduler.stop()

    assert asyncio.run(asyncio.wait_for(run(), 60)).stats.new_tokens == 5  # a dead worker would time out here
    assert scheduler.active_count == 0


# ---- errors ------------------------------------------------------------------------------------

BAD_REQUESTS = [
    ({"model": "gpt-4", "prompt": "t5"}, 400, "model", "unknown model"),
    ({"model": MODEL, "prompt": "t5", "max_tokens": -3}, 422, "max_tokens", "greater than or equal to 1"),
    ({"model": MODEL, "prompt": "t5", "temperature": -0.5}, 422, "temperature", "greater than or equal to 0"),
    ({"model": MODEL, "prompt": "t5", "top_p": 0}, 422, "top_p", "greater than 0"),
    ({"model": MODEL, "prompt": "t5", "top_p": 1.5}, 422, "top_p", "less than or equal to 1"),
    ({"model": MODEL, "prompt": "t5", "temperature": "hot"}, 422, "temperature", "valid number"),
    ({"model": MODEL, "prompt": "t5", "temperature": 1e-300}, 422, "temperature", "at least 0.001"),  # found by schemathesis
    ({"model": MODEL, "prompt": "t5", "repetition_penalty": 1e-172}, 422, "repetition_penalty", "greater than or equal to 0.01"),
    ({"model": MODEL, "prompt": "t5", "n": 17}, 422, "n", "less than or equal to 16"),
    ({"model": MODEL, "prompt": " ".join(["t3"] * 200)}, 400, "prompt", "context of 128"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt", "empty"),
    ({"model": MODEL, "prompt": [3, 999]}, 400, "prompt", "token ids must lie in"),
    ({"model": MODEL, "prompt": "t5", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4 stop strings"),
    ({"model": MODEL, "prompt": "t5", "drafter": "model"}, 400, "drafter", "is not loaded here"),
    ({"model": MODEL, "prompt": "t5", "drafter": "ngram:max_n=x"}, 400, "drafter", "must look like name=integer"),
    ({"model": MODEL, "prompt": "t5", "gamma": 0}, 422, "gamma", "greater than or equal to 1"),
    ({"model": MODEL, "prompt": "t5", "gamma_policy": "fast"}, 422, "gamma_policy", "'constant', 'heuristic' or 'analytic'"),
]


@pytest.mark.parametrize(("body", "status", "param", "message"), BAD_REQUESTS)
def test_bad_completion_requests_name_the_problem(server, body, status, param, message):
    response = httpx.post(server.url + "/v1/completions", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == param
    if param:
        assert param in error["message"] or param == "prompt"


def test_a_request_without_a_model_gets_the_served_one(server):
    """`model` left out is the served model, as llama.cpp's and vLLM's servers take it; another id is refused above."""
    completion = httpx.post(server.url + "/v1/completions", json={"prompt": "t5", "max_tokens": 3, "temperature": 0})
    chat = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "t5"}], "max_tokens": 3})
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": "t5 t6"})
    named = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "t5", "max_tokens": 3, "temperature": 0})
    assert [r.status_code for r in (completion, chat, tokens, named)] == [200] * 4, completion.text
    assert completion.json()["model"] == chat.json()["model"] == MODEL and tokens.json()["count"] == 2
    assert completion.json()["choices"][0]["text"] == named.json()["choices"][0]["text"]
    assert httpx.post(server.url + "/tokenize", json={"model": "gpt-4", "prompt": "t5"}).status_code == 400


def test_bad_chat_requests_and_malformed_json(server):
    post = lambda body, **kw: httpx.post(server.url + "/v1/chat/completions", json=body, **kw)  # noqa: E731
    response = post({"model": MODEL, "messages": "t5"})
    assert response.status_code == 422 and response.json()["error"]["param"] == "messages"
    response = post({"model": MODEL, "messages": [{"role": "wizard", "content": "t5"}]})
    assert response.status_code == 422 and "messages.0.role" in response.json()["error"]["message"]
    response = post({"model": MODEL, "messages": []})
    assert response.status_code == 422 and response.json()["error"]["param"] == "messages"
    response = httpx.post(server.url + "/v1/chat/completions", content=b'{"model": "tiny", "messages": [', headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    # the server is unharmed
    assert post({"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "max_tokens": 3}).status_code == 200


def test_full_queue_is_a_429_and_disconnect_frees_the_slot(tiny_target):
    engine = slow(tiny_engine(tiny_target), 0.1)
    with LocalServer(create_app(engine, model_name=MODEL, max_batch=1, max_queue=1)) as server:
        # PROMPTS[3] runs 100 tokens in 36 steps, no EOS
        long = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 100, "temperature": 0, "stream": True}
        with httpx.Client(base_url=server.url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json=long) as running:  # takes the only slot
                lines = running.iter_lines()  # keep a reference: a collected iterator closes the connection
                next(lines)
                queued = httpx.AsyncClient(base_url=server.url, timeout=30)

                async def queue_one_then_overflow():
                    waiting = asyncio.create_task(queued.post("/v1/completions", json={**long, "stream": False, "max_tokens": 2}))
                    for _ in range(100):  # until the second request sits in the queue
                        if httpx.get(server.url + "/health").json()["queued"] == 1:
                            break
                        await asyncio.sleep(0.02)
                    overflow = await queued.post("/v1/completions", json=long)
                    running.close()  # client disconnect: the slot frees, the queued request runs
                    done = await waiting
                    await queued.aclose()
                    return overflow, done

                overflow, done = asyncio.run(queue_one_then_overflow())
        assert overflow.status_code == 429
        assert "at capacity" in overflow.json()["error"]["message"] and overflow.json()["error"]["type"] == "rate_limit_error"
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] <= 2
        assert metric(server, 'verispec_generations_finished_total{reason="cancelled"}') == 1
        assert httpx.get(server.url + "/health").json()["active"] == 0


def test_timeout_is_a_504(tiny_target):
    engine = slow(tiny_engine(tiny_target), 0.05)
    with LocalServer(create_app(engine, model_name=MODEL, request_timeout=0.3)) as server:
        response = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 100, "temperature": 0})
        assert response.status_code == 504 and "ran past the server's limit of 0.3 s" in response.json()["error"]["message"]


def test_a_crashing_generation_fails_alone(tiny_target, reference):
    """A target pass that raises for rows containing token 47: the batch falls back to row by row;
    that request gets a 500, the others their exact answers."""
    engine = slow(tiny_engine(tiny_target), 0.02)
    runner = engine.target.runner
    forward, ragged = runner.forward, runner.forward_ragged

    def poisoned(feed):
        if 47 in feed.tolist():
            raise RuntimeError("poisoned row")

    runner.forward = lambda cache, feed, *rest, **kw: (poisoned(feed), forward(cache, feed, *rest, **kw))[1]
    runner.forward_ragged = lambda caches, feeds, *rest: ([poisoned(f) for f in feeds], ragged(caches, feeds, *rest))[1]
    with LocalServer(create_app(engine, model_name=MODEL)) as server:
        async def run_all():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                bodies = [{"model": MODEL, "prompt": p, "max_tokens": 12, "temperature": 0} for p in ["t47", PROMPTS[0], PROMPTS[3]]]
                return await asyncio.gather(*(http.post("/v1/completions", json=b) for b in bodies))

        bad, *good = asyncio.run(run_all())
    assert bad.status_code == 500 and "poisoned row" in bad.json()["error"]["message"]
    assert [r.json()["choices"][0]["text"] for r in good] == [expected_text(reference, p, 12) for p in (PROMPTS[0], PROMPTS[3])]


def test_metrics_report_speculation(client, server):
    client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=10, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for name in ("verispec_requests_total", "verispec_generated_tokens_total", "verispec_tokens_per_second",
                 "verispec_acceptance_rate", "verispec_mean_accepted_length", 'verispec_position_acceptance_rate{position="0"}',
                 "verispec_queue_length", "verispec_request_latency_seconds_bucket", "verispec_time_to_first_token_seconds_count"):
        assert name in text, name
    assert metric(server, "verispec_mean_accepted_length") > 1
    text = httpx.get(server.url + "/metrics").text  # every step's seconds by part (a constant γ prices none)
    assert float(re.search(r'^verispec_step_part_seconds_total\{part="target_pass"\} (\S+)$', text, flags=re.M)[1]) > 0


# ---- the CLI, the OpenAPI schema, the playground ---------------------------------------------------

def test_cli_serve_loads_once_and_answers(tiny_target):
    """`verispec serve` with its limits: the API key from VERISPEC_API_KEY, a max_tokens limit."""
    import os
    import subprocess
    import sys

    from server_helpers import _free_port

    port = _free_port()
    process = subprocess.Popen([sys.executable, "-m", "verispec.cli", "serve", "--target", str(tiny_target), "--draft", "ngram",
                                "--gamma-policy", "constant", "--port", str(port), "--model-name", MODEL, "--max-tokens-limit", "5"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "VERISPEC_API_KEY": "k3y"})
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).json()
                break
            except httpx.TransportError:
                assert process.poll() is None and time.monotonic() < deadline, "verispec serve did not come up"
                time.sleep(0.2)
        assert health["drafter"].startswith("ngram") and health["model"] == MODEL
        url, key = f"http://127.0.0.1:{port}/v1/completions", {"Authorization": "Bearer k3y"}
        body = {"model": MODEL, "prompt": [20, 21, 22], "max_tokens": 5}
        assert httpx.post(url, json=body).status_code == 401
        response = httpx.post(url, json=body, headers=key)
        assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == 3
        assert httpx.post(url, json={**body, "max_tokens": 6}, headers=key).json()["error"]["param"] == "max_tokens"
        process.terminate()  # a graceful stop: one line of what the server did
        assert "served 1 requests (1 not)," in " ".join(process.communicate(timeout=30)[0].decode().split())
    finally:
        process.terminate()
        process.wait(10)


def test_cli_serve_refuses_a_max_model_len_past_the_context_before_serving(tiny_target, monkeypatch, capsys):
    """The limits are resolved as the scheduler resolves them, before uvicorn starts: a clear error, exit 2."""
    import uvicorn

    from verispec.cli import main

    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: pytest.fail("served despite an impossible limit"))
    assert main(["serve", "--target", str(tiny_target), "--draft", "none", "--max-model-len", "100000"]) == 2
    assert "max_model_len must lie in 2…128" in capsys.readouterr().err


def test_cli_serve_on_ray_passes_every_limit_to_the_replicas(tiny_target, monkeypatch):
    """Every limit of `serve` reaches the replicas' create_app (it was refused before); a bad value is
    refused before Ray starts. Fails if an option is dropped on the way (Ray itself is not started)."""
    from verispec.cli import main
    from verispec.serving.cluster import serve as cluster_serve
    from verispec.serving.cluster.serve import build_app

    deployed = []
    monkeypatch.setattr(cluster_serve, "run_cli", lambda spec, options, address, describe: deployed.append(options) or 0)
    monkeypatch.setenv("VERISPEC_API_KEY", "k3y")
    assert main(["serve", "--ray", "--target", str(tiny_target), "--cors-origin", "https://app.example", "--max-body-bytes", "999",
                 "--max-tokens-limit", "77", "--stall-seconds", "5", "--prefill-chunk", "32", "--kv-pool-tokens", "5000",
                 "--max-model-len", "100", "--max-queue", "3", "--body-timeout", "12", "--shutdown-grace", "4"]) == 0
    app_options = deployed[0].app_options()
    assert app_options == {**app_options, "api_key": "k3y", "cors_origins": ["https://app.example"], "max_body_bytes": 999,
                           "max_tokens_limit": 77, "stall_seconds": 5.0, "prefill_chunk": 32, "kv_pool_tokens": 5000,
                           "max_model_len": 100, "max_queue": 3, "body_timeout": 12.0, "shutdown_grace": 4.0}
    assert deployed[0].deployment_options()["graceful_shutdown_timeout_s"] == 4.0
    assert main(["serve", "--ray", "--target", str(tiny_target), "--prefill-chunk", "-1"]) == 2
    assert len(deployed) == 1
    captured = []
    monkeypatch.setattr(cluster_serve, "application", lambda spec, options: captured.append(options))
    build_app({"target": str(tiny_target), "cors_origins": "https://a.example,https://b.example", "prefill_chunk": "64",
               "kv_pool_tokens": "none", "api_key": "k"})
    assert captured[0].cors_origins == ("https://a.example", "https://b.example") and captured[0].prefill_chunk == 64
    assert captured[0].kv_pool_tokens is None and captured[0].api_key == "k"


def test_schemathesis_finds_no_server_errors(server):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models"}
    failures = []
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=15, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
        def call(case):
            if isinstance(case.body, dict) and "model" in case.body:
                case.body["model"] = MODEL  # past the model check, so that generation itself is exercised
            response = case.call(base_url=server.url, timeout=30)
            if response.status_code >= 500:
                failures.append(f"{case.method} {case.path} {case.body!r} -> {response.status_code} {response.text[:200]}")
        call()
    assert not failures, "\n".join(failures[:5])


def test_playground_streams_coloured_tokens(server, reference, tmp_path):
    with chromium() as browser:
        page = browser.new_page()
        page.goto(server.url + "/")
        page.wait_for_function("document.getElementById('server').textContent.includes('drafter')")
        page.fill("#prompt", PROMPTS[3])
        page.fill("#max_tokens", "40")
        page.fill("#drafter", "ngram:max_n=2")  # the request's own drafter and γ policy (still exact)
        page.select_option("#gamma_policy", "heuristic")
        page.click("#go")
        page.wait_for_function("document.querySelectorAll('#output .tok').length >= 40", timeout=30000)
        page.wait_for_function("!document.getElementById('go').disabled")
        classes = page.eval_on_selector_all("#output .tok", "spans => spans.map(s => s.className)")
        assert {"tok accepted"} <= set(classes) and set(classes) <= {"tok accepted", "tok recovered", "tok bonus", "tok target"}
        colours = page.eval_on_selector_all(".tok.accepted", "spans => spans.map(s => getComputedStyle(s).backgroundColor)")
        assert set(colours) == {"rgb(200, 240, 200)"}  # green
        assert float(page.text_content("#tau")) > 1 and float(page.text_content("#tps")) > 0
        assert page.locator("#chart .position-bar").count() >= 1
        text = page.text_content("#output")
        assert text == expected_text(reference, PROMPTS[3], 40)
        page.screenshot(path=str(tmp_path / "playground.png"), full_page=True)
        assert (tmp_path / "playground.png").stat().st_size > 1000


def test_loadtest_is_bounded_and_reports(server):
    from verispec.tools.bench.loadtest import run_level

    body = {"prompt": PROMPTS[3], "max_tokens": 8, "temperature": 0}
    rows = [asyncio.run(run_level(server.url, MODEL, clients, 6, body)) for clients in (1, 3)]
    for row in rows:
        assert row["requests"] == 6 and row["failures"] == 0 and row["garbled"] == 0 and row["tokens_per_second"] > 0
        assert row["p50_latency_s"] <= row["p99_latency_s"] and row["mean_accepted_length"] > 1
    # public prompts, request i the i-th (cycling): each prompt's answers compared among themselves
    row = asyncio.run(run_level(server.url, MODEL, 2, 4, {"max_tokens": 8, "temperature": 0}, prompts=[PROMPTS[3], PROMPTS[1]]))
    assert row["failures"] == 0 and row["garbled"] == 0 and row["mean_accepted_length"] > 1


def test_loadtest_measures_any_openai_server(monkeypatch):
    """Another server (llama.cpp's) reports no `usage.steps`: no τ, and answers of one prompt that differ are garbled."""
    import functools

    from verispec.tools.bench import loadtest

    def answer(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":  # no /metrics of verispec's: nothing priced
            return httpx.Response(404)
        body = json.loads(request.content)
        if "seed" not in body:  # `seeded=False` below
            return httpx.Response(400, json={"error": {"message": "this mock answers seeded requests only"}})
        prompt = body["messages"][0]["content"]
        text = {"a": "one", "b": "two"}[prompt] + ("!" if body["seed"] == 3 else "")
        return httpx.Response(200, json={"choices": [{"message": {"content": text}}],
                                         "usage": {"prompt_tokens": 5, "completion_tokens": 4}})

    monkeypatch.setattr(loadtest.httpx, "AsyncClient",
                        functools.partial(httpx.AsyncClient, transport=httpx.MockTransport(answer)))
    row = asyncio.run(loadtest.run_level("http://test", "m", 2, 6, {"max_tokens": 4, "temperature": 0}, chat=True, prompts=["a", "b"]))
    assert row["failures"] == 0 and row["mean_accepted_length"] is None and row["tokens_per_second"] > 0
    assert row["measured_over_priced"] == {} and row["garbled"] == 1  # request 3 (prompt "b") differs from b's other two answers
    row = asyncio.run(loadtest.run_level("http://test", "m", 2, 6, {"max_tokens": 4, "temperature": 0}, chat=True,
                                         prompts=["a", "b"], seeded=False))
    assert row["failures"] == 6  # no seed sent
