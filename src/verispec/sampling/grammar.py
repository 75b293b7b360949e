"""Grammar-constrained decoding (`response_format`): a mask of allowed tokens per verified position.

A `Constraint` wraps an xgrammar `GrammarMatcher` that has accepted the committed output so far.
For one verification pass it gives the mask of every row (`masks(draft)`: row i is what the grammar
allows after the committed text plus draft[:i]), rolls the matcher back, and is then advanced by the
tokens actually emitted (`advance`). The engine sets the target's forbidden logits to −inf before
the verifier, so a forbidden draft token has target probability 0 and is rejected; the rejection rule
is exact for any draft distribution, so the output follows the *constrained* target distribution
(softmax of the masked logits, then the usual processors) exactly — greedy token for token, sampled
in distribution — whatever the drafter proposes. Drafts themselves are not masked. A token tree is
masked node by node (each node's row: the grammar after the path to it), so tree verification,
exact for any target distribution, stays exact for the masked one.

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
    return InvalidParameterError(f"response_format: {message}", param="response_format")


def _texts(value, path: str = "") -> Iterable[tuple[str, str]]:
    """(where, text) for every string in `value`, each key before its value; `where` is a dotted path
    ("json_schema.schema.enum.1") or the object a key is in ("a key in json_schema.schema.properties")."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield f"a key in {path or 'the object'}", key
            yield from _texts(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _texts(item, f"{path}.{index}")


def _check_unicode(response_format: dict) -> None:
    """Refuse a lone surrogate ("\\ud800", valid as a JSON escape) in any key or string: xgrammar fails on it."""
    for where, text in _texts(response_format):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise _invalid(f"{where} contains a lone surrogate {ascii(text[error.start])} at character {error.start}: "
                           "send valid Unicode text") from None


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
    _check_unicode(response_format)


def _compiler(tokenizer, width: int, stop_ids: tuple[int, ...]):
    """One xgrammar compiler per tokenizer, logits width and stop tokens (it caches compiled grammars)."""
    import xgrammar as xgr

    per_tokenizer = _compilers.setdefault(tokenizer, {})
    key = (width, stop_ids)
    if key not in per_tokenizer:
        vocab = max(width, len(tokenizer))  # logits rows past the tokenizer's vocabulary are never allowed
        if not stop_ids:  # a model without EOS: xgrammar wants a stop token, so one past the logits, never allowed
            vocab, stop_ids = vocab + 1, (vocab,)
        hf = getattr(tokenizer, "hf", tokenizer)  # xgrammar reads a transformers tokenizer (`models/tokenizer.py`)
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=list(stop_ids))
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

    def masks(self, draft_tokens: Sequence[int], parents: Sequence[int] | None = None) -> torch.Tensor:
        """bool [n+1, width]: row 0 allows what may follow the committed text, row i+1 what may follow
        it plus the path to draft node i (a chain when `parents` is None: node i follows node i−1).

        Rows of nodes the grammar forbids (or that follow a stop token), and of their descendants, are
        all True: the verifier rejects such a node (its target probability is 0), so they are never used.
        """
        n = len(draft_tokens)
        parents = list(range(-1, n - 1)) if parents is None else [int(p) for p in parents]
        masks = torch.ones(n + 1, self.width, dtype=torch.bool)  # [n+1, width]
        masks[0] = self._allowed()
        paths: list[list[int] | None] = [None] * n  # node -> the nodes from the root to it, if the grammar allows them
        held: list[int] = []  # the path the matcher has accepted now
        for node, parent in enumerate(parents):  # topological order: a parent comes before its children
            if parent >= 0 and paths[parent] is None or not masks[parent + 1, int(draft_tokens[node])]:
                continue  # the matcher is not asked (it logs a warning for every special token it refuses)
            held = self._move(held, paths[parent] if parent >= 0 else [], draft_tokens)
            if not self.matcher.accept_token(int(draft_tokens[node])):
                continue
            held = paths[node] = held + [node]
            if not self.matcher.is_terminated():
                masks[node + 1] = self._allowed()
        if held:
            self.matcher.rollback(len(held))
        return masks

    def _move(self, held: list[int], path: list[int], draft_tokens: Sequence[int]) -> list[int]:
        """Roll the matcher back from the accepted path `held` to its common part with `path`, then accept
        the rest of `path` (allowed: it was accepted before). Returns `path`."""
        common = 0
        while common < min(len(held), len(path)) and held[common] == path[common]:
            common += 1
        if len(held) > common:
            self.matcher.rollback(len(held) - common)
        for node in path[common:]:
            self.matcher.accept_token(int(draft_tokens[node]))
        return path

    def advance(self, tokens: Iterable[int]) -> None:
        """Accept the emitted tokens (up to a stop token; later ones are never output)."""
        for token in tokens:
            if self.matcher.is_terminated():
                return
            if not self.matcher.accept_token(int(token)):
                raise RuntimeError(f"token {token} was emitted although the grammar forbids it")
