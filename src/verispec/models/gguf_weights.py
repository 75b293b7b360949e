"""A GGUF file's tensors under the Hugging Face names verispec's runner reads, without converting them.

`GGUFWeights` is the weight source of the `kquant` precision (`models/kquant.py`): float tensors
(norms, biases, float weights) come out as float32 torch tensors, k-quant tensors as their raw blocks
(`KQuantWeight`), read from the file when asked for. Llama files store the query and key rows
permuted for ggml's RoPE; those rows are put back in Hugging Face order (a permutation of whole rows,
so the blocks stay as they are).

`tensor_index` reads the file's header itself: the `gguf` package's reader parses every metadata
array into Python objects (the 1.5B's tokenizer: ~12 s); here the header is read through a memory map,
the tokenizer arrays skipped by their lengths, and each tensor is mapped when asked for, copy-on-write (only
the pages a load reads count in its memory: a cached load of kquant's tiles reads the token embeddings'
rows as lookups need them, and norms and biases).
"""

from __future__ import annotations

import functools
import mmap
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np
import torch

from verispec.errors import ModelNotFoundError
from verispec.models.kquant import KQUANT_TYPES, KQuantWeight
from verispec.models.requantize import Requantized

__all__ = ["GGUFWeights", "GGUF_ARCHITECTURES", "gguf_architecture", "kquant_requantizes", "kquant_runs", "tensor_index"]

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
_FLOAT_TYPES = ("F32", "F16")


_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}  # GGUF value types
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    type_name: str  # ggml's type name: "Q4_K", "Q6_K", "F32", …
    shape: tuple[int, ...]  # GGUF order: the innermost (input) dimension first
    offset: int  # from the file's start
    nbytes: int


