"""The server's limits and guards, on tiny models over real HTTP: bounded drafter specs, checked before
the queue, per-request drafters only over loaded models and never from files, the API key and CORS,
body and token limits, bad bytes, lone surrogates (also in a json_schema) and JSON nested too deep as
400s in the error envelope, OpenAI fields honoured or refused by name, and /health reporting a stalled
scheduler."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import pytest
from server_helpers import MODEL, LocalServer, chromium, slow, tiny_engine

from verispec.drafters.derived import draft_precision
from verispec.models.loading import ModelCache
from verispec.serving.http import create_app

KEY = "s3cret-key"
PROMPT = "t20 t21 t22 t20 t21"  # loops: no EOS within 100 tokens


@pytest.fixture(scope="module")
def engine_with_draft(tiny_target, tiny_draft):
    """The tiny engine (n-gram drafter) whose frozen ModelCache also holds the tiny draft model, as
    `verispec serve --draft …` leaves it: a request may pick `tree`, `model`, … over that draft.
    Drafts stay float32 (no int8 kernels to compile for tiny models)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("verispec.drafters.derived.int8_available", lambda: False)
        engine = tiny_engine(tiny_target)
        models = ModelCache(engine.target)
        draft = models(str(tiny_draft), draft_precision(engine.target), pack_rows=1)
        models.default_draft, models.frozen = draft.name, True
        engine.models, engine.drafter_spec = models, "ngram"
        yield engine


@pytest.fixture(scope="module")
def server(engine_with_draft):
    app = create_app(engine_with_draft, model_name=MODEL, max_tokens_limit=64, max_body_bytes=4096)
    with LocalServer(app) as running:
        yield running


@pytest.fixture(scope="module")
def unloaded_model(tmp_path_factory):
    """A real model folder the server did not load (it would load, were the cache not frozen)."""
    from conftest import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("unloaded") / "model", seed=3, layers=1)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def post(server, body: dict, path: str = "/v1/completions", **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60, **kwargs)


