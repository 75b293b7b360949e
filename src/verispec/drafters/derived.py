"""The draft model a parsed spec means, and the drafters built from derived draft models and cascades.

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

The spec strings are parsed and checked by `verispec.drafters.specs.DrafterSpec`.
"""

from __future__ import annotations

from collections.abc import Mapping

from verispec.drafters.base import Drafter
from verispec.drafters.cascade import HorizontalCascadeDrafter, VerticalCascadeDrafter
from verispec.drafters.cross_vocab import CrossVocabDrafter
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.ngram import NgramDrafter
from verispec.drafters.specs import DrafterSpec
from verispec.models.int8 import int8_available
from verispec.models.loading import ModelCache, ModelLoader, check_compatible, tokenizer_problems
from verispec.models.registry import default_draft_for
from verispec.models.runner import LoadedModel
from verispec.models.variants import derive_model

__all__ = ["draft_model", "draft_precision", "make_derived_drafter", "model_drafter"]


def draft_precision(target: LoadedModel) -> str:
    """The precision a draft model is loaded in unless a spec says otherwise: int8 for a float32 target
    (an int8 draft costs about half a float32 one per token and is accepted as often:
    BENCHMARKS.md#avx2-which-draft-model) on the CPU; else the target's own (int8 is CPU-only). A kquant
    draft of a file with other blocks (the shipped 0.5B) is requantized once (`models/requantize.py`) and
    drafts on kquant's flat curve (its cost: BENCHMARKS.md, "A draft model on the kquant kernels")."""
    cpu_int8 = target.precision == "float32" and target.device.type == "cpu" and int8_available()
    return "int8" if cpu_int8 else target.precision


def draft_model(
    name: str | None, target: LoadedModel, dtype: str | None, load: ModelLoader, same_tokenizer: bool = True
) -> LoadedModel:
    """The named draft model (default: a `ModelCache`'s default draft, else the target's shipped default) in
    `dtype` (default: `draft_precision`), checked against the target's tokenizer unless `same_tokenizer` is False."""
    default = load.default_draft if isinstance(load, ModelCache) else None
    draft = load(name or default or default_draft_for(target.name), dtype or draft_precision(target), pack_rows=1)
    if same_tokenizer:
        check_compatible(target, draft)
    return draft


def model_drafter(name: str | None, target: LoadedModel, dtype: str | None, load: ModelLoader,
                  vocab: int | None = None) -> Drafter:
    """A plain draft model: in the target's token ids when it shares its tokenizer, else through the
    committed text and the shared vocabulary (`cross_vocab`); `vocab`: its head cut to ids < vocab (`derive_model`)."""
    draft = draft_model(name, target, dtype, load, same_tokenizer=False)
    if vocab is not None:
        draft = derive_model(draft, vocab=vocab)
    if tokenizer_problems(target, draft):
        return CrossVocabDrafter(draft, target)
    return DraftModelDrafter(draft, target.vocab_size)


def _derived(model: LoadedModel, options: Mapping[str, int], default_layers: int | None = None) -> LoadedModel:
    layers, vocab, int8 = options.get("layers", default_layers), options.get("vocab"), options.get("int8", 0)
    if layers is None and vocab is None and not int8:
        return model
    return derive_model(model, layers, vocab, bool(int8))


def _cascade(spec: DrafterSpec, target: LoadedModel, dtype: str | None, load: ModelLoader) -> Drafter:
    ngram = NgramDrafter(max_n=spec.options.get("max_n", 3))
    draft = draft_model(spec.name, target, dtype, load)
    if spec.cascade == "horizontal":
        strong = DraftModelDrafter(draft, target.vocab_size)
        return HorizontalCascadeDrafter(strong, ngram, spec.options.get("strong", 2), target.vocab_size)
    return VerticalCascadeDrafter(draft, ngram, target.vocab_size, spec.options.get("inner_gamma"))


def make_derived_drafter(spec: DrafterSpec, target: LoadedModel, dtype: str | None, load: ModelLoader) -> Drafter:
    """The drafter for a `self`, `cascade` or `model:…,option=…` spec (`spec.derived`; see the module docstring)."""
    if spec.kind == "cascade":
        return _cascade(spec, target, dtype, load)
    if spec.kind == "self":
        draft = _derived(target, spec.options, default_layers=max(1, target.runner.config.num_layers // 4))
        return DraftModelDrafter(draft, target.vocab_size)
    if "int8" in spec.options:  # model: 1: load it as int8 (cached once), not quantize a float copy
        dtype = "int8" if spec.options["int8"] else target.precision
    return DraftModelDrafter(_derived(draft_model(spec.name, target, dtype, load), spec.options), target.vocab_size)
