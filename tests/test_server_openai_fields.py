"""`logprobs` / `top_logprobs`, `n`, vLLM's ending extras, `response_format` and /tokenize through the official `openai` client.

Choices (`n`): each is what the engine gives alone for that seed (seed + i), streamed or not, with its own
index and log-probability offsets; `usage` counts the prompt once. A list of prompts (text or token ids):
answer i is prompt i // n's, seeded seed + i, each what the engine gives alone; at most MAX_PROMPTS answers.

Log-probabilities: the server's values (streamed and not, completions and chat) are the engine's own,
which tests/test_logprobs.py checks against a direct forward of the target. JSON: a tiny random model
over single characters (tests/char_model.py) answers `response_format` json_schema / json_object with
text that parses (and follows the schema); on the old server these fields were a 400.
"""

from __future__ import annotations

import dataclasses
import json

import httpx
import openai
import pytest
from server_helpers import MODEL, LocalServer, tiny_engine

from verispec import Engine, GenerationConfig, SamplingParams
from verispec.drafters import DraftModelDrafter
from verispec.serving.http import create_app
from verispec.serving.http.schemas import MAX_PROMPTS

PROMPT = "t20 t21 t22 t20 t21"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(tiny_target):
    return tiny_engine(tiny_target)


@pytest.fixture(scope="module")
def client(engine):
    with LocalServer(create_app(engine, model_name=MODEL)) as running:
        yield openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _expected(engine, prompt_ids, k: int, n: int = 8):
    """The events (with log-probabilities) the engine itself gives for this greedy request."""
    return list(engine.stream(prompt_ids, GenerationConfig(max_new_tokens=n, logprobs=k)))


def test_completion_logprobs_streamed_and_not(client, engine):
    events = _expected(engine, engine.prompt_ids(PROMPT, chat=False), 2)
    tokenizer = engine.target.tokenizer
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
    lp = whole.choices[0].logprobs
    assert lp.tokens == [tokenizer.decode([e.token_id]) for e in events]
    assert lp.token_logprobs == pytest.approx([e.logprobs.logprob for e in events], abs=1e-6)
    assert [list(top.values()) for top in lp.top_logprobs] == [[pytest.approx(v, abs=1e-6) for _, v in e.logprobs.top] for e in events]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2, stream=True)
    chunks = [chunk.choices[0].logprobs for chunk in streamed if chunk.choices and chunk.choices[0].logprobs]
    assert sum((c.tokens for c in chunks), []) == lp.tokens
    assert sum((c.text_offset for c in chunks), []) == lp.text_offset
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).choices[0].logprobs is None


def test_an_answer_that_ends_at_once_has_empty_logprobs_not_null(client, engine):
    """A bias that makes the end of text the first token: no answer token, yet the log-probabilities asked for
    come as an empty list (chat) or empty lists (completions), as OpenAI's clients expect; not asked for: null."""
    end = {str(min(engine.target.eos_ids)): 100}
    messages = [{"role": "user", "content": PROMPT}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, logprobs=True, logit_bias=end)
    assert chat.choices[0].message.content == "" and chat.choices[0].finish_reason == "stop"
    assert chat.choices[0].logprobs.content == []
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, logprobs=2, logit_bias=end)
    assert text.choices[0].text == "" and text.choices[0].logprobs.tokens == [] and text.choices[0].logprobs.top_logprobs == []
    unasked = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, logit_bias=end)
    assert unasked.choices[0].message.content == "" and unasked.choices[0].logprobs is None


def test_chat_logprobs_streamed_and_not(client, engine):
    from verispec.serving.request import chat_prompt_ids
    from verispec.serving.http.schemas import ChatMessage

    events = _expected(engine, chat_prompt_ids(engine, [ChatMessage(role="user", content=PROMPT)]), 3)
    messages = [{"role": "user", "content": PROMPT}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([e.logprobs.logprob for e in events], abs=1e-6)
    assert all(len(c.top_logprobs) == 3 and c.bytes == list(c.token.encode()) for c in content)
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, logprobs=True,
                                              top_logprobs=3, stream=True)
    tokens = [c.token for chunk in streamed if chunk.choices and chunk.choices[0].logprobs for c in chunk.choices[0].logprobs.content]
    assert tokens == [c.token for c in content]
    only = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, logprobs=True)
    assert all(c.top_logprobs == [] for c in only.choices[0].logprobs.content)