def assert_error(response: httpx.Response, status: int, param: str | None, message: str) -> None:
    """The OpenAI error envelope, exactly its four keys, naming the field."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(response.json()) == {"error"} and set(error) == {"message", "type", "param", "code"}
    assert message in error["message"] and error["param"] == param, error


def metric(server, name: str, headers: dict | None = None) -> float:
    text = httpx.get(server.url + "/metrics", headers=headers).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, flags=re.M))


# ---- 1. bounded drafter specs ---------------------------------------------------------------------

def test_an_unbounded_tree_is_a_400_and_a_bounded_one_completes(server):
    assert_error(post(server, {"model": MODEL, "prompt": PROMPT, "drafter": "tree:k=1000,depth=1000"}),
                 400, "drafter", "k=1000 in 'tree:k=1000,depth=1000' is out of range: use 1…8")
    assert_error(post(server, {"model": MODEL, "prompt": PROMPT, "drafter": "tree:k=8,depth=12,wide=12"}),
                 400, "drafter", "more than 256")
    response = post(server, {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "drafter": "tree:k=2,depth=3"})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 12


@pytest.mark.parametrize(("spec", "message"), [
    ("tree:k=8,depth=12,wide=12", "more than 256"),
    ("tree:depth=2,wide=3", "wide must not exceed depth"),
    ("ngram:min_n=3,max_n=2", "min_n must not exceed max_n"),
    ("stand:width=2", "unknown stand drafter option 'width'"),
    ("cascade:kind=diagonal", "use kind=vertical or kind=horizontal"),
    ("self:layers=0", "layers=0 in 'self:layers=0' is out of range"),
])
def test_a_bad_drafter_spec_is_refused_before_the_queue(server, monkeypatch, spec, message):
    """In the handler, by the factory's own checks: never queued (seconds behind other requests) to be
    refused by the worker. Fails (a 500 here) if the request reaches `submit`."""
    def no_queue(*args, **kwargs):
        raise AssertionError("the request was queued")
    monkeypatch.setattr(server.server.config.app.state.scheduler, "submit", no_queue)
    assert_error(post(server, {"model": MODEL, "prompt": PROMPT, "drafter": spec}), 400, "drafter", message)


def test_gamma_is_bounded(server):
    assert_error(post(server, {"model": MODEL, "prompt": PROMPT, "gamma": 33}), 422, "gamma", "less than or equal to 32")


def test_the_cli_refuses_an_unbounded_tree(tiny_target, capsys, monkeypatch):
    from verispec.cli import main

    monkeypatch.setenv("COLUMNS", "400")  # one line of error
    assert main(["generate", "--target", str(tiny_target), "--draft", "tree:k=1000,depth=1000", "t5"]) == 2
    assert "k=1000 in 'tree:k=1000,depth=1000' is out of range: use 1…8" in capsys.readouterr().err


# ---- 2. a request's drafter: loaded models only, nothing read from files ----------------------------

@pytest.mark.parametrize(("spec", "message"), [
    ("gguf:/etc/passwd", "is not loaded here"),
    ("model:{unloaded}", "is not loaded here"),
    ("{unloaded}", "is not loaded here"),
    ("gguf", "is not loaded here"),
    ("qwen2.5-coder-0.5b-instruct", "is not loaded here"),  # shipped, not loaded: never installed
    ("cascade:draft={unloaded}", "is not loaded here"),
    ("online", "'online' cannot be picked per request"),
    ("online:self_layers=1", "'online' cannot be picked per request"),
    ("self:layers=1,int8=1", "option int8= cannot be used per request"),
    ("self:vocab=20", "option vocab= cannot be used per request"),
])
def test_a_request_drafter_cannot_read_files(server, unloaded_model, spec, message):
    response = post(server, {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "drafter": spec.format(unloaded=unloaded_model)})
    assert_error(response, 400, "drafter", message)


def test_a_request_may_use_the_loaded_draft(server, tiny_draft):
    for spec in ("model", f"model:{tiny_draft}", "hybrid", "self:layers=1"):
        response = post(server, {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "drafter": spec})
        assert response.status_code == 200, (spec, response.text)


# ---- 3. API key and CORS ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def locked(tiny_target):
    app = create_app(tiny_engine(tiny_target), model_name=MODEL, api_key=KEY, cors_origins=["https://app.example"])
    with LocalServer(app) as running:
        yield running


def test_the_api_key_is_required_on_v1_metrics_and_the_schema(locked, monkeypatch):
    import hmac

    from verispec.serving.http import guard

    compared = []
    compare = hmac.compare_digest
    monkeypatch.setattr(guard.hmac, "compare_digest", lambda a, b: compared.append(1) or compare(a, b))
    good = openai.OpenAI(base_url=locked.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    assert [m.id for m in good.models.list().data] == [MODEL]
    assert good.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0).usage.completion_tokens == 3
    assert compared, "the key was not compared in constant time"
    bad = openai.OpenAI(base_url=locked.url + "/v1", api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as error:
        bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "t5"}], max_tokens=3)
    assert error.value.status_code == 401 and error.value.body["code"] == "invalid_api_key"
    for path, headers in [("/v1/models", {}), ("/v1/models", {"Authorization": KEY}), ("/metrics", {"Authorization": "Bearer x"})]:
        response = httpx.get(locked.url + path, headers=headers)
        assert_error(response, 401, None, "missing or wrong API key")
        assert response.headers["www-authenticate"] == "Bearer"
    assert_error(httpx.post(locked.url + "/v1/completions", json={"model": MODEL, "prompt": "t5"}), 401, None, "API key")
    assert httpx.get(locked.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    for path in ("/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect", "/nothing"):  # the README: only these two stay open
        assert_error(httpx.get(locked.url + path), 401, None, "missing or wrong API key")
    assert httpx.get(locked.url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()["info"]["title"] == "verispec"
    assert httpx.get(locked.url + "/health").json()["status"] == "ok"  # open
    assert "<textarea" in httpx.get(locked.url + "/").text  # the playground page is open; it sends the key itself


def test_cors_allows_the_configured_origin_only(locked, server):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    allowed = httpx.options(locked.url + "/v1/completions", headers={"Origin": "https://app.example", **preflight})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "https://app.example"
    assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
    other = httpx.options(locked.url + "/v1/completions", headers={"Origin": "https://evil.example", **preflight})
    assert "access-control-allow-origin" not in other.headers
    denied = httpx.get(locked.url + "/v1/models", headers={"Origin": "https://app.example"})  # no key: 401, still readable
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "https://app.example"
    assert "access-control-allow-origin" not in httpx.get(server.url + "/v1/models", headers={"Origin": "https://app.example"}).headers



def test_the_playground_sends_its_key(locked):
    with chromium() as browser:
        page = browser.new_page()
        page.goto(locked.url + "/")
        page.wait_for_function("document.getElementById('server').textContent.includes('missing or wrong API key')")
        page.fill("#api_key", KEY)
        page.dispatch_event("#api_key", "change")
        page.wait_for_function("document.getElementById('server').textContent.includes('drafter')")
        page.fill("#prompt", PROMPT)
        page.fill("#max_tokens", "8")
        page.click("#go")
        page.wait_for_function("document.querySelectorAll('#output .tok').length >= 8", timeout=30000)
        assert page.text_content("#error") == ""
        page.reload()  # the key is remembered by this browser
        page.wait_for_function("document.getElementById('server').textContent.includes('drafter')")

# ---- 4. body and token limits, bad bytes, metrics ---------------------------------------------------------

def test_a_large_body_is_a_413_before_parsing(server):
    big = {"model": MODEL, "prompt": "t5 " * 3000}
    assert_error(post(server, big), 413, None, "larger than this server's limit of 4096 bytes")

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(100):
            yield b"t5 " * 100
        yield b'"}'
    response = httpx.post(server.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_error(response, 413, None, "larger than")


def test_a_body_that_stalls_is_a_408_and_the_connection_closes(tiny_target):
    """Headers and part of the body, then nothing: answered 408 after body_timeout, the connection
    closed. Fails (the read times out) if the server waits for the rest forever."""
    import socket

    with LocalServer(create_app(tiny_engine(tiny_target), model_name=MODEL, body_timeout=0.5)) as running:
        with socket.create_connection(("127.0.0.1", running.port), timeout=10) as connection:
            connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                               b"Content-Length: 100\r\n\r\n{\"model\": \"tiny\"")
            started, answer = time.monotonic(), b""
            while chunk := connection.recv(65536):  # until the server closes the connection
                answer += chunk
            assert time.monotonic() - started < 5
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert b"did not arrive within 0.5 s" in answer and b'"code":"body_timeout"' in answer


def test_max_tokens_beyond_the_limit_is_refused_not_capped(server, client):
    assert_error(post(server, {"model": MODEL, "prompt": PROMPT, "max_tokens": 65}), 400, "max_tokens",
                 "65 is more than this server's limit of 64")
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_completion_tokens=100)
    assert error.value.body["param"] == "max_completion_tokens"
    assert post(server, {"model": MODEL, "prompt": PROMPT, "max_tokens": 64, "temperature": 0}).json()["usage"]["completion_tokens"] == 64


@pytest.mark.parametrize("sampling", [
    {"top_p": 1e-300, "temperature": 1},  # was a 500: "probability tensor contains either inf, nan or element < 0"
    {"top_p": 5e-324, "min_p": 0.9999999999, "temperature": 100},
    {"temperature": 0.001, "repetition_penalty": 100, "epsilon": 0.9999999999, "eta": 0.9999999999},
])
def test_extreme_sampling_values_are_served(server, sampling):
    response = post(server, {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "seed": 1, **sampling})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 8, response.text


@pytest.mark.parametrize(("content", "message"), [
    (b'{"model": "tiny", "prompt": "t5', "not valid JSON"),
    (b'{"model": "tiny", "prompt": "t5 \xff\xfe"}', "not valid UTF-8 (byte 32)"),
    (b'{"model": "tiny", "prompt": "abc\\ud800"}', "invalid 'prompt': contains a lone surrogate '\\ud800'"),
    (b'{"model": "tiny", "prompt": "t5", "stop": ["\\udc00"]}', "invalid 'stop.0': contains a lone surrogate"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "t5\\ud800"}]}', "invalid 'messages.0.content'"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "invalid 'messages.0.content.0.text'"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "t5"}], "response_format": {"type": "json_schema", '
     b'"json_schema": {"schema": {"type": "object", "properties": {"\\ud800": {"type": "string"}}}}}}',
     "response_format: a key in json_schema.schema.properties contains a lone surrogate '\\ud800'"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "t5"}], "response_format": {"type": "json_schema", '
     b'"json_schema": {"schema": {"enum": ["a", "b\\udc00"]}}}}', "response_format: json_schema.schema.enum.1 contains a lone"),
    (b'{"model": "tiny", "prompt": "t5", "user": ' + b"[" * 500 + b"]" * 500 + b"}", "more than 64 levels deep"),
    (b'{"model": "tiny", "prompt": "t5", "user": ' + b"[" * 1900 + b"]" * 1900 + b"}", "more than 64 levels deep"),
])
def test_bad_bytes_and_lone_surrogates_are_400s(server, content, message):
    path = "/v1/chat/completions" if b"messages" in content else "/v1/completions"
    response = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"] and set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_unknown_routes_and_methods_use_the_envelope(server):
    assert_error(httpx.get(server.url + "/v1/nothing"), 404, None, "GET /v1/nothing: Not Found")
    assert_error(httpx.get(server.url + "/v1/completions"), 405, None, "Method Not Allowed")


def test_client_errors_are_not_counted_as_generations(server):
    finished = metric(server, "verispec_generations_finished_total")
    refused = metric(server, 'verispec_requests_total{endpoint="completions",status="400"}')
    for body in [{"prompt": " ".join(["t3"] * 200)}, {"prompt": ""}, {"prompt": [3, 999]}, {"prompt": "t5", "drafter": "model:/nowhere"}]:
        assert post(server, {"model": MODEL, **body}).status_code == 400
    assert metric(server, 'verispec_requests_total{endpoint="completions",status="400"}') == refused + 4
    assert metric(server, "verispec_generations_finished_total") == finished


# ---- 5. OpenAI fields ------------------------------------------------------------------------------------

def test_max_completion_tokens_is_max_tokens(client, server):
    messages = [{"role": "user", "content": PROMPT}]
    new = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=7, temperature=0)
    old = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=7, temperature=0)
    assert new.usage.completion_tokens == 7 and new.choices[0].message.content == old.choices[0].message.content
    body = {"model": MODEL, "messages": messages, "max_tokens": 5, "max_completion_tokens": 7}
    assert_error(post(server, body, "/v1/chat/completions"), 400, "max_completion_tokens", "differs from max_tokens 5")


def test_include_usage_adds_a_last_chunk_with_usage_only(client, server):
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=6,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-2].choices[0].finish_reason == "length"
    plain = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stream=True))
    assert all(chunk.choices for chunk in plain)
    assert_error(post(server, {"model": MODEL, "prompt": PROMPT, "stream_options": {"include_usage": True}}),
                 400, "stream_options", "only allowed with stream: true")


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "t5"}]}
COMPLETION = {"model": MODEL, "prompt": "t5"}


@pytest.mark.parametrize(("base", "field", "value", "message"), [
    (CHAT, "tools", [{"type": "function", "function": {"name": "f"}}], "does not offer tools"),  # the tiny template's
    (CHAT, "tool_choice", "auto", "needs tools"),
    (CHAT, "functions", [{"name": "f"}], "does not call functions"),
    (COMPLETION, "best_of", 3, "one candidate per request"),
    (COMPLETION, "max_token", 5, "unknown field 'max_token'"),
])
def test_unimplemented_fields_are_refused_by_name(server, base, field, value, message):
    path = "/v1/chat/completions" if "messages" in base else "/v1/completions"
    assert_error(post(server, {**base, field: value}, path), 400, field, message)


@pytest.mark.parametrize(("base", "field", "value", "status", "message"), [
    (COMPLETION, "max_tokens", True, 422, "valid integer"),  # was taken as 1
    (COMPLETION, "max_tokens", "5", 422, "valid integer"),
    (CHAT, "max_completion_tokens", 2.0, 422, "valid integer"),
    (COMPLETION, "seed", False, 422, "valid integer"),
    (COMPLETION, "top_k", True, 422, "valid integer"),
    (COMPLETION, "logprobs", True, 422, "valid integer"),
    (COMPLETION, "temperature", True, 422, "valid number"),
    (COMPLETION, "stream", 1, 422, "valid boolean"),
    (CHAT, "n", True, 422, "not true"),
    (CHAT, "n", 2.0, 422, "valid integer"),
    (COMPLETION, "best_of", True, 400, "one candidate per request"),
    (COMPLETION, "presence_penalty", False, 422, "valid number"),
    (CHAT, "frequency_penalty", 2.5, 422, "less than or equal to 2"),
    (COMPLETION, "logit_bias", {"five": 10}, 422, "should match pattern"),
    (COMPLETION, "logit_bias", {"5": 101}, 422, "less than or equal to 100"),
    (COMPLETION, "logit_bias", {str(i): 1 for i in range(301)}, 422, "at most 300"),
])
def test_types_are_strict(server, base, field, value, status, message):
    """A boolean or a string is not an integer, a float not an integer (pydantic's lax mode took them)."""
    path = "/v1/chat/completions" if "messages" in base else "/v1/completions"
    assert_error(post(server, {**base, field: value}, path), status, field, message)


def test_a_logit_bias_outside_the_vocabulary_is_a_400_naming_it(server, engine_with_draft):
    outside = str(engine_with_draft.target.vocab_size)
    assert_error(post(server, {**COMPLETION, "logit_bias": {outside: 5}}), 400, "logit_bias", "outside")


def test_penalties_and_logit_bias_change_what_is_generated(server, engine_with_draft):
    """A looping prompt, greedy: a ban on its first answer token or a presence penalty changes the answer;
    each answer is what the engine alone gives with the same settings (the engine's exactness is
    tested against the reference decoder in test_engine.py)."""
    from verispec import GenerationConfig, SamplingParams

    body = {**COMPLETION, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    plain = post(server, body).json()["choices"][0]["text"]
    first = engine_with_draft.generate(PROMPT, GenerationConfig(max_new_tokens=1, chat=False)).token_ids[0]
    for extra, sampling in [({"logit_bias": {str(first): -100}}, SamplingParams(logit_bias={first: -100})),
                            ({"presence_penalty": 2, "frequency_penalty": 1.5}, SamplingParams(presence_penalty=2, frequency_penalty=1.5))]:
        answer = post(server, {**body, **extra}).json()["choices"][0]["text"]
        alone = engine_with_draft.generate(PROMPT, GenerationConfig(max_new_tokens=12, chat=False, sampling=sampling)).text
        assert answer == alone and answer != plain, (extra, answer, plain)


def test_prompt_token_ids_are_integers(server):
    assert_error(post(server, {**COMPLETION, "prompt": [True, 5]}), 422, "prompt", "invalid 'prompt'")  # was [1, 5]


def test_unimplemented_fields_are_refused_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError, match="does not offer tools"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "t5"}],
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    # their neutral values are accepted
    neutral = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "t5"}], max_tokens=2, logprobs=False,
                                             response_format={"type": "text"}, presence_penalty=0, n=1, user="me")
    assert neutral.usage.completion_tokens <= 2


