"""Cheaper variants of a loaded model, for drafting: fewer layers, a smaller output vocabulary, int8.

- `truncated(runner, layers)`: the first `layers` decoder layers + the final norm + the head
  (self-speculation when applied to the target). A shallow copy: weights are shared, not copied.
- `reduced_vocab(runner, vocab, head)`: the head keeps only token ids [0, vocab) (lower BPE ids are
  the earlier, more frequent merges); logits of the other ids are −inf, so the logits keep the full
  width and every caller (processors, padding to the target vocab) works unchanged. The 0.5B Qwen's
  tied head (151936 × 896) is ~27% of its weights, so this cuts the bytes read per draft token.
- `quantized(runner)`: every linear layer as `Int8Linear` (needs unpacked fp32 weights). A model
  loaded with precision `int8` (`load_model(spec, "int8")`) already is; `derive_model` then keeps it.

All stay lossless as drafts: the target verifies every token. `derive_model` chains them on a
`LoadedModel`; the variant's `variant` tag keeps measured costs apart from the full model's.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.nn.functional as F
from safetensors import safe_open

from verispec.errors import InvalidParameterError
from verispec.models.int8 import Int8Linear, int8_available
from verispec.models.linear import PackedLinear
from verispec.models.loading import require_own_runner
from verispec.models.runner import LoadedModel
from verispec.models.transformer import Transformer

__all__ = ["truncated", "reduced_vocab", "quantized", "head_weight", "derive_model"]


def _with(runner: Transformer, tag: str, **attributes) -> Transformer:
    """A shallow copy of `runner` with some attributes replaced and `tag` added to its variant name."""
    variant = copy.copy(runner)
    for name, value in attributes.items():
        setattr(variant, name, value)
    variant.variant = runner.variant + "," + tag
    variant.use_graphs(runner.graphs and variant.quant is None)  # graphs captured on its own layers, not the original's
    return variant


def truncated(runner: Transformer, layers: int) -> Transformer:
    """The first `layers` layers of `runner`, its final norm and head (weights shared)."""
    total = runner.config.num_layers
    if not 1 <= layers <= total:
        raise InvalidParameterError(f"layers must be in [1, {total}] for this model, got {layers}")
    config = dataclasses.replace(runner.config, num_layers=layers)
    return _with(runner, f"layers={layers}", config=config, layers=runner.layers[:layers])


class _PaddedHead:
    """The head restricted to ids [0, kept); logits of ids [kept, full) are −inf."""

    def __init__(self, head, kept: int, full: int):
        self.head, self.kept, self.full = head, kept, full

    @property
    def nbytes(self) -> int:
        return self.head.nbytes

    @property
    def in_features(self) -> int:
        return self.head.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x [rows, hidden] -> [rows, full]
        logits = self.head(x)  # [rows, kept]
        return F.pad(logits, (0, self.full - self.kept), value=float("-inf"))


def head_weight(runner: Transformer, folder=None) -> torch.Tensor:
    """The unpacked output head [vocab, hidden]: the embedding when tied, else the stored weight."""
    if runner.config.tie_word_embeddings:
        return runner.embed
    head = runner.lm_head
    if isinstance(head, PackedLinear) and not head.packed:
        return head.weight
    if folder is None:
        raise InvalidParameterError("the head is prepacked: give the model folder to read the raw weight from")
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            if "lm_head.weight" in f.keys():
                return f.get_tensor("lm_head.weight").to(runner.dtype)
    raise InvalidParameterError(f"no lm_head.weight in {folder}")


def reduced_vocab(runner: Transformer, vocab: int, head: torch.Tensor, pack: bool = True) -> Transformer:
    """`runner` whose head scores only ids [0, vocab); `head` is the full unpacked head [full, hidden].
    An int8 runner (`runner.quant == "int8"`) gets an int8 head; a kquant runner keeps the first tiles
    of its own head (`head` unused)."""
    full = runner.config.vocab_size
    if not 1 <= vocab <= full:
        raise InvalidParameterError(f"vocab must be in [1, {full}] for this model, got {vocab}")
    if runner.quant == "kquant":  # the file's blocks: the first tiles of the packed head, shared
        kept = runner.lm_head.first_columns(vocab)
    elif runner.quant == "int8":
        kept = Int8Linear.from_float(head[:vocab])
    else:
        kept = PackedLinear(head[:vocab], None, pack)
    lm_head = _PaddedHead(kept, vocab, full)
    return _with(runner, f"vocab={vocab}", lm_head=lm_head)


def _as_int8(linear) -> Int8Linear:
    if not isinstance(linear, PackedLinear) or linear.packed:
        raise InvalidParameterError("int8 needs a model loaded without prepacked weights (pack=False)")
    return Int8Linear.from_float(linear.weight, linear.bias)


def quantized(runner: Transformer) -> Transformer:
    """Every decoder linear (and a plain head) as int8; `runner` must be unpacked and float32."""
    if not int8_available():
        raise InvalidParameterError("this torch build has no fbgemm int8 kernel: int8 drafts are unavailable")
    if runner.dtype != torch.float32:
        raise InvalidParameterError("int8 drafts need a float32 model (dtype float32)")
    layers = []
    for layer in runner.layers:
        layer = copy.copy(layer)
        layer.qkv, layer.o, layer.gate_up, layer.down = (_as_int8(lin) for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
        layers.append(layer)
    head = runner.lm_head
    if isinstance(head, _PaddedHead):
        head = _PaddedHead(_as_int8(head.head), head.kept, head.full)
    else:
        head = _as_int8(head)
    return _with(runner, "int8=1", layers=layers, lm_head=head, quant="int8", row_invariant=True)


def derive_model(model: LoadedModel, layers: int | None = None, vocab: int | None = None, int8: bool = False) -> LoadedModel:
    """`model` with its first `layers` layers, its head cut to `vocab` ids, and/or int8 linears."""
    require_own_runner(model, "a derived draft (layers=, vocab=, int8=)")
    runner = model.runner
    if int8 and runner.quant not in ("int8", "kquant"):  # quantizing needs the raw weights: read them again
        if runner.dtype != torch.float32:
            raise InvalidParameterError("int8 drafts need a float32 model (dtype float32)")
        runner = Transformer.from_folder(model.folder, torch.float32, quant="int8")
    full_head = head_weight(runner, model.folder) if vocab is not None and runner.quant != "kquant" else None
    if layers is not None:
        runner = truncated(runner, layers)
    if vocab is not None:
        runner = reduced_vocab(runner, vocab, full_head)
    return dataclasses.replace(model, name=model.name + runner.variant, runner=runner)
