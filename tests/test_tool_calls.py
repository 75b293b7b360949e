"""Tool calls: parsed out of an answer only when every <tool_call> block is a call (else the answer stays text),
streamed text held from where a block may begin and nothing else, the grammar of `tool_choice` required /
named accepting exactly calls that follow the schemas; over HTTP on a tiny character model whose template
offers tools: the tools and earlier calls reach the prompt, a required or named call comes back as OpenAI's
`tool_calls` (streamed and not) with arguments that follow the schema, and bad tool requests are refused
naming the field."""

from __future__ import annotations

import json

import openai
import pytest
from char_model import TOOL_CHARS, TOOLS_TEMPLATE, char_model, char_tokenizer
from server_helpers import MODEL, LocalServer

from verispec import Engine
from verispec.drafters import DraftModelDrafter
from verispec.serving.http import create_app
from verispec.serving.tool_calls import ToolCallStream, call_grammar, offers_tools, parse_tool_calls

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
UNIT = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": UNIT}},
         {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize(("text", "content", "calls"), [
    ("just text", "just text", []),
    (CALL, None, [("get_weather", {"city": "Paris"})]),
    ("Let me look.\n" + CALL + "\n" + CALL.replace("Paris", "Oslo"), "Let me look.",
     [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]),
    ('<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call>', None, [("f", {"x": 1})]),  # arguments as text
])
def test_answers_are_split_into_text_and_calls(text, content, calls):
    got_content, got_calls = parse_tool_calls(text)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got_calls)


@pytest.mark.parametrize("text", [
    "<tool_call>\n{not json}\n</tool_call>",
    '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
    CALL + "\nand then some words",  # text after the calls
    CALL[:-5],  # cut off inside a block
    CALL + "\n<tool_call>\n[1, 2]\n</tool_call>",  # one block of two is no call
    '<tool_call>\n{"name": "f", "arguments": "not json"}\n</tool_call>',  # arguments as text that holds no object
])
def test_an_answer_whose_blocks_are_not_all_calls_stays_text(text):
    assert parse_tool_calls(text) == (text, [])


@pytest.mark.parametrize("text", ["Hello <toolbox> and <tool", "Sure.\n" + CALL, CALL + "\ntrailing", "plain"])
def test_a_stream_sends_everything_but_the_calls_whatever_the_pieces(text):
    whole_content, whole_calls = parse_tool_calls(text)
    for size in (1, 3, 7, len(text)):
        stream = ToolCallStream()
        sent = "".join(stream.feed(text[i : i + size]) for i in range(0, len(text), size))
        rest, calls = stream.finish()
        if whole_calls:
            assert sent + rest == (whole_content or "") and [c["function"] for c in calls] == [c["function"] for c in whole_calls]
            assert "<" not in sent  # nothing of a block was sent as text
        else:
            assert sent + rest == text and calls == []


def _matcher(grammar: str):
    import xgrammar as xgr

    tokenizer = char_tokenizer(TOOL_CHARS)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(TOOL_CHARS) + 2, stop_token_ids=[0])
    compiled = xgr.GrammarCompiler(info).compile_grammar(grammar)
    return xgr.GrammarMatcher(compiled), tokenizer


def _accepts(grammar: str, text: str) -> bool:
    matcher, tokenizer = _matcher(grammar)
    return all(matcher.accept_token(t) for t in tokenizer.encode(text)) and matcher.accept_token(0)


def test_the_call_grammar_takes_calls_that_follow_the_schemas_and_nothing_else():
    functions = [tool["function"] for tool in TOOLS]
    weather = '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c"}}\n</tool_call>'
    now = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    both = call_grammar(functions)
    assert _accepts(both, weather) and _accepts(both, now) and _accepts(both, weather + "\n" + now)
    assert not _accepts(call_grammar(functions, parallel=False), weather + "\n" + now)
    assert not _accepts(both, weather.replace('"c"', '"k"'))  # outside the enum
    assert not _accepts(both, weather.replace("get_weather", "get_time"))  # no such tool
    assert not _accepts(both, "sure")  # text where a call must be
    assert not _accepts(call_grammar(functions[1:]), weather)  # a named choice: that tool only


def test_templates_that_offer_tools():
    assert offers_tools(TOOLS_TEMPLATE + "{# <tool_call> #}") and not offers_tools("{{ messages }}") and not offers_tools(None)


# ---- over HTTP ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    target = char_model(tmp_path_factory.mktemp("tools") / "model", chars=TOOL_CHARS, template=TOOLS_TEMPLATE + "{# <tool_call> #}")
    engine = Engine(target, DraftModelDrafter(target, target.vocab_size), gamma=3, gamma_policy="constant")
    with LocalServer(create_app(engine, model_name=MODEL)) as running:
        yield engine, openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=60)


MESSAGES = [{"role": "user", "content": "weather?"}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}], ids=["required", "named"])
def test_a_required_or_named_call_comes_back_as_tool_calls(tool_server, choice):
    engine, client = tool_server
    for seed in range(3):
        kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                      max_tokens=80, temperature=1.0, seed=seed)
        reply = client.chat.completions.create(**kwargs)
        (call,) = reply.choices[0].message.tool_calls
        assert reply.choices[0].finish_reason == "tool_calls" and reply.choices[0].message.content is None
        arguments = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            assert arguments["unit"] in ("c", "f")
        assert call.function.name == "get_weather" or choice == "required"
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        streamed = [c for chunk in chunks for choice_ in chunk.choices for c in (choice_.delta.tool_calls or [])]
        assert [(c.function.name, c.function.arguments) for c in streamed] == [(call.function.name, call.function.arguments)]
        assert "".join(choice_.delta.content or "" for chunk in chunks for choice_ in chunk.choices) == ""
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_the_tools_and_earlier_calls_reach_the_prompt(tool_server):
    engine, client = tool_server
    history = MESSAGES + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
                                                            "function": {"name": "get_weather", "arguments": '{"unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    reply = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=1, temperature=0)
    prompt = engine.target.encode_chat([{"role": m["role"], "content": m["content"]} for m in history], TOOLS)
    text = engine.target.tokenizer.decode(prompt)
    assert text.startswith("get_weather,now,weather?") and text.endswith("sunny")
    assert reply.usage.prompt_tokens == len(prompt) + len('get_weather{"unit": "c"}')  # the call, rendered by the template
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=1)
    assert plain.usage.prompt_tokens == len("weather?")  # tool_choice none: the tools are not shown


@pytest.mark.parametrize(("extra", "status", "param", "words"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, "tool_choice", "no tool is named"),
    ({"tools": TOOLS + TOOLS[:1]}, 400, "tools", "same name"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, 400, "response_format", "free text"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, 422, "messages", "only a tool message"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "now", "arguments": "[1]"}}]}]}, 422, "messages", "JSON object"),
])
def test_bad_tool_requests_are_refused_naming_the_field(tool_server, extra, status, param, words):
    _, client = tool_server
    with pytest.raises(openai.APIStatusError) as error:
        client.chat.completions.create(**{"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, **extra})
    assert error.value.status_code == status and words in error.value.body["message"], error.value.body
    assert error.value.body["param"].startswith(param), error.value.body
