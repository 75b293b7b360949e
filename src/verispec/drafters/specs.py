"""Drafter spec strings, parsed once into a `DrafterSpec` (the syntax of each kind: `verispec.drafters`).

    KIND[:NAME][,option=value,…]     e.g. ngram:max_n=4 · tree:k=3,depth=4 · model:NAME,layers=8 · some/folder

`DrafterSpec.parse` checks every option while it parses, and loads nothing: the option is known to its
kind, an integer within its range (`OPTION_RANGES`, one range per option name whatever the kind), in
order with its partner (`ORDERED`), and a tree holds at most `MAX_TREE_NODES` nodes. So a typo or an
unbounded option fails before any model loads: `make_drafter` builds from the parsed spec, and a server
parses a request's spec in its handler, before the request is queued. Names of models are checked when
the drafter is built (the loader knows what it holds).

A drafter kind's options are its factory's keyword arguments (`FACTORIES`, less `NOT_OPTIONS`), with
their defaults; a derived draft model's (`model:…`, `self`) are `VARIANT_OPTIONS`, a cascade's
`CASCADE_OPTIONS`. Specs without commas (`self:layers=8`, `cascade:kind=horizontal`) also fit the
benchmark's comma-separated --methods list.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from verispec.drafters.branching import MAX_TREE_NODES
from verispec.drafters.hybrid import HybridDrafter
from verispec.drafters.ngram import NgramDrafter
from verispec.drafters.online import OnlineDrafter
from verispec.drafters.stand import StandDrafter
from verispec.drafters.tree import ExpansionDrafter, MergeDrafter
from verispec.drafters.triforce import TriForceDrafter
from verispec.errors import InvalidParameterError

__all__ = [
    "CASCADE_OPTIONS", "DRAFTER_KINDS", "DrafterSpec", "FACTORIES", "KIND_OPTIONS", "MAX_GAMMA", "MAX_TREE_NODES",
    "NOT_OPTIONS", "OPTION_RANGES", "ORDERED", "VARIANT_OPTIONS", "split_specs", "tree_nodes",
]

MAX_GAMMA = 32  # the longest draft (γ) any option or request may ask for
# Every integer drafter option, whatever the kind: (lowest, highest) accepted. The highs bound the work
# of one step (tree sizes, n-gram lengths, draft lengths) and the memory of one drafter (tables, caches).
OPTION_RANGES: dict[str, tuple[int, int]] = {
    "max_n": (1, 16), "min_n": (1, 16), "oldest": (0, 1), "hints": (0, 1), "min_match": (1, 16), "min_rate": (0, 100),
    "k": (1, 8), "depth": (1, 12), "wide": (0, 12), "nodes": (0, MAX_TREE_NODES), "table_nodes": (1, MAX_TREE_NODES),
    "rank": (1, 64), "buffer_size": (1, 1024), "steps": (1, 500), "eval_requests": (1, 64), "replay": (1, 16),
    "holdout": (0, 90), "support": (1, 1024), "self_layers": (1, 256),
    "budget": (1, 8192), "chunk": (1, 1024), "recent": (1, 8192), "sinks": (0, 256), "window": (1, 8192),
    "gamma1": (1, MAX_GAMMA), "gamma2": (0, MAX_GAMMA),
    "layers": (1, 256), "vocab": (1, 1 << 20), "int8": (0, 1), "strong": (1, MAX_GAMMA), "inner_gamma": (1, MAX_GAMMA),
}
ORDERED = (("min_n", "max_n"), ("wide", "depth"), ("chunk", "budget"))  # the first may not exceed the second

# the kinds whose options are their factory's keyword arguments; these arguments are not options
FACTORIES: dict[str, Callable] = {
    "ngram": NgramDrafter, "tree": ExpansionDrafter, "merge": MergeDrafter.model_and_ngram, "lookup": MergeDrafter.lookup,
    "stand": StandDrafter, "hybrid": HybridDrafter, "online": OnlineDrafter, "triforce": TriForceDrafter,
}
NOT_OPTIONS = frozenset({"self", "model", "model_drafter", "target", "draft", "target_vocab_size", "vocab_size", "table",
                         "paths", "lr", "tolerance", "store"})
VARIANT_OPTIONS = ("layers", "vocab", "int8")  # a derived draft model: model:[NAME,]… and self:…
# a cascade's options by its kind; `kind` and `draft` (a model name) are its only options that are not integers
CASCADE_OPTIONS = {"vertical": ("kind", "draft", "max_n", "inner_gamma"), "horizontal": ("kind", "draft", "max_n", "strong")}
DRAFTER_KINDS = ("none", "model", "gguf", *FACTORIES, "self", "cascade")


def _factory_options(factory: Callable) -> dict[str, int | None]:
    return {name: p.default for name, p in inspect.signature(factory).parameters.items() if name not in NOT_OPTIONS}


# {kind: {option: its default, None when it has none}} for every kind that takes `name=integer` options
KIND_OPTIONS: dict[str, dict[str, int | None]] = {
    **{kind: _factory_options(factory) for kind, factory in FACTORIES.items()},
    "self": dict.fromkeys(VARIANT_OPTIONS), "model": dict.fromkeys(VARIANT_OPTIONS),
}
KIND_OPTIONS["online"]["self_layers"] = None  # distil the target's own first layers instead of the draft model
KIND_OPTIONS["hybrid"]["vocab"] = None  # its draft model's head scores only ids < vocab (`models/variants.reduced_vocab`)
NAMED_DRAFT = ("hybrid",)  # kinds that take `draft=NAME` (any model, of the target's tokenizer or not) besides their options


def split_specs(text: str | None) -> list[str]:
    """A comma-separated list of drafter specs (each perhaps with `@POLICY`), split at the commas that begin a
    new spec rather than another option (`name=value`): "none,lookup:nodes=16,table_nodes=8@12" is two."""
    return [item.strip() for item in re.split(r",(?!\s*\w+\s*=)", text or "") if item.strip()]


def tree_nodes(k: int, depth: int, wide: int) -> int:
    """Nodes of the token tree with k children at each of the first `wide` of `depth` levels, 1 below."""
    return sum(k ** min(level + 1, wide) for level in range(depth))


@dataclass(frozen=True)
class DrafterSpec:
    """A drafter spec, parsed and checked (`parse`).

    kind: one of DRAFTER_KINDS (a bare model name or path is a `model` spec naming it). name: the draft
    model it names (`model:NAME`, `gguf:NAME`, a bare name, a cascade's `draft=NAME`); None: the
    default draft. options: its integer options as given (defaults are the factory's). cascade: a
    cascade's kind, vertical or horizontal. text: the spec as written, for messages.
    """

    kind: str = "none"
    name: str | None = None
    options: Mapping[str, int] = field(default_factory=dict)
    cascade: str | None = None
    text: str = "none"

    @classmethod
    def parse(cls, spec: str | None) -> DrafterSpec:
        """`spec` (None: "none") parsed, every option checked as the module docstring says; loads nothing.
        Raises InvalidParameterError naming the option and the spec."""
        text = (spec or "none").strip()
        kind, _, rest = text.partition(":")
        if kind == "none":
            return cls(text=text)
        if kind == "gguf":
            return cls("gguf", rest or None, text=text)
        if kind not in KIND_OPTIONS and kind != "cascade":
            return cls("model", text, text=text)  # a draft model's name or path
        cascade = _cascade_kind(text, rest) if kind == "cascade" else None
        allowed = CASCADE_OPTIONS[cascade] if cascade else tuple(KIND_OPTIONS[kind]) + (("draft",) if kind in NAMED_DRAFT else ())
        name, options = _options(kind, rest, text, allowed)
        parsed = cls(kind, name, options, cascade, text)
        parsed._check_order_and_size()
        return parsed

    @property
    def derived(self) -> bool:
        """Built by `verispec.drafters.derived`: a `self` or `cascade` spec, or a model spec with options."""
        return self.kind in ("self", "cascade") or (self.kind == "model" and bool(self.options))

    def _check_order_and_size(self) -> None:
        values = {**KIND_OPTIONS.get(self.kind, {}), **self.options}  # the factory's defaults filled in
        for low, high in ORDERED:
            if values.get(low) is not None and values.get(high) is not None and values[low] > values[high]:
                raise InvalidParameterError(f"drafter spec {self.text!r}: {low} must not exceed {high}, "
                                            f"got {low}={values[low]} and {high}={values[high]}")
        if (nodes := (values.get("nodes") or 0) + (values.get("table_nodes") or 0)) > MAX_TREE_NODES:  # a merged tree
            raise InvalidParameterError(f"drafter spec {self.text!r}: its trees hold {nodes} nodes, more than {MAX_TREE_NODES}")
        if {"k", "depth", "wide"} <= set(values) and not values.get("nodes"):
            k, depth, wide = values["k"], values["depth"], values["wide"]
            if (nodes := tree_nodes(k, depth, wide)) > MAX_TREE_NODES:
                raise InvalidParameterError(f"drafter spec {self.text!r}: a tree of k={k}, depth={depth}, wide={wide} holds "
                                            f"{nodes} nodes, more than {MAX_TREE_NODES}: lower k, depth or wide")


def _cascade_kind(text: str, rest: str) -> str:
    kinds = [value.strip() for key, _, value in (item.partition("=") for item in rest.split(",")) if key.strip() == "kind"]
    kind = kinds[-1] if kinds else "vertical"
    if kind not in CASCADE_OPTIONS:
        raise InvalidParameterError(f"drafter option kind={kind!r} in {text!r}: use kind=vertical or kind=horizontal")
    return kind


def _options(kind: str, rest: str, text: str, allowed: tuple[str, ...]) -> tuple[str | None, dict[str, int]]:
    """(the model named, {option: value}) of `rest`: a leading model name (model specs only) or `draft=NAME`
    (cascades, `NAMED_DRAFT` kinds), then `name=integer` options of `allowed`, each within its range."""
    name, options = None, {}
    for index, item in enumerate(filter(None, (part.strip() for part in rest.split(",")))):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep and kind == "model" and index == 0:
            name = item
            continue
        if not sep:
            raise InvalidParameterError(f"drafter option {item!r} in {text!r} must look like name=value")
        if key not in allowed:
            owner = f"{kind} drafter" if kind in FACTORIES else "drafter"
            raise InvalidParameterError(f"unknown {owner} option {key!r} in {text!r}: use {', '.join(allowed)}")
        if key == "draft":
            name = value
        elif key != "kind":
            options[key] = _integer(text, item, key, value)
    return name, options


def _integer(text: str, item: str, key: str, value: str) -> int:
    """`value` as an integer within OPTION_RANGES[key], or an InvalidParameterError naming the option."""
    if not (value.isascii() and value.isdigit()):
        raise InvalidParameterError(f"drafter option {item!r} in {text!r} must look like name=integer")
    low, high = OPTION_RANGES[key]
    number = int(value) if len(value) <= 12 else high + 1  # a longer number is out of range anyway
    if not low <= number <= high:
        raise InvalidParameterError(f"drafter option {key}={value[:20]} in {text!r} is out of range: use {low}…{high}")
    return number