class _Header:
    """A cursor over a GGUF file's bytes (a read-only memory map: only the pages read are loaded)."""

    def __init__(self, data: mmap.mmap):
        self.data, self.at = data, 0

    def read(self, fmt: str):
        (value,) = struct.unpack_from("<" + fmt, self.data, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> bytes:
        size = self.read("Q")
        self.at += size
        return self.data[self.at - size : self.at]

    def value(self, kind: int):
        """One metadata value; arrays are skipped (None): the tensors need none of them."""
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.read("I"), self.read("Q")
            if item == _STRING:  # the tokenizer's ~150,000 strings: skipped by their lengths alone
                at, data, length = self.at, self.data, struct.Struct("<Q").unpack_from
                for _ in range(count):
                    at += 8 + length(data, at)[0]
                self.at = at
            else:
                self.at += count * struct.calcsize(_SCALARS[item])
            return None
        return self.read(_SCALARS[kind])


def tensor_index(path: Path) -> tuple[str, Mapping[str, TensorInfo]]:
    """(architecture, tensor name → where and what it is) from a GGUF file's header, read once per version of
    the file in a process (loading a model asks several times; its vocabulary alone is ~150,000 strings)."""
    stat = path.stat()
    return _header_index(path.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _header_index(path: Path, size: int, mtime_ns: int) -> tuple[str, Mapping[str, TensorInfo]]:
    """`tensor_index` of the file at `path` of this size and modification time."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelNotFoundError(f"{path} is not a GGUF file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            header = _Header(data)
            header.at = 8  # past the magic and the format version: 2 and 3 share this layout
            tensors, fields = header.read("Q"), header.read("Q")
            meta = {}
            for _ in range(fields):
                key = header.string().decode()
                meta[key] = header.value(header.read("I"))
            infos = []
            for _ in range(tensors):
                name = header.string().decode()
                shape = tuple(header.read("Q") for _ in range(header.read("I")))
                infos.append((name, header.read("I"), shape, header.read("Q")))
            alignment = int(meta.get("general.alignment") or 32)
            start = -(-header.at // alignment) * alignment
    index = {}
    for name, type_number, shape, offset in infos:
        kind = GGMLQuantizationType(type_number)
        block, block_bytes = GGML_QUANT_SIZES[kind]
        index[name] = TensorInfo(kind.name, shape, start + offset, int(np.prod(shape)) // block * block_bytes)
    architecture = meta.get("general.architecture")
    return architecture.decode() if isinstance(architecture, bytes) else "?", MappingProxyType(index)  # shared: read-only


def gguf_name(name: str) -> str | None:
    """The GGUF tensor name of a Hugging Face weight name, or None for a name GGUF files do not use."""
    if name in _MODEL_NAMES:
        return _MODEL_NAMES[name]
    if name.startswith("model.layers."):
        index, _, rest = name.removeprefix("model.layers.").partition(".")
        if rest in _LAYER_NAMES:
            return f"blk.{index}.{_LAYER_NAMES[rest]}"
    return None


def gguf_architecture(path: str | Path) -> str | None:
    """general.architecture of a GGUF file (its header alone is read), or None for a file that is not one."""
    try:
        architecture, _ = tensor_index(Path(path))
    except (ModelNotFoundError, OSError, ValueError, KeyError, struct.error):
        return None
    return None if architecture == "?" else architecture


def kquant_runs(path: str | Path) -> bool:
    """Whether kquant can run the GGUF file at `path` (a qwen2/llama file of Q4_K, Q6_K and float tensors)."""
    try:
        architecture, tensors = tensor_index(Path(path))
    except (ModelNotFoundError, OSError, ValueError, struct.error):
        return False
    known = (*KQUANT_TYPES, *_FLOAT_TYPES)
    return architecture in GGUF_ARCHITECTURES and bool(tensors) and all(t.type_name in known for t in tensors.values())


def kquant_requantizes(path: str | Path) -> bool:
    """Whether kquant runs the GGUF file at `path` only through a requantized copy (a qwen2/llama file
    with tensors of other block types, as the shipped 0.5B draft: `models/requantize.py`)."""
    try:
        architecture, tensors = tensor_index(Path(path))
    except (ModelNotFoundError, OSError, ValueError, struct.error):
        return False
    return architecture in GGUF_ARCHITECTURES and bool(tensors) and not kquant_runs(path)


class GGUFWeights:
    """A read-only mapping from Hugging Face weight names to a GGUF file's tensors (see the module docstring)."""

    def __init__(self, path: str | Path, num_heads: int, num_kv_heads: int, requantize: bool = False):
        """requantize: serve the tensors kquant cannot run (Q5_0, Q8_0, …) requantized to Q4_K/Q6_K
        (`models/requantize.py`: another model than the file, for drafts); else such a file is an error."""
        self.path = Path(path)
        self.architecture, self.tensors = tensor_index(self.path)
        if self.architecture not in GGUF_ARCHITECTURES:
            raise ModelNotFoundError(f"{self.path.name} is a {self.architecture!r} GGUF file; kquant runs "
                                     f"{', '.join(GGUF_ARCHITECTURES)} files (use --dtype gguf for llama.cpp)")
        self.heads = {"q": num_heads, "k": num_kv_heads}
        others = {name: t for name, t in self.tensors.items() if t.type_name not in (*KQUANT_TYPES, *_FLOAT_TYPES)}
        if others and not requantize:
            raise ModelNotFoundError(
                f"{self.path.name} holds {', '.join(sorted({t.type_name for t in others.values()}))} tensors; kquant "
                "runs Q4_K and Q6_K blocks (Q4_K_M and Q4_K_S files of qwen2/llama models); use --dtype gguf to run "
                "this file with llama.cpp"
            )
        self.requantized = Requantized(self.path, others) if others else {}  # GGUF name -> (type, blocks)

    def __contains__(self, name: str) -> bool:
        return gguf_name(name) in self.tensors

    def __getitem__(self, name: str) -> torch.Tensor | KQuantWeight:
        tensor = self.tensors[gguf_name(name)]
        if gguf_name(name) in self.requantized:
            kind, blocks = self.requantized[gguf_name(name)]
            raw = self._hf_row_order(name, blocks.numpy())
            return KQuantWeight(KQUANT_TYPES[kind], torch.from_numpy(np.ascontiguousarray(raw)), int(tensor.shape[0]))
        try:  # mapped, copy-on-write: only the pages read count in memory (an embedding lookup reads a few rows)
            data = np.memmap(self.path, dtype=np.uint8, mode="c", offset=tensor.offset, shape=(tensor.nbytes,))
        except ValueError as error:  # the file ends before the tensor does
            raise ModelNotFoundError(f"{self.path.name} ends inside tensor {gguf_name(name)}") from error
        rows = int(np.prod(tensor.shape[1:]))  # one row per output feature (1 for a vector)
        if tensor.type_name in KQUANT_TYPES:
            raw = self._hf_row_order(name, data.reshape(rows, -1))
            return KQuantWeight(KQUANT_TYPES[tensor.type_name], torch.from_numpy(np.ascontiguousarray(raw)), int(tensor.shape[0]))
        values = data.view({"F32": np.float32, "F16": np.float16}[tensor.type_name]).astype(np.float32)
        shape = tuple(reversed(tensor.shape))  # numpy order: [out, in] or [n]
        return torch.from_numpy(self._hf_row_order(name, values.reshape(shape)).copy())

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
