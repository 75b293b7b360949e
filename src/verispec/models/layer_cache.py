"""Linear layers prepared once per weight file and kept on disk: int8's values and scales, kquant's tiles.

Preparing a model's layers costs seconds at every load (int8: quantizing the float folder; kquant: repacking
a GGUF file's blocks into its kernels' tiles, most of a warm `verispec generate`'s start). A `LayerCache`
keeps what one load prepared in a safetensors file of `cache_dir()`, stamped with a fingerprint of what it
was made from (a format, the weight files' names, sizes and modification times, for kquant also the
kernels' build and whether the file was requantized); a later load with the same fingerprint reads the
layers back and never reads the weights behind them, any other fingerprint prepares them again. Files are
written whole or not at all (a crash mid-write leaves no half file).

`Int8Store` and `KQuantStore` are the two precisions' caches, named after the folder or file they serve.
fbgemm's packing of int8 values still runs at every load; kquant's tiles are what its kernels read.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from verispec.models.int8 import Int8Linear, quantize_per_channel
from verispec.models.kquant import KQuantTiles, KQuantWeight
from verispec.models.requantize import VERSION as REQUANTIZE_VERSION
from verispec.paths import files_stamp, keyed_file, write_whole

__all__ = ["LayerCache", "Int8Store", "KQuantStore", "INT8_FORMAT", "KQUANT_FORMAT"]

INT8_FORMAT = "2"  # bump when the quantization or what is stored per layer changes (2: keys "layer/part")
KQUANT_FORMAT = "1"  # bump when what is stored per layer changes (the tiles' layout is the kernels' build)


def cache_file(kind: str, source: Path) -> Path:
    """`cache_dir()/kind/<source's name>-<digest of its full path>.safetensors`."""
    source = source.resolve()
    return keyed_file(kind, source.name, str(source), ".safetensors")


class LayerCache:
    """Tensors per layer name: those stored under `fingerprint` in `file` (when it matches), plus those `put`
    by this load, which `save()` writes."""

    def __init__(self, file: Path, fingerprint: str):
        self.file, self.fingerprint = file, fingerprint
        self._handle, self._stored = None, defaultdict(list)  # layer name -> its stored keys
        if file.exists():
            try:
                with safe_open(file, framework="pt") as handle:
                    fresh = (handle.metadata() or {}).get("fingerprint") == fingerprint
            except Exception:  # noqa: BLE001 - a damaged file is made again
                fresh = False
            if fresh:
                self._handle = safe_open(file, framework="pt")
                for key in self._handle.keys():
                    self._stored[key.rpartition("/")[0]].append(key)
        self._new: dict[str, torch.Tensor] = {}

    @property
    def cached(self) -> bool:
        """Whether the layers come from the cache file."""
        return self._handle is not None

    def get(self, name: str) -> dict[str, torch.Tensor] | None:
        """The tensors stored for layer `name`, by the part names `put` gave them; None when none are."""
        if name not in self._stored:
            return None
        return {key.rpartition("/")[2]: self._handle.get_tensor(key) for key in self._stored[name]}

    def put(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        self._new.update({f"{name}/{part}": tensor.contiguous() for part, tensor in tensors.items()})

    def save(self) -> None:
        """Write what this load prepared (nothing when everything came from the cache)."""
        if self._new:
            kept = {key: self._handle.get_tensor(key) for keys in self._stored.values() for key in keys} if self.cached else {}
            tensors = kept | self._new
            if not write_whole(self.file, lambda path: save_file(tensors, path, metadata={"fingerprint": self.fingerprint})):
                # a full disk or a read-only cache costs the next load time, never this one
                warnings.warn(f"could not keep prepared layers in {self.file}; the next load prepares them again",
                              RuntimeWarning, stacklevel=2)
        self._new, self._handle = {}, None


class Int8Store:
    """`linear(name, weight, bias)`: an `Int8Linear` from the cache, or quantized from `weight()` and kept for `save()`."""

    def __init__(self, folder: str | Path, root: Path | None = None):
        folder = Path(folder).resolve()
        file = cache_file("int8", folder) if root is None else root / cache_file("int8", folder).name
        self.cache = LayerCache(file, files_stamp(INT8_FORMAT, files=sorted(folder.glob("*.safetensors"))))

    @property
    def cached(self) -> bool:
        return self.cache.cached

    def linear(self, name: str, weight: Callable[[], torch.Tensor], bias: torch.Tensor | None) -> Int8Linear:
        stored = self.cache.get(name)
        if stored is None:
            q, scales = quantize_per_channel(weight())  # [out, in] int8, [out] float32
            stored = {"q": q, "scales": scales}
            self.cache.put(name, stored)
        return Int8Linear(stored["q"], stored["scales"], bias)

    def save(self) -> None:
        self.cache.save()


class KQuantStore:
    """`tiles(name, weight)`: a k-quant layer's `KQuantTiles` from the cache, or repacked from `weight()` and
    kept for `save()`; a float weight (a k-quant file may hold some) comes back as the tensor it is."""

    def __init__(self, gguf: str | Path, build: str, requantized: bool):
        gguf = Path(gguf).resolve()
        file = cache_file("kquant-tiles", gguf)
        requantizing = f"requantized v{REQUANTIZE_VERSION}" if requantized else "the file's blocks"
        self.cache = LayerCache(file, files_stamp(KQUANT_FORMAT, build, requantizing, files=[gguf]))

    @property
    def cached(self) -> bool:
        return self.cache.cached

    def tiles(self, name: str, weight: Callable[[], KQuantWeight | list[KQuantWeight] | torch.Tensor]):
        stored = self.cache.get(name)
        if stored is not None:
            return KQuantTiles.from_tensors(stored)
        w = weight()
        if isinstance(w, torch.Tensor):
            return w
        tiles = KQuantTiles.repack(w)
        self.cache.put(name, tiles.tensors())
        return tiles

    def save(self) -> None:
        self.cache.save()
