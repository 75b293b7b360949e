"""Drafters and the one factory that turns a spec string into one.

Specs: `none`; `model` (the default draft model) or `model:NAME_OR_PATH`, or a model name/path alone;
`ngram` or `ngram:max_n=4,min_n=1` (prompt lookup); derived drafts `model:NAME,layers=L,vocab=N,int8=1`
and `self:layers=L` (the target's first L layers), and cascades `cascade` (vertical) or
`cascade:kind=horizontal,strong=2` — see `verispec.drafters.specs`.
"""

from __future__ import annotations

from verispec.drafters.base import Drafter, DraftSession
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.ngram import NgramDrafter
from verispec.drafters.specs import SPEC_KINDS, is_derived_spec, make_derived_drafter
from verispec.errors import InvalidParameterError
from verispec.models.loading import LoadedModel, check_compatible, load_model
from verispec.models.registry import DEFAULT_DRAFT

__all__ = ["Drafter", "DraftSession", "DraftModelDrafter", "NgramDrafter", "make_drafter", "DRAFTER_KINDS"]

DRAFTER_KINDS = ("none", "model", "ngram", *SPEC_KINDS)


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
    if is_derived_spec(kind, rest):
        return make_derived_drafter(kind, rest, target, dtype)
    if kind == "ngram":
        try:
            return NgramDrafter(**_options(rest))
        except TypeError as e:
            raise InvalidParameterError(f"bad ngram drafter options {rest!r}: use max_n=…, min_n=…") from e
    model_spec = (rest or DEFAULT_DRAFT) if kind == "model" else spec
    draft = load_model(model_spec, dtype or target.dtype)
    check_compatible(target, draft)
    return DraftModelDrafter(draft, target.vocab_size)