def test_n_choices_are_each_what_the_engine_gives_alone(client, engine):
    sampled = GenerationConfig(max_new_tokens=8, sampling=SamplingParams(temperature=1.0), chat=False)
    alone = [engine.generate(PROMPT, GenerationConfig(**{**sampled.__dict__, "seed": 7 + i})) for i in range(3)]
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7, n=3, logprobs=1)
    assert [choice.index for choice in whole.choices] == [0, 1, 2]
    assert [choice.text for choice in whole.choices] == [result.text for result in alone]
    assert len({result.text for result in alone}) > 1  # the seeds differ: so do the choices
    assert all(choice.logprobs.text_offset[0] == 0 for choice in whole.choices)  # each choice's offsets start at 0
    assert whole.usage.prompt_tokens == alone[0].stats.prompt_tokens
    assert whole.usage.completion_tokens == sum(result.stats.new_tokens for result in alone)
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7, n=3, stream=True,
                                         stream_options={"include_usage": True})
    texts, finished, usage = ["", "", ""], set(), None
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finished |= {choice.index} if choice.finish_reason else set()
        usage = chunk.usage or usage
    assert texts == [result.text for result in alone] and finished == {0, 1, 2}
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_a_list_of_prompts_is_answered_prompt_by_prompt(client, engine):
    """OpenAI's batched completions (lm-evaluation-harness sends them): answer i is prompt i // n's choice i % n, seeded
    seed + i, each what the engine gives alone; usage counts every prompt once; token-id prompts and echo too."""
    prompts, n = [PROMPT, "t9 t8 t7 t9 t8", "t30 t31"], 2
    sampled = GenerationConfig(max_new_tokens=6, sampling=SamplingParams(temperature=1.0), chat=False)
    alone = [engine.generate(prompt, dataclasses.replace(sampled, seed=3 + i)) for i, prompt in enumerate(p for p in prompts for _ in range(n))]
    whole = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=1.0, seed=3, n=n)
    assert [choice.text for choice in whole.choices] == [result.text for result in alone]
    assert whole.usage.prompt_tokens == sum(result.stats.prompt_tokens for result in alone[::n])
    streamed = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=1.0, seed=3, n=n, stream=True,
                                         stream_options={"include_usage": True})
    texts, usage = [""] * len(alone), None
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
        usage = chunk.usage or usage
    assert texts == [result.text for result in alone] and usage.prompt_tokens == whole.usage.prompt_tokens
    ids = [engine.prompt_ids(prompt, chat=False) for prompt in prompts]
    greedy = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, echo=True)
    assert [choice.text for choice in greedy.choices] == [
        prompt + engine.generate(prompt, GenerationConfig(max_new_tokens=6, chat=False)).text for prompt in prompts]


@pytest.mark.parametrize(("prompt", "n", "status", "param"), [
    (["t5"] * (MAX_PROMPTS + 1), 1, 422, "prompt"), (["t5"] * 3, 11, 400, "n"), ([[5], "t5"], 1, 422, "prompt"),
])
def test_too_many_answers_or_mixed_prompts_are_refused(client, prompt, n, status, param):
    with pytest.raises(openai.APIStatusError) as error:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, n=n)
    assert error.value.status_code == status and error.value.body["param"].startswith(param), error.value.body


