"""Tool calls in a chat answer: the model writes them, the server hands them to the client as OpenAI's `tool_calls`.

Models whose chat template offers tools in the Hermes format (Qwen2.5 among the shipped ones) answer a call as
`<tool_call>{"name": …, "arguments": {…}}</tool_call>`, one block per call, after any text of their own.
`parse_tool_calls` turns a whole answer into (its text, its calls); `ToolCallStream` does so for a streamed
one: it passes text on until a block may begin (holding trailing whitespace and any tail that may start a
block), then holds the rest until the answer ends: a block is handed over whole. An answer whose blocks are
not all valid calls (a name, and arguments that are a JSON object) is returned as text: a call the client
could not run is not made up.

`tool_choice` "required" or a named function is a grammar (`call_grammar`): the answer is then one or more
blocks whose JSON follows the functions' parameter schemas, enforced token by token like `response_format`
(`verispec.sampling.grammar`), so speculation stays exact for the constrained distribution.
"""

from __future__ import annotations

import json
import re
import uuid

__all__ = ["OPEN", "CLOSE", "ToolCall", "parse_tool_calls", "ToolCallStream", "call_grammar", "offers_tools"]

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


def offers_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders tools and asks for calls in the format parsed here."""
    return bool(chat_template) and "tools" in chat_template and OPEN in chat_template


class ToolCall(dict):
    """One call as OpenAI returns it: {"id", "type": "function", "function": {"name", "arguments": JSON text}}."""

    @classmethod
    def of(cls, name: str, arguments: dict) -> ToolCall:
        return cls(id=f"call_{uuid.uuid4().hex[:24]}", type="function",
                   function={"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)})


def _call(block: str) -> ToolCall | None:
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # arguments written as JSON text: they must hold an object too
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return ToolCall.of(value["name"], arguments) if isinstance(arguments, dict) else None


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(the answer's own text or None, its calls) for a whole answer; (text, []) unless every block is a call."""
    start = text.find(OPEN)
    if start < 0:
        return text, []
    blocks = _BLOCK.findall(text, start)
    rest = _BLOCK.sub("", text[start:]).strip()
    calls = [_call(block) for block in blocks]
    if not calls or rest or any(call is None for call in calls):
        return text, []
    content = text[:start].rstrip()
    return content or None, calls


class ToolCallStream:
    """A streamed answer's text, held back from where a tool call may begin: `feed` each piece of text
    and send what it returns; `finish` gives the rest of the text and the calls."""

    def __init__(self):
        self.sent = 0  # characters of `text` handed out
        self.text = ""

    def feed(self, piece: str) -> str:
        self.text += piece
        start = self.text.find(OPEN, self.sent)
        if start >= 0:
            safe = start
        else:  # hold a tail that may be the beginning of OPEN
            safe = len(self.text)
            for size in range(min(len(OPEN) - 1, len(self.text) - self.sent), 0, -1):
                if OPEN.startswith(self.text[-size:]):
                    safe = len(self.text) - size
                    break
        safe = max(self.sent, len(self.text[:safe].rstrip()))  # whitespace before a block is not the answer's
        out, self.sent = self.text[self.sent : safe], safe
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(text not yet handed out, the calls): the held text comes out as text unless it was all calls."""
        content, calls = parse_tool_calls(self.text)
        if calls:
            held = (content or "")[self.sent :]
            return held, calls
        return self.text[self.sent :], []


def _call_schema(function: dict) -> dict:
    parameters = function.get("parameters") or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def call_grammar(functions: list[dict], parallel: bool = True) -> str:
    """xgrammar EBNF for an answer of tool calls only (one, or one or more when `parallel`) to `functions`
    ({"name", "parameters"} each), spelled as the Hermes template shows them: a `{"type": "grammar"}`
    response format."""
    import xgrammar as xgr

    schemas = [_call_schema(function) for function in functions]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    block = xgr.Grammar.concat(
        xgr.Grammar.from_ebnf(f'root ::= "{OPEN}\\n"'),
        xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": ")),
        xgr.Grammar.from_ebnf(f'root ::= "\\n{CLOSE}"'))
    calls = re.sub(r"\broot\b", "call", str(block))  # the block's rules, its root renamed
    repeat = ' ("\\n" call)*' if parallel else ""
    return f"root ::= call{repeat}\n{calls}"
