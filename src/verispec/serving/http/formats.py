"""Turn a generation's tokens and statistics into OpenAI-shaped bodies and SSE chunks.

`CompletionFormat` (text_completion) and `ChatFormat` (chat.completion[.chunk]) share one interface,
so the request handler streams or collects without knowing which endpoint it serves. A request's
`n` choices share one format's id; `for_choice(i)` gives choice i its own (its index, its text offsets, its
tool-call parser). Streamed
token chunks carry two extras the playground reads: the token's `origin` on the choice and the
request's live `speculative` statistics at the top level. The finishing chunk carries `usage`; with
`stream_options.include_usage` a last chunk follows with empty `choices` and the `usage`, as OpenAI's.

Log-probabilities (when the request asked): completions use OpenAI's legacy shape (`tokens`,
`token_logprobs`, `top_logprobs` as {token: logprob}, `text_offset`), chat its `content` list of
{token, logprob, bytes, top_logprobs}; a token's string is the tokenizer's decoding of that id alone.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
import time
import uuid

from verispec.serving.tool_calls import ToolCallStream, parse_tool_calls
from verispec.types import GenerationStats, TokenEvent, TokenLogprobs

__all__ = ["CompletionFormat", "ChatFormat", "Echo", "usage", "sse", "merged_stats"]


def sse(body: dict | str) -> str:
    """One server-sent event: `data: {...}` and a blank line."""
    return f"data: {body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)}\n\n"


def usage(stats: GenerationStats) -> dict:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.new_tokens,
        "total_tokens": stats.prompt_tokens + stats.new_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},  # OpenAI's field: prompt caching
        "steps": stats.steps,
        "mean_accepted_length": round(stats.mean_accepted_length, 4),
        "acceptance_rate": round(stats.acceptance_rate, 4),
        "per_position_acceptance": [round(x, 4) for x in stats.per_position_acceptance],
    }


@dataclass(frozen=True)
class Echo:
    """A prompt echoed before its answer (completions' `echo`): its text, ids and, when asked for, each token's
    log-probabilities (the first: None)."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None


def _call_finish(finish_reason: str) -> str:
    """An answer that ends in calls finishes with "tool_calls" (one cut by its length stays "length")."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def merged_stats(stats: list[GenerationStats], n: int = 1) -> GenerationStats:
    """One request's statistics over its answers (`n` choices of each prompt, in order): each prompt counted once,
    the new tokens and steps of all."""
    firsts = stats[::n]  # the first choice of each prompt
    total = GenerationStats(prompt_tokens=sum(s.prompt_tokens for s in firsts), cached_tokens=sum(s.cached_tokens for s in firsts))
    for part in stats:
        total.new_tokens += part.new_tokens
        for record in part.records:
            total.record(record)
    return total


class CompletionFormat:
    object_name, chunk_name, id_prefix = "text_completion", "text_completion", "cmpl"

    def __init__(self, model: str, tokenizer=None):
        self.model, self.tokenizer = model, tokenizer
        # the request asked for log-probabilities (set once it is checked): a whole answer then carries its
        # `logprobs` object even when it holds no token (an answer that ended at once), not null
        self.with_logprobs = False
        self.index = 0  # the choice this format writes
        self._start()
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())

    def for_choice(self, index: int) -> CompletionFormat:
        """The format of choice `index` of the same response (same id and creation time)."""
        choice = copy.copy(self)
        choice.index = index
        choice._start()
        return choice

    def _start(self) -> None:
        """Forget what an earlier choice wrote."""
        self._offset = 0  # characters of the token strings given out so far (completions' text_offset)

    def _envelope(self, name: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": name, "created": self.created, "model": self.model, "choices": choices, **extra}

    def _content(self, text: str) -> dict:
        return {"text": text}

    def opening_chunks(self) -> list[dict]:
        return []

    def token_chunk(self, event: TokenEvent, live: dict | None) -> dict:
        choice = {"index": self.index, **self._content(self._streamed(event.text)), "finish_reason": None,
                  "origin": event.origin.value, "token_id": event.token_id}
        if event.logprobs is not None:
            choice["logprobs"] = self.logprobs([(event.token_id, event.logprobs)])
        return self._envelope(self.chunk_name, [choice], speculative=live)

    def _streamed(self, text: str) -> str:
        """What of a token's text a streamed chunk carries now."""
        return text

    def final_chunk(self, finish_reason: str, stats: GenerationStats) -> dict:
        choice = {"index": self.index, **self._content(""), "finish_reason": finish_reason}
        return self._envelope(self.chunk_name, [choice], usage=usage(stats))

    def usage_chunk(self, stats: GenerationStats) -> dict:
        return self._envelope(self.chunk_name, [], usage=usage(stats))

    def choice(self, events: list[TokenEvent], finish_reason: str, echo: Echo | None = None) -> dict:
        """This choice of a whole (not streamed) response; with `echo`, the prompt comes first (its text, and its
        tokens' log-probabilities before the answer's when they were asked for)."""
        text = "".join(event.text for event in events)
        scored = [(event.token_id, event.logprobs) for event in events if event.logprobs is not None]
        if echo is not None:
            text = echo.text + text
            if echo.logprobs is not None:
                scored = list(zip(echo.token_ids, echo.logprobs)) + scored
        return {"index": self.index, **self._final_content(text), "finish_reason": finish_reason,
                "logprobs": self.logprobs(scored) if scored or self.with_logprobs else None,
                "origins": [event.origin.value for event in events]}

    def response(self, choices: list[dict], stats: GenerationStats) -> dict:
        """The whole response: its `choices` (each from `choice`) and the request's statistics."""
        return self._envelope(self.object_name, choices, usage=usage(stats))

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    def logprobs(self, scored: list[tuple[int, TokenLogprobs | None]]) -> dict:
        """The legacy completions shape for these (token id, its log-probabilities) pairs (text_offset continues
        across calls; an echoed prompt's first token has none: null)."""
        tokens = [self._token(token_id) for token_id, _ in scored]
        offsets = []
        for token in tokens:
            offsets.append(self._offset)
            self._offset += len(token)
        return {"tokens": tokens, "token_logprobs": [None if lp is None else lp.logprob for _, lp in scored],
                "top_logprobs": [None if lp is None else self._top(lp) for _, lp in scored], "text_offset": offsets}

    def _top(self, scored: TokenLogprobs) -> dict[str, float]:
        return {self._token(token): value for token, value in scored.top}

    def _final_content(self, text: str) -> dict:
        return {"text": text}


class ChatFormat(CompletionFormat):
    """tools: the answer may hold tool calls (`verispec.serving.tool_calls`): a whole answer's are parsed out of
    its text, a streamed one's text is held from where a call may begin and its calls come with the last chunk."""

    object_name, chunk_name, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def __init__(self, model: str, tokenizer=None, tools: bool = False):
        self.tools = tools
        super().__init__(model, tokenizer)

    def _start(self) -> None:
        super()._start()
        self._calls = ToolCallStream() if self.tools else None

    def _streamed(self, text: str) -> str:
        return text if self._calls is None else self._calls.feed(text)

    def final_chunk(self, finish_reason: str, stats: GenerationStats) -> dict:
        if self._calls is None:
            return super().final_chunk(finish_reason, stats)
        rest, calls = self._calls.finish()
        delta = {"content": rest} if rest else {}
        if calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
            finish_reason = _call_finish(finish_reason)
        choice = {"index": self.index, "delta": delta, "finish_reason": finish_reason}
        return self._envelope(self.chunk_name, [choice], usage=usage(stats))

    def choice(self, events: list[TokenEvent], finish_reason: str, echo: Echo | None = None) -> dict:
        choice = super().choice(events, finish_reason, echo)
        if self.tools:
            content, calls = parse_tool_calls(choice["message"]["content"])
            if calls:
                choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
                choice["finish_reason"] = _call_finish(finish_reason)
        return choice

    def _content(self, text: str) -> dict:
        return {"delta": {"content": text} if text else {}}

    def opening_chunks(self) -> list[dict]:
        return [self._envelope(self.chunk_name, [{"index": self.index, "delta": {"role": "assistant", "content": ""},
                                                  "finish_reason": None}])]

    def _final_content(self, text: str) -> dict:
        return {"message": {"role": "assistant", "content": text}}

    def _entry(self, token_id: int, logprob: float) -> dict:
        token = self._token(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    def logprobs(self, scored: list[tuple[int, TokenLogprobs]]) -> dict:
        """OpenAI's chat shape: one `content` entry per token, with its top alternatives."""
        content = [{**self._entry(token_id, lp.logprob), "top_logprobs": [self._entry(token, value) for token, value in lp.top]}
                   for token_id, lp in scored]
        return {"content": content, "refusal": None}