def test_n_greedy_chat_choices_are_alike(client):
    messages = [{"role": "user", "content": PROMPT}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in reply.choices] == [0, 1] and reply.choices[0].message.content == reply.choices[1].message.content
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, n=2, stream=True)
    texts = ["", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [reply.choices[0].message.content] * 2


def test_stop_token_ids_min_tokens_and_ignore_eos_reach_the_engine(client, engine):
    """vLLM's extras, through `extra_body`: each answer is the engine's own with the same settings."""
    plain = engine.generate(PROMPT, GenerationConfig(max_new_tokens=8, chat=False))
    stop = plain.token_ids[2]
    first = plain.token_ids.index(stop)
    for extra, config in [({"stop_token_ids": [stop]}, {"stop_token_ids": (stop,)}),
                          ({"min_tokens": 8, "ignore_eos": True}, {"min_tokens": 8, "ignore_eos": True})]:
        reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, extra_body=extra)
        alone = engine.generate(PROMPT, GenerationConfig(max_new_tokens=8, chat=False, **config))
        assert reply.choices[0].text == alone.text and reply.usage.completion_tokens == len(alone.token_ids)
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"stop_token_ids": [stop]})
    assert stopped.usage.completion_tokens == first + 1 and stopped.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"min_tokens": 9, "max_tokens": 8}, 400, "min_tokens"),
    ({"stop_token_ids": [10**6]}, 400, "stop_token_ids"),
    ({"stop_token_ids": list(range(17))}, 422, "stop_token_ids"),
    ({"ignore_eos": True, "response_format": {"type": "json_object"}}, 400, "ignore_eos"),
    ({"n": 17}, 422, "n"),
    ({"n": 0}, 422, "n"),
    ({"top_logprobs": 2}, 400, "top_logprobs"),  # without logprobs: true
    ({"logprobs": True, "top_logprobs": 21}, 422, "top_logprobs"),
    ({"response_format": {"type": "json_schema"}}, 400, "response_format"),
    ({"response_format": {"type": "xml"}}, 422, "response_format"),
])
def test_bad_values_are_refused_by_name(client, body, status, param):
    url = str(client.base_url).rstrip("/") + "/chat/completions"
    response = httpx.post(url, json={"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "max_tokens": 4, **body}, timeout=60)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


@pytest.fixture(scope="module")
def json_client(tmp_path_factory):
    from char_model import char_model

    target = char_model(tmp_path_factory.mktemp("chars") / "model")
    engine = Engine(target, DraftModelDrafter(target, target.vocab_size), gamma=3, gamma_policy="constant")
    with LocalServer(create_app(engine, model_name=MODEL)) as running:
        yield openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_response_format_json_schema_and_json_object(json_client):
    messages = [{"role": "user", "content": "ok?"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    for stream in (False, True):
        for seed in range(3):
            kwargs = dict(model=MODEL, messages=messages, max_tokens=60, temperature=1.0, seed=seed, response_format=fmt)
            if stream:
                text = "".join(c.choices[0].delta.content or "" for c in json_client.chat.completions.create(**kwargs, stream=True) if c.choices)
            else:
                reply = json_client.chat.completions.create(**kwargs)
                text = reply.choices[0].message.content
                assert reply.choices[0].finish_reason == "stop"
            assert isinstance(json.loads(text)["ok"], bool) and set(json.loads(text)) == {"ok"}
    anything = json_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0,
                                                   response_format={"type": "json_object"})
    if anything.choices[0].finish_reason == "stop":
        json.loads(anything.choices[0].message.content)


def test_batch_records_refuse_logprobs_they_would_not_return():
    """A batch job writes text and statistics only: a record asking for logprobs is refused, not ignored."""
    from pydantic import ValidationError

    from verispec.serving.cluster.batch import BatchRecord

    with pytest.raises(ValidationError, match="logprobs"):
        BatchRecord.model_validate({"id": 1, "prompt": "t5", "logprobs": 2})


def test_tokenize_and_detokenize_agree_with_generation(client, engine):
    """/tokenize gives the ids a request is generated from (usage.prompt_tokens counts them); /detokenize inverts it."""
    url = str(client.base_url).rstrip("/").removesuffix("/v1")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}]}
    tokens = httpx.post(url + "/tokenize", json=chat, timeout=60).json()
    reply = client.chat.completions.create(**chat, max_tokens=1)
    assert tokens["count"] == len(tokens["tokens"]) == reply.usage.prompt_tokens and tokens["max_model_len"] > 0
    plain = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": PROMPT}, timeout=60).json()
    assert plain["tokens"] == engine.prompt_ids(PROMPT, chat=False)
    text = httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": plain["tokens"]}, timeout=60).json()["prompt"]
    assert engine.prompt_ids(text, chat=False) == plain["tokens"]
    for path, body, status, param in [("/tokenize", {"model": MODEL}, 422, None), ("/tokenize", {"model": "x", "prompt": "t5"}, 400, "model"),
                                      ("/detokenize", {"model": MODEL, "tokens": [10**6]}, 400, "tokens")]:
        response = httpx.post(url + path, json=body, timeout=60)
        assert response.status_code == status and (param is None or response.json()["error"]["param"] == param), response.text


def test_echo_returns_the_prompt_scored_as_evaluation_harnesses_ask(client, engine):
    """lm-evaluation-harness's loglikelihood request: echo, logprobs, one new token. The prompt comes back first,
    its tokens' values the engine's own `prompt_logprobs` (the first null), then the answer's."""
    alone = engine.generate(PROMPT, GenerationConfig(max_new_tokens=1, chat=False, prompt_logprobs=1, logprobs=1))
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=1)
    choice = reply.choices[0]
    assert choice.text == PROMPT + alone.text
    prompt_ids = engine.prompt_ids(PROMPT, chat=False)
    tokenizer = engine.target.tokenizer
    assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in prompt_ids + alone.token_ids]
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    want = [lp.logprob for lp in alone.prompt_logprobs[1:]] + [lp.logprob for lp in alone.logprobs]
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-6)
    assert choice.logprobs.text_offset == [sum(len(t) for t in choice.logprobs.tokens[:i]) for i in range(len(prompt_ids) + 1)]
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, echo=True)
    assert plain.choices[0].text.startswith(PROMPT) and plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="not with stream"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, echo=True, stream=True)
