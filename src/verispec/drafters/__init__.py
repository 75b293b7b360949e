"""Drafters and the one factory that turns a spec string into one.

Specs: `none`; `model` (the default draft model) or `model:NAME_OR_PATH`, or a model name/path alone;
`ngram` or `ngram:max_n=4,min_n=1` (prompt lookup); `triforce` or `triforce:budget=512,chunk=32,…`
(long prompts: the default draft model with a StreamingLLM cache → the target over retrieved KV
chunks → the target; see `drafters/triforce.py` for every option).
"""

from __future__ import annotations

from verispec.drafters.base import Drafter, DraftSession
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.ngram import NgramDrafter
from verispec.errors import InvalidParameterError
from verispec.models.loading import LoadedModel, check_compatible, load_model
from verispec.models.registry import DEFAULT_DRAFT

__all__ = ["Drafter", "DraftSession", "DraftModelDrafter", "NgramDrafter", "make_drafter", "DRAFTER_KINDS"]

DRAFTER_KINDS = ("none", "model", "ngram", "triforce")


def _options(text: str) -> dict[str, int]:
    options = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not value.strip().isdigit():
            raise InvalidParameterError(f"drafter option {item!r} must look like name=integer")
        options[key.strip()] = int(value)
    return options


def make_drafter(spec: str | None, target: LoadedModel, dtype: str | None = None) -> Drafter | None:
    """A drafter for `target` from a spec string; None for plain decoding."""
    spec = (spec or "none").strip()
    kind, _, rest = spec.partition(":")
    if kind == "none":
        return None
    if kind == "ngram":
        try:
            return NgramDrafter(**_options(rest))
        except TypeError as e:
            raise InvalidParameterError(f"bad ngram drafter options {rest!r}: use max_n=…, min_n=…") from e
    if kind == "triforce":
        from verispec.drafters.triforce import make_triforce

        options = _options(rest)
        draft = load_model(DEFAULT_DRAFT, dtype or target.dtype)
        check_compatible(target, draft)
        return make_triforce(target, draft, options)
    model_spec = (rest or DEFAULT_DRAFT) if kind == "model" else spec
    draft = load_model(model_spec, dtype or target.dtype)
    check_compatible(target, draft)
    return DraftModelDrafter(draft, target.vocab_size)