def test_the_openapi_schema_advertises_what_is_accepted(server):
    schemas = httpx.get(server.url + "/openapi.json").json()["components"]["schemas"]
    completion, chat = schemas["CompletionRequest"], schemas["ChatCompletionRequest"]
    assert completion["additionalProperties"] is False and chat["additionalProperties"] is False
    props, chat_props = completion["properties"], chat["properties"]
    assert props["n"]["maximum"] == 16 and props["best_of"]["anyOf"][0]["const"] == 1
    assert props["model"]["enum"] == chat_props["model"]["enum"] == [MODEL, None]  # the one model served, or none named
    assert props["presence_penalty"]["maximum"] == 2 and "max_completion_tokens" not in props
    assert props["logit_bias"]["anyOf"][0]["maxProperties"] == 300
    assert {"max_completion_tokens", "stream_options", "response_format", "tools"} <= set(chat_props)
    assert chat_props["top_logprobs"]["anyOf"][0]["maximum"] == 20 and props["logprobs"]["anyOf"][0]["maximum"] == 20
    assert schemas["ResponseFormat"]["properties"]["type"]["enum"] == ["text", "json_object", "json_schema"]
    assert schemas["StreamOptions"]["properties"]["include_usage"]["type"] == "boolean"


# ---- 6. /health and a stalled scheduler -------------------------------------------------------------------

def test_health_reports_a_stalled_scheduler(tiny_target):
    engine = slow(tiny_engine(tiny_target), 0.8)  # each target pass takes 0.8 s
    with LocalServer(create_app(engine, model_name=MODEL, stall_seconds=0.3)) as server:
        assert httpx.get(server.url + "/health").json()["status"] == "ok"

        async def run():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                request = asyncio.create_task(http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3}))
                seen = None
                for _ in range(100):
                    health = await http.get("/health")
                    if health.status_code == 503:
                        seen = health
                        break
                    await asyncio.sleep(0.05)
                return seen, await request

        degraded, done = asyncio.run(run())
        assert done.status_code == 200
        assert degraded is not None, "/health never reported the stall"
        body = degraded.json()
        assert body["status"] == "degraded" and body["stalled_seconds"] > 0.3 and "has not advanced" in body["reason"]
        time.sleep(0.1)
        assert httpx.get(server.url + "/health").status_code == 200  # idle again: not stalled
