"""Drafters and the one factory that turns a spec string into one.

Specs (`KIND` alone uses the defaults; options are `name=integer`, comma-separated):
  none                          plain decoding of the target
  model | model:NAME_OR_PATH    the default (or named) draft model; a model name/path alone also works;
                                one with another tokenizer drafts through the text (`drafters.cross_vocab`)
  gguf | gguf:NAME_OR_GGUF      the draft model run by llama.cpp from its GGUF file, whatever runs the
                                target (`model:NAME` in precision gguf)
  ngram[:max_n=3,min_n=1,oldest=0,nodes=0]   prompt lookup (latest longest match; oldest=1: the first, as HF;
                                nodes=N: a tree of every earlier match's continuation, up to N nodes)
  tree[:k=2,depth=4,wide=1]     SpecInfer top-k expansion by the draft model (k children at `wide` depths)
  merge[:max_n=3]               the draft model's chain and the n-gram continuation merged into one tree
  lookup[:nodes=16,table_nodes=16,max_n=3]   no draft model: prompt lookup's tree and STAND's (the target's own
                                n-gram table) merged into one tree, for a device where width costs little (a GPU)
  stand[:max_n=4,min_n=2,k=2,depth=5,wide=1]   STAND: n-gram table of the target's own distributions
  hybrid[:min_match=2,min_rate=0,max_n=4,window=0]    n-gram when its match is long enough, else the draft model
                                (window=W: it reads the prompt's last W tokens; vocab=N: its head scores ids < N);
                                `draft=NAME`: another draft model, of the target's tokenizer or not (through the text)
  online[:rank=8,buffer_size=64,steps=40,eval_requests=2,replay=4,holdout=25,support=64]   the draft model, distilled toward the
                                target between requests from its misses (`verispec.drafters.online`);
                                `self_layers=L`: distil the target's own first L layers instead
  triforce[:budget=512,chunk=32,…]  long prompts: draft model with a StreamingLLM cache → the target
                                over retrieved KV chunks → the target (every option: drafters/triforce.py)
  self[:layers=L,vocab=N,int8=1]   the target's first L layers as its own draft
  model:NAME,layers=L,vocab=N,int8=1   derived drafts: truncated, reduced output vocabulary, int8
  cascade[:kind=vertical,max_n=3]  the draft model's own drafts come from prompt lookup (vertical), or
  cascade:kind=horizontal,strong=2  the draft model for the first positions, n-gram after
                                (derived and cascade syntax: `verispec.drafters.derived`)

Option ranges (checked when the spec is parsed, before any model loads: `specs.DrafterSpec`, one parser
for the API, the CLI and a server's requests; `specs.OPTION_RANGES`), so that one step's work and one
drafter's memory stay bounded (`check_drafter_spec` runs every check that needs no model, as a server
does before it queues a request):
  max_n, min_n, min_match 1…16 · oldest, int8 0…1 · min_rate 0…100 (percent)
  k 1…8 · depth 1…12 · wide 0…12 · a tree (tree, stand) holds at most 256 nodes · stand, ngram nodes 0…256
  lookup: nodes 0…256 · table_nodes 1…256 · both together at most 256
  gamma1, strong, inner_gamma 1…32 · gamma2 0…32 (γ itself: at most 32, `specs.MAX_GAMMA`)
  online: rank 1…64 · buffer_size, support 1…1024 · steps 1…500 · eval_requests 1…64 · replay 1…16 ·
          holdout 0…90 · self_layers 1…256
  triforce: budget, recent 1…8192 · chunk 1…1024 · sinks 0…256 · window 1…8192 (triforce, hybrid)
  self/model: layers 1…256 · vocab 1…1048576 (vocab: hybrid too)
  and in order: min_n ≤ max_n, wide ≤ depth, chunk ≤ budget
"""

from __future__ import annotations

from verispec.drafters.base import Drafter, DraftSession
from verispec.drafters.derived import draft_model, make_derived_drafter, model_drafter
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.hybrid import HybridDrafter
from verispec.drafters.ngram import NgramDrafter
from verispec.drafters.specs import DRAFTER_KINDS, FACTORIES, DrafterSpec
from verispec.drafters.stand import StandDrafter
from verispec.drafters.tree import ExpansionDrafter, MergeDrafter
from verispec.drafters.triforce import make_triforce
from verispec.models.loading import ModelLoader, load_model
from verispec.models.runner import LoadedModel
from verispec.models.variants import derive_model

__all__ = [
    "Drafter", "DraftSession", "DraftModelDrafter", "NgramDrafter", "ExpansionDrafter", "MergeDrafter",
    "StandDrafter", "HybridDrafter", "DrafterSpec", "make_drafter", "check_drafter_spec", "DRAFTER_KINDS",
]

# Raise the InvalidParameterError `make_drafter` would raise for a spec before it loads a model (an unknown
# option of its kind, a value out of range or out of order, a tree too large); returns the parsed spec.
# Loads nothing: names of models are checked when the drafter is built (the loader knows what it holds).
check_drafter_spec = DrafterSpec.parse


def make_drafter(
    spec: str | DrafterSpec | None, target: LoadedModel, dtype: str | None = None, load: ModelLoader = load_model
) -> Drafter | None:
    """A drafter for `target` from a spec (parsed first, so that a bad option fails before any model loads);
    None for plain decoding. Draft models come from `load(spec, dtype)` (a `ModelCache` shares them
    between drafters)."""
    spec = spec if isinstance(spec, DrafterSpec) else DrafterSpec.parse(spec)
    kind, options, vocab = spec.kind, dict(spec.options), target.vocab_size
    if kind == "none":
        return None
    if spec.derived:
        return make_derived_drafter(spec, target, dtype, load)
    if kind in ("model", "gguf"):  # gguf: the draft model on the llama.cpp backend
        return model_drafter(spec.name, target, "gguf" if kind == "gguf" else dtype, load)
    if kind == "ngram":
        return NgramDrafter(**options)
    if kind == "stand":
        return StandDrafter(vocab, **options)
    if kind == "lookup":  # model-free: nothing to load
        return MergeDrafter.lookup(vocab, **options)
    if kind == "hybrid":  # its draft model may be of another tokenizer (`draft=NAME`), its head cut (`vocab=N`)
        draft_vocab = options.pop("vocab", None)
        return HybridDrafter(model_drafter(spec.name, target, dtype, load, draft_vocab), **options)
    self_layers = options.pop("self_layers", None)  # online: distil the target's own first layers (a self-speculative draft)
    model = derive_model(target, layers=self_layers) if self_layers is not None else draft_model(None, target, dtype, load)
    if kind == "triforce":
        return make_triforce(target, model, options)
    return FACTORIES[kind](model, vocab, **options)
