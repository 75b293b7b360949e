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

Options are comma-separated name=value; an unknown or malformed option, or an integer outside its
range (`OPTION_RANGES`, shared by every drafter kind), is an InvalidParameterError that names it.
Specs without commas (`self:layers=8`, `cascade:kind=horizontal`) also fit the benchmark's
comma-separated --methods list.
"""

from __future__ import annotations

from verispec.drafters.base import Drafter
from verispec.drafters.cascade import HorizontalCascadeDrafter, VerticalCascadeDrafter
from verispec.drafters.cross_vocab import CrossVocabDrafter
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.ngram import NgramDrafter
from verispec.errors import InvalidParameterError
from verispec.models.int8 import int8_available
from verispec.models.loading import ModelLoader, check_compatible, load_model, tokenizer_problems
from verispec.models.registry import default_draft_for
from verispec.models.runner import LoadedModel
from verispec.models.variants import derive_model

__all__ = [
    "SPEC_KINDS", "MAX_GAMMA", "MAX_TREE_NODES", "OPTION_RANGES", "derived_options", "draft_model", "draft_precision", "integer_option",
    "is_derived_spec", "make_derived_drafter", "model_drafter", "tree_nodes",
]

MAX_GAMMA = 32  # the longest draft (γ) any option or request may ask for
MAX_TREE_NODES = 256  # draft tokens one token tree may hold (the target scores them all in one pass)
# Every integer drafter option, whatever the kind: (lowest, highest) accepted. The highs bound the work
# of one step (tree sizes, n-gram lengths, draft lengths) and the memory of one drafter (tables, caches).
OPTION_RANGES: dict[str, tuple[int, int]] = {
    "max_n": (1, 16), "min_n": (1, 16), "oldest": (0, 1), "min_match": (1, 16), "min_rate": (0, 100),
    "k": (1, 8), "depth": (1, 12), "wide": (0, 12), "nodes": (0, MAX_TREE_NODES),
    "rank": (1, 64), "buffer_size": (1, 1024), "steps": (1, 500), "eval_requests": (1, 64), "replay": (1, 16),
    "holdout": (0, 90), "support": (1, 1024), "self_layers": (1, 256),
    "budget": (1, 8192), "chunk": (1, 1024), "recent": (1, 8192), "sinks": (0, 256), "window": (1, 8192),
    "gamma1": (1, MAX_GAMMA), "gamma2": (0, MAX_GAMMA),
    "layers": (1, 256), "vocab": (1, 1 << 20), "int8": (0, 1), "strong": (1, MAX_GAMMA), "inner_gamma": (1, MAX_GAMMA),
}

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
        if key in OPTION_RANGES:  # checked now, before any model loads
            integer_option(spec, key, value)
    return name, options


def integer_option(spec: str, key: str, value: str) -> int:
    """`value` as an integer within OPTION_RANGES[key], or an InvalidParameterError naming the option."""
    value = value.strip()
    if not (value.isascii() and value.isdigit()):
        raise InvalidParameterError(f"drafter option {key}={value!r} in {spec!r} must be a non-negative integer")
    if key not in OPTION_RANGES:
        raise InvalidParameterError(f"drafter option {key!r} in {spec!r} has no accepted range (OPTION_RANGES)")
    low, high = OPTION_RANGES[key]
    number = int(value) if len(value) <= 12 else high + 1  # a longer number is out of range anyway
    if not low <= number <= high:
        raise InvalidParameterError(f"drafter option {key}={value[:20]} in {spec!r} is out of range: use {low}…{high}")
    return number


def tree_nodes(k: int, depth: int, wide: int) -> int:
    """Nodes of the token tree with k children at each of the first `wide` of `depth` levels, 1 below."""
    return sum(k ** min(level + 1, wide) for level in range(depth))


def _integer(spec: str, options: dict[str, str], key: str, default: int | None = None) -> int | None:
    return integer_option(spec, key, options[key]) if key in options else default


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
    (an int8 draft costs about half a float32 one per token and is accepted as often:
    BENCHMARKS.md#avx2-which-draft-model), else the target's own."""
    return "int8" if target.precision == "float32" and int8_available() else target.precision


def draft_model(
    name: str | None, target: LoadedModel, dtype: str | None, load: ModelLoader, same_tokenizer: bool = True
) -> LoadedModel:
    """The named draft model (default: the loader's, else the target's shipped default) in `dtype` (default:
    `draft_precision`), checked against the target's tokenizer unless `same_tokenizer` is False."""
    name = name or getattr(load, "default_draft", None) or default_draft_for(target.name)
    draft = load(name, dtype or draft_precision(target), pack_rows=1)
    if same_tokenizer:
        check_compatible(target, draft)
    return draft


def model_drafter(name: str | None, target: LoadedModel, dtype: str | None, load: ModelLoader) -> Drafter:
    """A plain draft model: in the target's token ids when it shares its tokenizer, else through the
    committed text and the shared vocabulary (`cross_vocab`)."""
    draft = draft_model(name, target, dtype, load, same_tokenizer=False)
    if tokenizer_problems(target, draft):
        return CrossVocabDrafter(draft, target)
    return DraftModelDrafter(draft, target.vocab_size)


def _cascade_kind(spec: str, rest: str) -> str:
    kind = "vertical"
    for item in rest.split(","):
        key, _, value = item.partition("=")
        if key.strip() == "kind":
            kind = value.strip()
    if kind not in CASCADE_OPTIONS:
        raise InvalidParameterError(f"drafter option kind={kind!r} in {spec!r}: use kind=vertical or kind=horizontal")
    return kind


def derived_options(kind: str, rest: str) -> tuple[str | None, dict[str, str]]:
    """(the model a `model:` spec names, else the cascade's kind or None; the options) of `kind:rest`, every
    option known to its kind and within its range. Loads nothing (see the module docstring)."""
    spec = f"{kind}:{rest}" if rest else kind
    if kind == "cascade":
        cascade = _cascade_kind(spec, rest)
        return cascade, _parse(spec, rest, CASCADE_OPTIONS[cascade])[1]
    if kind in ("self", "model"):
        return _parse(spec, rest, VARIANT_OPTIONS, positional=kind == "model")
    raise InvalidParameterError(f"unknown drafter kind {kind!r} in {spec!r}")


def _cascade(spec: str, kind: str, options: dict[str, str], target: LoadedModel, dtype: str | None,
             load: ModelLoader) -> Drafter:
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
    name, options = derived_options(kind, rest)
    if kind == "cascade":
        return _cascade(spec, name, options, target, dtype, load)
    if kind == "self":
        draft = _derived(spec, target, options, default_layers=max(1, target.runner.config.num_layers // 4))
        return DraftModelDrafter(draft, target.vocab_size)
    if options.get("int8") in ("0", "1"):  # model: 1: load it as int8 (cached once), not quantize a float copy
        dtype = "int8" if options["int8"] == "1" else target.precision
    draft = _derived(spec, draft_model(name, target, dtype, load), options)
    return DraftModelDrafter(draft, target.vocab_size)
