"""Grammar-constrained decoding (`response_format`): a mask of allowed tokens per verified position.

A `Constraint` wraps an xgrammar `GrammarMatcher` that has accepted the committed output so far.
For one verification pass it gives the mask of every row (`masks(draft)`: row i is what the grammar
allows after the committed text plus draft[:i]), rolls the matcher back, and is then advanced by the
tokens actually emitted (`advance`). The engine sets the target's forbidden logits to −inf before
the verifier, so a forbidden draft token has target probability 0 and is rejected; the rejection rule
is exact for any draft distribution, so the output follows the *constrained* target distribution
(softmax of the masked logits, then the usual processors) exactly — greedy token for token, sampled
in distribution — whatever the drafter proposes. Drafts themselves are not masked.

Formats (OpenAI's `response_format`): `{"type": "text"}` (no constraint), `{"type": "json_object"}`
(any JSON value), `{"type": "json_schema", "json_schema": {"schema": {...}}}`; and, from the Python
API, `{"type": "grammar", "grammar": EBNF}` (xgrammar's EBNF dialect).
"""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Iterable, Sequence

import torch

from verispec.errors import InvalidParameterError

__all__ = ["Constraint", "check_response_format", "FORMAT_TYPES"]

FORMAT_TYPES = ("text", "json_object", "json_schema", "grammar")
COMPILE_CACHE_BYTES = 64 << 20  # compiled grammars kept per tokenizer (a server sees many schemas)
MAX_FORMAT_CHARS = 64 << 10  # a schema or grammar larger than this is refused (compiling is not free)
_compilers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {(width, stops): GrammarCompiler}


def _invalid(message: str) -> InvalidParameterError:
    error = InvalidParameterError(f"response_format: {message}")
    error.param = "response_format"  # the field a server names in its 400
    return error


def check_response_format(response_format: dict | None) -> None:
    """Refuse a malformed `response_format` up front (the grammar itself is compiled per request)."""
    if response_format is None:
        return
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind not in FORMAT_TYPES:
        raise _invalid(f"type must be one of {', '.join(FORMAT_TYPES)}, got {kind!r}")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise _invalid('json_schema needs {"json_schema": {"schema": {...}}} with the schema as an object')
    if kind == "grammar" and not isinstance(response_format.get("grammar"), str):
        raise _invalid('grammar needs {"grammar": "<EBNF>"}')
    try:
        size = len(json.dumps(response_format))
    except (TypeError, ValueError) as error:
        raise _invalid(f"must be plain JSON data ({error})") from None
    if size > MAX_FORMAT_CHARS:
        raise _invalid(f"larger than {MAX_FORMAT_CHARS} characters: send a smaller schema")


def _compiler(tokenizer, width: int, stop_ids: tuple[int, ...]):
    """One xgrammar compiler per tokenizer, logits width and stop tokens (it caches compiled grammars)."""
    import xgrammar as xgr

    per_tokenizer = _compilers.setdefault(tokenizer, {})
    key = (width, stop_ids)
    if key not in per_tokenizer:
        vocab = max(width, len(tokenizer))  # logits rows past the tokenizer's vocabulary are never allowed
        if not stop_ids:  # a model without EOS: xgrammar wants a stop token, so one past the logits, never allowed
            vocab, stop_ids = vocab + 1, (vocab,)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=list(stop_ids))
        per_tokenizer[key] = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=COMPILE_CACHE_BYTES)
    return per_tokenizer[key]


def _compile(compiler, response_format: dict):
    kind = response_format["type"]
    try:
        if kind == "json_object":
            return compiler.compile_builtin_json_grammar()
        if kind == "json_schema":
            return compiler.compile_json_schema(json.dumps(response_format["json_schema"]["schema"]))
        return compiler.compile_grammar(response_format["grammar"])
    except Exception as error:  # noqa: BLE001 — whatever xgrammar raises for a schema or grammar it cannot compile
        reason = re.sub(r"^\[[^\]]*\] \S+:\d+: ", "", str(error).strip())  # without xgrammar's "[time] file.cc:line: "
        raise _invalid(f"cannot compile the {kind}: {reason}") from None


class Constraint:
    """The grammar state of one generation: masks for a verification pass, advanced by emitted tokens."""

    def __init__(self, compiled, width: int):
        import xgrammar as xgr

        self.width = width
        self.matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)  # [1, ⌈vocab/32⌉] int32
        self._bits = torch.arange(32, dtype=torch.int32)

    @classmethod
    def from_response_format(cls, response_format: dict | None, tokenizer, width: int, stop_ids: Iterable[int]) -> Constraint | None:
        """The constraint `response_format` asks for (None for text), over logits `width` columns wide."""
        check_response_format(response_format)
        if response_format is None or response_format["type"] == "text":
            return None
        compiler = _compiler(tokenizer, width, tuple(sorted(stop_ids)))
        return cls(_compile(compiler, response_format), width)

    @property
    def terminated(self) -> bool:
        """The grammar accepted a stop token: nothing more may follow."""
        return self.matcher.is_terminated()

    def _allowed(self) -> torch.Tensor:
        """The matcher's allowed tokens now: bool [width]."""
        self.matcher.fill_next_token_bitmask(self._bitmask)
        bits = (self._bitmask[0, :, None] >> self._bits) & 1  # [⌈vocab/32⌉, 32], bit j of word w: token 32w + j
        allowed = bits.flatten()[: self.width].bool()
        if allowed.shape[0] < self.width:  # never reached: the compiler's vocabulary covers the width
            allowed = torch.cat([allowed, torch.zeros(self.width - allowed.shape[0], dtype=torch.bool)])
        if not allowed.any():
            raise _invalid("the grammar allows no token of this model's vocabulary here")
        return allowed

    def masks(self, draft_tokens: Sequence[int]) -> torch.Tensor:
        """bool [n+1, width]: row i allows what may follow the committed text + draft[:i].

        Rows after a draft token the grammar forbids (or after a stop token) are all True: the
        verifier rejects that token (its target probability is 0), so those rows are never used.
        """
        masks = torch.ones(len(draft_tokens) + 1, self.width, dtype=torch.bool)  # [n+1, width]
        accepted = 0
        for i in range(len(draft_tokens) + 1):
            masks[i] = self._allowed()
            if i == len(draft_tokens) or not self.matcher.accept_token(int(draft_tokens[i])):
                break
            accepted += 1
            if self.matcher.is_terminated():
                break
        if accepted:
            self.matcher.rollback(accepted)
        return masks

    def advance(self, tokens: Iterable[int]) -> None:
        """Accept the emitted tokens (up to a stop token; later ones are never output)."""
        for token in tokens:
            if self.matcher.is_terminated():
                return
            if not self.matcher.accept_token(int(token)):
                raise RuntimeError(f"token {token} was emitted although the grammar forbids it")
