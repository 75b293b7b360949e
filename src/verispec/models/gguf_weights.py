"""A GGUF file's tensors under the Hugging Face names verispec's runner reads, without converting them.

`GGUFWeights` is the weight source of the `kquant` precision (`models/kquant.py`): float tensors
(norms, biases, float weights) come out as float32 torch tensors, k-quant tensors as their raw blocks
(`KQuantWeight`), read from the file when asked for. Llama files store the query and key rows
permuted for ggml's RoPE; those rows are put back in Hugging Face order (a permutation of whole rows,
so the blocks stay as they are).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from verispec.errors import ModelNotFoundError
from verispec.models.kquant import KQUANT_TYPES, KQuantWeight, raw_rows

__all__ = ["GGUFWeights", "GGUF_ARCHITECTURES"]

GGUF_ARCHITECTURES = ("qwen2", "llama")

_LAYER_NAMES = {  # Hugging Face name inside model.layers.{i}. -> GGUF name inside blk.{i}.
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    **{f"self_attn.{p}_proj.{kind}": f"attn_{p}.{kind}" for p in "qkv" for kind in ("weight", "bias")},
}
_MODEL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
_FLOAT_TYPES = ("F32", "F16", "BF16")


def gguf_name(name: str) -> str | None:
    """The GGUF tensor name of a Hugging Face weight name, or None for a name GGUF files do not use."""
    if name in _MODEL_NAMES:
        return _MODEL_NAMES[name]
    if name.startswith("model.layers."):
        index, _, rest = name.removeprefix("model.layers.").partition(".")
        if rest in _LAYER_NAMES:
            return f"blk.{index}.{_LAYER_NAMES[rest]}"
    return None


class GGUFWeights:
    """A read-only mapping from Hugging Face weight names to a GGUF file's tensors (see the module docstring)."""

    def __init__(self, path: str | Path, num_heads: int, num_kv_heads: int):
        from gguf import GGUFReader

        self.path = Path(path)
        self.reader = GGUFReader(self.path)
        self.tensors = {tensor.name: tensor for tensor in self.reader.tensors}
        field = self.reader.fields.get("general.architecture")
        self.architecture = bytes(field.parts[field.data[0]]).decode() if field is not None else "?"
        if self.architecture not in GGUF_ARCHITECTURES:
            raise ModelNotFoundError(f"{self.path.name} is a {self.architecture!r} GGUF file; kquant runs "
                                     f"{', '.join(GGUF_ARCHITECTURES)} files (use --dtype gguf for llama.cpp)")
        self.heads = {"q": num_heads, "k": num_kv_heads}
        unsupported = sorted({t.tensor_type.name for t in self.reader.tensors
                              if t.tensor_type.name not in (*KQUANT_TYPES, *_FLOAT_TYPES)})
        if unsupported:
            raise ModelNotFoundError(
                f"{self.path.name} holds {', '.join(unsupported)} tensors; kquant runs Q4_K and Q6_K blocks "
                "(Q4_K_M and Q4_K_S files of qwen2/llama models); use --dtype gguf to run this file with llama.cpp"
            )

    def __contains__(self, name: str) -> bool:
        return gguf_name(name) in self.tensors

    def __getitem__(self, name: str) -> torch.Tensor | KQuantWeight:
        tensor = self.tensors[gguf_name(name)]
        rows = np.asarray(tensor.data)
        rows = self._hf_row_order(name, rows)
        kind = tensor.tensor_type.name
        if kind in KQUANT_TYPES:
            cols = int(tensor.shape[0])  # GGUF lists the innermost (input) dimension first
            return KQuantWeight(KQUANT_TYPES[kind], raw_rows(rows), cols)
        return torch.from_numpy(np.array(rows, dtype=np.float32))

    def _hf_row_order(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Undo llama.cpp's converter permuting the query/key rows of llama files (per head, the two RoPE halves interleaved)."""
        part = name.rpartition("self_attn.")[2][:1]
        if self.architecture != "llama" or not name.endswith("_proj.weight") or part not in self.heads:
            return rows
        heads = self.heads[part]
        shape = rows.shape
        return rows.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)

    @property
    def has_output(self) -> bool:
        """Whether the file has its own output head (else the head is the token embedding)."""
        return "output.weight" in self.tensors
