"""Drafters and the one factory that turns a spec string into one.

Specs (`KIND` alone uses the defaults; options are `name=integer`, comma-separated):
  none                          plain decoding of the target
  model | model:NAME_OR_PATH    the default (or named) draft model; a model name/path alone also works;
                                one with another tokenizer drafts through the text (`drafters.cross_vocab`)
  gguf | gguf:NAME_OR_GGUF      the draft model run by llama.cpp from its GGUF file, whatever runs the
                                target (`model:NAME` in precision gguf)
  ngram[:max_n=3,min_n=1,oldest=0]   prompt lookup (latest longest match; oldest=1: the first, as HF)
  tree[:k=2,depth=4,wide=1]     SpecInfer top-k expansion by the draft model (k children at `wide` depths)
  merge[:max_n=3]               the draft model's chain and the n-gram continuation merged into one tree
  stand[:max_n=4,min_n=2,k=2,depth=5,wide=1]   STAND: n-gram table of the target's own distributions
  hybrid[:min_match=2,min_rate=30,max_n=4]     n-gram when its match is long enough, else the draft model
  online[:rank=8,buffer_size=64,steps=40,eval_requests=2,replay=4,holdout=25,support=64]   the draft model, distilled toward the
                                target between requests from its misses (`verispec.drafters.online`);
                                `self_layers=L`: distil the target's own first L layers instead
  triforce[:budget=512,chunk=32,…]  long prompts: draft model with a StreamingLLM cache → the target
                                over retrieved KV chunks → the target (every option: drafters/triforce.py)
  self[:layers=L,vocab=N,int8=1]   the target's first L layers as its own draft
  model:NAME,layers=L,vocab=N,int8=1   derived drafts: truncated, reduced output vocabulary, int8
  cascade[:kind=vertical,max_n=3]  the draft model's own drafts come from prompt lookup (vertical), or
  cascade:kind=horizontal,strong=2  the draft model for the first positions, n-gram after
                                (derived and cascade syntax: `verispec.drafters.specs`)

Option ranges (checked when the spec is parsed, before any model loads; `specs.OPTION_RANGES`), so
that one step's work and one drafter's memory stay bounded (`check_drafter_spec` runs every check that
needs no model, as a server does before it queues a request):
  max_n, min_n, min_match 1…16 · oldest, int8 0…1 · min_rate 0…100 (percent)
  k 1…8 · depth 1…12 · wide 0…12 · a tree (tree, stand) holds at most 256 nodes · stand nodes 0…256
  gamma1, strong, inner_gamma 1…32 · gamma2 0…32 (γ itself: at most 32, `specs.MAX_GAMMA`)
  online: rank 1…64 · buffer_size, support 1…1024 · steps 1…500 · eval_requests 1…64 · replay 1…16 ·
          holdout 0…90 · self_layers 1…256
  triforce: budget, recent, window 1…8192 · chunk 1…1024 · sinks 0…256
  self/model: layers 1…256 · vocab 1…1048576
  and in order: min_n ≤ max_n, wide ≤ depth, chunk ≤ budget
"""

from __future__ import annotations

import inspect

from verispec.drafters.base import Drafter, DraftSession
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.hybrid import HybridDrafter
from verispec.drafters.ngram import NgramDrafter
from verispec.drafters.online import OnlineDrafter
from verispec.drafters.specs import (
    MAX_TREE_NODES, SPEC_KINDS, derived_options, draft_model, integer_option, is_derived_spec, make_derived_drafter,
    model_drafter, tree_nodes,
)
from verispec.drafters.stand import StandDrafter
from verispec.drafters.tree import ExpansionDrafter, MergeDrafter
from verispec.drafters.triforce import TriForceDrafter, make_triforce
from verispec.errors import InvalidParameterError
from verispec.models.loading import ModelLoader, load_model
from verispec.models.runner import LoadedModel
from verispec.models.variants import derive_model

__all__ = [
    "Drafter", "DraftSession", "DraftModelDrafter", "NgramDrafter", "ExpansionDrafter", "MergeDrafter",
    "StandDrafter", "HybridDrafter", "make_drafter", "check_drafter_spec", "DRAFTER_KINDS",
]

DRAFTER_KINDS = ("none", "model", "gguf", "ngram", "tree", "merge", "stand", "hybrid", "online", "triforce", *SPEC_KINDS)
_NOT_OPTIONS = {"self", "model", "target", "draft", "target_vocab_size", "vocab_size", "table", "paths", "lr", "tolerance", "store"}
# the kinds whose options are their factory's keyword arguments
_FACTORIES = {"ngram": NgramDrafter, "stand": StandDrafter, "tree": ExpansionDrafter, "merge": MergeDrafter.model_and_ngram,
              "hybrid": HybridDrafter, "online": OnlineDrafter, "triforce": TriForceDrafter}
_ORDERED = (("min_n", "max_n"), ("wide", "depth"), ("chunk", "budget"))  # the first may not exceed the second


