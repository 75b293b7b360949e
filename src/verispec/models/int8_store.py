"""The int8 precision's weights, quantized once per model folder and cached, like the GGUF conversion.

`Int8Store(folder)` builds the int8 linear layers of a `Transformer` loaded from `folder`. When the
cache file exists, each layer is made from its stored int8 values and per-channel scales, and the
float weights behind it are never read; otherwise each float weight is quantized
(`int8.quantize_per_channel`) and `save()` writes the values to the cache for the next load.

The file lives in `cache_dir()/int8/`, named after the folder, and records the folder's weight files
(name, size, modification time) and the format version: a folder whose weights changed, or an older
format, is quantized again. fbgemm's packing of the values still runs at every load.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from verispec.models.int8 import Int8Linear, quantize_per_channel
from verispec.paths import cache_dir

__all__ = ["Int8Store", "FORMAT"]

FORMAT = "1"  # bump when the quantization itself changes


def _fingerprint(folder: Path) -> str:
    """What the cached values were quantized from: the format and each weight file's name, size and mtime."""
    files = sorted(folder.glob("*.safetensors"))
    return json.dumps([FORMAT] + [[file.name, file.stat().st_size, file.stat().st_mtime_ns] for file in files])


class Int8Store:
    """`linear(name, weight, bias)`: an `Int8Linear` from the cache, or quantized from `weight()` and kept for `save()`."""

    def __init__(self, folder: str | Path, root: Path | None = None):
        folder = Path(folder).resolve()
        key = hashlib.sha256(str(folder).encode()).hexdigest()[:12]
        self.file = (root or cache_dir() / "int8") / f"{folder.name}-{key}.safetensors"
        self.fingerprint = _fingerprint(folder)
        self._handle = None
        if self.file.exists():
            with safe_open(self.file, framework="pt") as handle:
                fresh = (handle.metadata() or {}).get("fingerprint") == self.fingerprint
            if fresh:
                self._handle = safe_open(self.file, framework="pt")
        self._new: dict[str, torch.Tensor] = {}

    @property
    def cached(self) -> bool:
        """Whether the layers come from the cache file (no float weight is quantized)."""
        return self._handle is not None

    def linear(self, name: str, weight: Callable[[], torch.Tensor], bias: torch.Tensor | None) -> Int8Linear:
        if self._handle is not None:
            return Int8Linear(self._handle.get_tensor(f"{name}.q"), self._handle.get_tensor(f"{name}.scales"), bias)
        q, scales = quantize_per_channel(weight())  # [out, in] int8, [out] float32
        self._new[f"{name}.q"], self._new[f"{name}.scales"] = q, scales
        return Int8Linear(q, scales, bias)

    def save(self) -> None:
        """Write the values quantized by this load (nothing when they came from the cache)."""
        if self._new:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            partial = self.file.with_suffix(".partial")
            save_file(self._new, partial, metadata={"fingerprint": self.fingerprint})
            partial.replace(self.file)  # atomic: a crash mid-write leaves no half file behind
            self._new = {}
        self._handle = None
