"""Spec strings for derived draft models and cascades (the factory hands these kinds over here).

    model:[NAME][,layers=L][,vocab=N][,int8=0|1] the draft model (default: the shipped 0.5B), keeping its
                                                first L layers, scoring only token ids < N, int8 linears
                                                (1) or the target's precision (0); by default a float32
                                                target drafts with an int8 draft (`draft_precision`)
    self[:layers=L][,vocab=N][,int8=1]           the target's own first L layers (default: a quarter of
                                                them) + final norm + head: self-speculation, weights shared
    cascade[:kind=vertical][,draft=NAME][,max_n=3][,inner_gamma=G]
                                                vertical: the draft model, its proposals drafted by an
                                                n-gram table (at most G at a time; default: all it can)
    cascade:kind=horizontal[,strong=2][,draft=NAME][,max_n=3]
                                                horizontal: the draft model for the first `strong`
                                                positions of each block, the n-gram table for the rest

Options are comma-separated name=value; an unknown or malformed option is an InvalidParameterError
that names it. Specs without commas (`self:layers=8`, `cascade:kind=horizontal`) also fit the
benchmark's comma-separated --methods list.
"""

from __future__ import annotations

from verispec.drafters.base import Drafter
from verispec.drafters.cascade import HorizontalCascadeDrafter, VerticalCascadeDrafter
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.ngram import NgramDrafter
from verispec.errors import InvalidParameterError
from verispec.models.int8 import int8_available
from verispec.models.loading import LoadedModel, ModelLoader, check_compatible, load_model
from verispec.models.registry import DEFAULT_DRAFT
from verispec.models.variants import derive_model

__all__ = ["SPEC_KINDS", "draft_model", "draft_precision", "is_derived_spec", "make_derived_drafter"]

SPEC_KINDS = ("self", "cascade")
VARIANT_OPTIONS = ("layers", "vocab", "int8")
CASCADE_OPTIONS = {"vertical": ("kind", "draft", "max_n", "inner_gamma"), "horizontal": ("kind", "draft", "max_n", "strong")}


def is_derived_spec(kind: str, rest: str) -> bool:
    """Whether `kind:rest` is a spec this module builds (model specs only when they carry options)."""
    return kind in SPEC_KINDS or (kind == "model" and "=" in rest)


def _parse(spec: str, text: str, allowed: tuple[str, ...], positional: bool = False) -> tuple[str | None, dict[str, str]]:
    """(leading name or None, {option: value}) from `NAME,opt=value,…`; refuses options not in `allowed`."""
    name, options = None, {}
    for index, item in enumerate(filter(None, (part.strip() for part in text.split(",")))):
        key, sep, value = item.partition("=")
        if not sep:
            if positional and index == 0:
                name = item
                continue
            raise InvalidParameterError(f"drafter option {item!r} in {spec!r} must look like name=value")
        key = key.strip()
        if key not in allowed:
            raise InvalidParameterError(f"unknown drafter option {key!r} in {spec!r}: use {', '.join(allowed)}")
        options[key] = value.strip()
    return name, options


def _integer(spec: str, options: dict[str, str], key: str, default: int | None = None) -> int | None:
    if key not in options:
        return default
    value = options[key]
    if not value.isdigit():
        raise InvalidParameterError(f"drafter option {key}={value!r} in {spec!r} must be a non-negative integer")
    return int(value)


def _derived(spec: str, model: LoadedModel, options: dict[str, str], default_layers: int | None = None) -> LoadedModel:
    layers, vocab = _integer(spec, options, "layers", default_layers), _integer(spec, options, "vocab")
    int8 = _integer(spec, options, "int8", 0)
    if int8 not in (0, 1):
        raise InvalidParameterError(f"drafter option int8 in {spec!r} must be 0 or 1, got {int8}")
    if layers is None and vocab is None and not int8:
        return model
    return derive_model(model, layers, vocab, bool(int8))


def draft_precision(target: LoadedModel) -> str:
    """The precision a draft model is loaded in unless a spec says otherwise: int8 for a float32 target
    (on the 2-core CPU the int8 0.5B drafts a token in ~56 ms against ~129 ms in float32, accepted as
    often: BENCHMARKS.md, "fp32, quiet machine, session 3"), else the target's own."""
    return "int8" if target.precision == "float32" and int8_available() else target.precision


def draft_model(name: str | None, target: LoadedModel, dtype: str | None, load: ModelLoader) -> LoadedModel:
    """The named draft model (default: the loader's, else the shipped one) in `dtype` (default:
    `draft_precision`), checked against the target's tokenizer."""
    draft = load(name or getattr(load, "default_draft", DEFAULT_DRAFT), dtype or draft_precision(target), pack_rows=1)
    check_compatible(target, draft)
    return draft


def _cascade(spec: str, rest: str, target: LoadedModel, dtype: str | None, load: ModelLoader) -> Drafter:
    kind = "vertical"
    for item in rest.split(","):
        key, _, value = item.partition("=")
        if key.strip() == "kind":
            kind = value.strip()
    if kind not in CASCADE_OPTIONS:
        raise InvalidParameterError(f"drafter option kind={kind!r} in {spec!r}: use kind=vertical or kind=horizontal")
    _, options = _parse(spec, rest, CASCADE_OPTIONS[kind])
    ngram = NgramDrafter(max_n=_integer(spec, options, "max_n", 3))
    draft = draft_model(options.get("draft"), target, dtype, load)
    if kind == "horizontal":
        strong = DraftModelDrafter(draft, target.vocab_size)
        return HorizontalCascadeDrafter(strong, ngram, _integer(spec, options, "strong", 2), target.vocab_size)
    return VerticalCascadeDrafter(draft, ngram, target.vocab_size, _integer(spec, options, "inner_gamma"))


def make_derived_drafter(
    kind: str, rest: str, target: LoadedModel, dtype: str | None = None, load: ModelLoader = load_model
) -> Drafter:
    """The drafter for a `self`, `cascade` or `model:…,option=…` spec (see the module docstring)."""
    spec = f"{kind}:{rest}" if rest else kind
    if kind == "cascade":
        return _cascade(spec, rest, target, dtype, load)
    if kind == "self":
        _, options = _parse(spec, rest, VARIANT_OPTIONS)
        draft = _derived(spec, target, options, default_layers=max(1, target.runner.config.num_layers // 4))
        return DraftModelDrafter(draft, target.vocab_size)
    if kind == "model":
        name, options = _parse(spec, rest, VARIANT_OPTIONS, positional=True)
        if options.get("int8") in ("0", "1"):  # 1: load it as int8 (cached once), not quantize a float copy
            dtype = "int8" if options["int8"] == "1" else target.precision
        draft = _derived(spec, draft_model(name, target, dtype, load), options)
        return DraftModelDrafter(draft, target.vocab_size)
    raise InvalidParameterError(f"unknown drafter kind {kind!r} in {spec!r}")