def _options(text: str, kind: str = "") -> dict[str, int]:
    """{name: value} of `name=integer,…`, each value within its range (`specs.OPTION_RANGES`)."""
    options = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not (value.strip().isascii() and value.strip().isdigit()):
            raise InvalidParameterError(f"drafter option {item!r} must look like name=integer")
        options[key.strip()] = integer_option(f"{kind}:{text}" if kind else text, key.strip(), value)
    return options


def _pop_option(text: str, name: str) -> tuple[str, int | None]:
    """(`text` without the option `name`, its value or None): for options the factory itself reads."""
    mine = [item for item in text.split(",") if item.partition("=")[0].strip() == name]
    value = _options(",".join(mine)).get(name)  # the other options are checked by `_build`
    return ",".join(item for item in text.split(",") if item.partition("=")[0].strip() != name), value


def _checked_options(kind: str, text: str) -> dict[str, int]:
    """The options `text` gives the factory of `kind` (`_FACTORIES`): each one of its keyword arguments,
    within its range, in order with its partner (`_ORDERED`), a tree within MAX_TREE_NODES. Loads nothing."""
    parameters = inspect.signature(_FACTORIES[kind]).parameters
    allowed = [name for name in parameters if name not in _NOT_OPTIONS]
    for item in filter(None, text.split(",")):
        if (name := item.partition("=")[0].strip()) not in allowed:
            raise InvalidParameterError(f"unknown {kind} drafter option {name!r}: use {', '.join(allowed)}")
    options = _options(text, kind)
    values = {name: options.get(name, parameter.default) for name, parameter in parameters.items()}  # defaults filled in
    _check_order(kind, text, values)
    if {"k", "depth", "wide"} <= set(values) and not options.get("nodes"):
        _check_tree_size(kind, text, values["k"], values["depth"], values["wide"])
    return options


def _check_order(kind: str, text: str, values: dict) -> None:
    for low, high in _ORDERED:
        if low in values and high in values and values[low] > values[high]:
            raise InvalidParameterError(f"{kind} drafter option {text!r}: {low} must not exceed {high}, "
                                        f"got {low}={values[low]} and {high}={values[high]}")


def _check_tree_size(kind: str, text: str, k: int, depth: int, wide: int) -> None:
    if (nodes := tree_nodes(k, depth, wide)) > MAX_TREE_NODES:
        raise InvalidParameterError(f"{kind} drafter option {text!r}: a tree of k={k}, depth={depth}, wide={wide} holds "
                                    f"{nodes} nodes, more than {MAX_TREE_NODES}: lower k, depth or wide")


def _build(kind: str, text: str, args=lambda: ()) -> Drafter:
    """`factory(*args(), **options)` for the factory of `kind`, the options checked first (so a typo fails
    before a draft model is loaded)."""
    options = _checked_options(kind, text)
    return _FACTORIES[kind](*args(), **options)


def _split(spec: str | None) -> tuple[str, str]:
    """(kind, options text) of a spec; None is "none"."""
    kind, _, rest = (spec or "none").strip().partition(":")
    return kind, rest


def check_drafter_spec(spec: str | None) -> None:
    """Raise the InvalidParameterError `make_drafter` would raise for `spec` before it loads a model: an
    unknown option of its kind, a value out of range or out of order, a tree too large. Loads nothing:
    names of models are checked when the drafter is built (the loader knows what it holds)."""
    kind, rest = _split(spec)
    if is_derived_spec(kind, rest):
        derived_options(kind, rest)
    elif kind == "online":
        _checked_options(kind, _pop_option(rest, "self_layers")[0])
    elif kind in _FACTORIES:
        _checked_options(kind, rest)


def make_drafter(
    spec: str | None, target: LoadedModel, dtype: str | None = None, load: ModelLoader = load_model
) -> Drafter | None:
    """A drafter for `target` from a spec string; None for plain decoding. Draft models come from
    `load(spec, dtype)` (a `ModelCache` shares them between drafters)."""
    spec = (spec or "none").strip()
    kind, rest = _split(spec)
    vocab = target.vocab_size
    if kind == "none":
        return None
    if is_derived_spec(kind, rest):
        return make_derived_drafter(kind, rest, target, dtype, load)
    if kind == "ngram":
        return _build(kind, rest)
    if kind == "stand":
        return _build(kind, rest, lambda: (vocab,))
    with_model = lambda: (draft_model(None, target, dtype, load), vocab)  # noqa: E731
    if kind in ("tree", "merge", "hybrid"):
        return _build(kind, rest, with_model)
    if kind == "online":
        rest, self_layers = _pop_option(rest, "self_layers")
        if self_layers is not None:  # distil the target's own first layers (a self-speculative draft)
            return _build(kind, rest, lambda: (derive_model(target, layers=self_layers), vocab))
        return _build(kind, rest, with_model)
    if kind == "gguf":  # the draft model on the llama.cpp backend
        return model_drafter(rest or None, target, "gguf", load)
    if kind == "triforce":
        options = _checked_options(kind, rest)  # before the draft model loads
        return make_triforce(target, draft_model(None, target, dtype, load), options)
    return model_drafter((rest or None) if kind == "model" else spec, target, dtype, load)
