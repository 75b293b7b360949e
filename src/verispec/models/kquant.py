"""Linear layers on a GGUF file's own k-quant blocks: the kernels of the `kquant` precision.

A Q4_K_M file keeps most weights as Q4_K (256-weight super-blocks: a float16 scale d and min dmin,
eight 6-bit sub-block scales and mins, 4-bit values) and some as Q6_K (a float16 d, sixteen int8
sub-block scales, 6-bit values). `kquant` runs those very blocks, so the model is the file the user
chose, not a requantized copy. Each input row is quantized per 256 values as llama.cpp's Q8_K is
(d = absmax / 127, q = round(x / d), rounding half to even), and a super-block's contribution to
output column n is

    Q4_K:  d_n · d_x · Σ_j sc_nj · Σ_{k∈j} w_k q_k  −  dmin_n · d_x · Σ_j m_nj · Σ_{k∈j} q_k
    Q6_K:  d_n · d_x · Σ_j sc_nj · Σ_{k∈j} (w_k − 32) q_k

with the inner sums in int32 (exact) and the float terms added block after block by fused
multiply-adds, row by row. So a row's output is the same bits whatever other rows the call holds:
greedy speculative decoding on this path is token-identical to greedy plain decoding of the same path,
at every verification width, trees included.

Why its own kernel: ggml unpacks the 4-bit blocks again for every row, so verifying n positions costs
nearly n decode steps on a 2-core CPU, and no library kernel measured (ik_llama.cpp, onnxruntime's
MatMulNBits, OpenVINO, torchao) is both as fast as llama.cpp for one row and flat for several
(BENCHMARKS.md, "4-bit kernels that could verify flat"). `kernels/kquant.cpp` repacks the blocks once
into tiles of 16 output columns and multiplies a tile with up to 8 rows per pass through AVX-512 VNNI dot
products, or AVX2 multiply-adds (`vpmaddubsw`, `vpmaddwd`) on CPUs without them; elsewhere it runs
portable C++. On AMX CPUs 9 rows and more (a prefill, wide verification) take tile multiplies with the
sub-block scales folded into the weights, the same integer sums. All of them give the same bits.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from dataclasses import dataclass

import torch

from verispec.errors import InvalidParameterError, ModelNotFoundError
from verispec.models.kernels import build_key, extension
from verispec.paths import cpu_key, read_table, store_in_table
from verispec.progress import status

__all__ = ["KQUANT_TYPES", "KQuantWeight", "KQuantTiles", "KQuantLinear", "KQuantEmbedding", "concat_rows", "kquant_kernels", "kquant_suits",
           "read_padding_whole", "settle_padding", "settle_prefetch"]

KQUANT_TYPES = {"Q4_K": 12, "Q6_K": 14}  # ggml type name -> type number (what the kernels take)
TILE_COLUMNS = 16  # output columns per packed tile (`kCols` in kernels/kquant.cpp)


KERNELS_VARIABLE = "VERISPEC_KQUANT_KERNELS"  # amx, avx512, avx2 or portable: run those (the fastest built when unset)


def kquant_kernels():
    """The compiled kernels (`kernels/kquant.cpp`), running the code $VERISPEC_KQUANT_KERNELS names (to time
    what another CPU runs: AVX2 on an AVX-512 machine), else the fastest built. ModelNotFoundError when they
    cannot be built (kquant has no torch fallback), InvalidParameterError for kernels not built here."""
    module = extension("kquant")
    if module is None:
        raise ModelNotFoundError("the kquant precision needs its C++ kernels, which could not be built here "
                                 "(a C++ compiler and ninja are required); use --dtype gguf")
    wanted = os.environ.get(KERNELS_VARIABLE)
    if wanted and wanted != module.kernels_in_use():
        if wanted not in module.kernels_built():
            raise InvalidParameterError(f"{KERNELS_VARIABLE}={wanted}: the kquant kernels built on this CPU are "
                                        f"{', '.join(module.kernels_built())}")
        module.use_kernels(wanted)
    return module


KERNEL_CHOICES = "kernel_choices.json"  # choices measured on this CPU, per kernel build (the cache directory's table)
# Prefetching for one or two rows is measured on a model that streams its weights from memory wherever it loads:
# larger than the largest L3 measured (480 MiB on the AMX Xeon; the shipped 1.5B's layers hold 1.0 GB)
PREFETCH_MEASURED_FROM = 512 << 20
SWITCH_GAIN = 0.97  # a switch's layers must take this share or less of the time with it to turn it on (an A/A moves ~1 %)
SUPER_BLOCK = 256  # inputs per k-quant super-block: a layer whose inputs are not a multiple is padded (`requantize.py`)


def settle_prefetch(linears: list, linear_bytes: int) -> bool:
    """Whether the vector kernels prefetch the weight stream for one and two rows (`set_prefetch_few_rows`; the AVX-512
    code always does from three, the AVX2 code never): on the AMX Xeon that lost, on the Zen 5 EPYC it gained
    (BENCHMARKS.md), so it is measured on the first model loaded with `linear_bytes` ≥ PREFETCH_MEASURED_FROM
    (`settle_switch`); a smaller model takes the kept choice, or none. The same bits either way."""
    module = kquant_kernels()
    if module.kernels_in_use() == "portable":  # the portable code never prefetches
        return module.set_prefetch_few_rows(False)
    return settle_switch("prefetch_few_rows", module.set_prefetch_few_rows, linears, linear_bytes >= PREFETCH_MEASURED_FROM,
                         "prefetching", default=False)


def settle_padding(linears: list) -> bool:
    """Whether the kernels skip a padded layer's sub-blocks past its input (`set_skip_padding`: fewer bytes, a hole in
    the weight stream at every tile): on the AMX Xeon skipping gained, on the Zen 5 EPYC reading the zeros too was
    faster (BENCHMARKS.md), so it is measured on the padded layers of the first model that has some (a requantized
    draft's, `settle_switch`), skipping kept unless reading them whole is faster. The same bits either way."""
    padded = [layer for layer in linears if layer.in_features % SUPER_BLOCK]
    return not settle_switch("read_padding", read_padding_whole, padded, bool(padded), "reading of padded layers", default=False)


def read_padding_whole(on: bool) -> bool:
    """The padding switch as `settle_padding` measures it: on, the kernels read a padded layer's sub-blocks past its
    input too (`set_skip_padding(False)`); returns whether they do."""
    return not kquant_kernels().set_skip_padding(not on)


def settle_switch(name: str, switch, linears: list, measure: bool, what: str, default: bool) -> bool:
    """A kernel switch's setting on this CPU (`switch(on)` sets it and returns it): the kept choice for this CPU kind,
    kernels, build and thread count (the cache directory's KERNEL_CHOICES), else measured on `linears` where `measure`
    (`switch_pays`) and kept, else `default`."""
    module = kquant_kernels()
    key = f"{name}|{build_key('kquant')}|{module.kernels_in_use()}|threads={torch.get_num_threads()}|cpu={cpu_key()}"
    choice = read_table(KERNEL_CHOICES).get(key)
    if choice is None and measure:
        with status(f"measuring the kquant kernels' {what} (once per CPU kind)"):
            on, ratio = switch_pays(switch, linears)
        choice = {"on": on, "ratio": round(ratio, 4)}
        with contextlib.suppress(OSError):  # a cache directory that cannot be written: the choice holds for this process
            store_in_table(KERNEL_CHOICES, key, choice)
    return switch(bool(choice["on"]) if choice else default)


def switch_pays(switch, linears: list, rounds: int = 7) -> tuple[bool, float]:
    """(whether to turn the switch on, the median seconds of one row through every layer of `linears` with it on over
    off), the two timed in turns (their order alternating) so a shared CPU's drift touches both alike; off after."""
    inputs = [torch.randn(1, layer.in_features) for layer in linears]
    seconds: dict[bool, list[float]] = {False: [], True: []}
    try:
        for round_ in range(rounds):
            for on in (False, True) if round_ % 2 == 0 else (True, False):
                switch(on)
                start = time.perf_counter()
                for layer, x in zip(linears, inputs):
                    layer(x)
                seconds[on].append(time.perf_counter() - start)
    finally:
        switch(False)
    ratio = statistics.median(seconds[True]) / statistics.median(seconds[False])
    return ratio <= SWITCH_GAIN, ratio


def kquant_suits(path) -> bool:
    """Whether kquant runs the GGUF file at `path` fast here: its kernels built with AVX-512 VNNI or AVX2
    (the portable code is exact but slow) and a qwen2/llama file of Q4_K/Q6_K (and float) tensors."""
    from verispec.models.gguf_weights import kquant_runs

    module = extension("kquant")
    return module is not None and module.kernels_built()[0] != "portable" and kquant_runs(path)


@dataclass(frozen=True)
class KQuantWeight:
    """One GGUF tensor's blocks: `raw` uint8 [rows, blocks × block bytes] (a row per output feature),
    of ggml type `kind` (12 Q4_K, 14 Q6_K), each row `cols` weights wide (a requantized row's blocks
    may hold zeros past `cols`, up to whole super-blocks: `models/requantize.py`)."""

    kind: int
    raw: torch.Tensor
    cols: int

    @property
    def rows(self) -> int:
        return self.raw.shape[0]

    @property
    def device(self) -> torch.device:
        return self.raw.device


def concat_rows(*weights):
    """Weights stacked along their output rows: a float tensor for float weights (torch.cat), the list of
    parts for k-quant weights (a layer keeps each part's own block type; q, k and v often differ)."""
    if all(isinstance(w, torch.Tensor) for w in weights):
        return torch.cat(weights)
    if not all(isinstance(w, KQuantWeight) for w in weights):
        raise TypeError("a layer's parts must be all float tensors or all k-quant blocks")
    return list(weights)


@dataclass(frozen=True)
class KQuantTiles:
    """A layer's blocks repacked for the kernels (once per file: `layer_cache.KQuantStore` keeps them): per
    part (a fused layer's q, k and v) its ggml type, its output columns and its tiles of 16 columns, uint8
    [bytes]; every part takes `in_features` inputs."""

    kinds: list[int]
    columns: list[int]
    in_features: int
    packed: list[torch.Tensor]

    @classmethod
    def repack(cls, weight: KQuantWeight | list[KQuantWeight]) -> KQuantTiles:
        parts = weight if isinstance(weight, list) else [weight]
        widths = {part.cols for part in parts}
        if len(widths) != 1:
            raise ValueError(f"the parts of a k-quant layer take one input width, not {sorted(widths)}")
        repack = kquant_kernels().repack
        return cls([p.kind for p in parts], [p.rows for p in parts], widths.pop(), [repack(p.kind, p.raw) for p in parts])

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tiles as named tensors (what a cache file stores): "layout" int64 [parts, 3] (kind, columns,
        in_features), "tiles{i}" each part's bytes."""
        layout = torch.tensor([[kind, columns, self.in_features] for kind, columns in zip(self.kinds, self.columns)])
        return {"layout": layout, **{f"tiles{i}": packed for i, packed in enumerate(self.packed)}}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> KQuantTiles:
        layout = tensors["layout"].tolist()
        return cls([row[0] for row in layout], [row[1] for row in layout], layout[0][2],
                   [tensors[f"tiles{i}"] for i in range(len(layout))])


class KQuantLinear:
    """y = x Wᵀ + b through k-quant blocks: x [rows, in] float32 -> [rows, Σ parts' rows] float32."""

    def __init__(self, weight: KQuantWeight | list[KQuantWeight] | KQuantTiles, bias: torch.Tensor | None = None):
        tiles = weight if isinstance(weight, KQuantTiles) else KQuantTiles.repack(weight)
        self.in_features, self.kinds, self.columns = tiles.in_features, tiles.kinds, tiles.columns
        self.packed = tiles.packed  # tiles of 16 columns, uint8 [bytes]
        self.bias = None if bias is None else bias.float().contiguous()  # [out]
        self.out_features = sum(self.columns)
        self._linear = kquant_kernels().linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x [rows, in] -> [rows, out]
        if x.shape[-1] != self.in_features:
            raise ValueError(f"this k-quant layer takes {self.in_features} inputs, not {x.shape[-1]}")
        return self._linear(x, self.packed, self.kinds, self.columns, self.bias)

    def first_columns(self, n: int) -> KQuantLinear:
        """This layer cut to its first n outputs (a head that scores only ids < n), sharing the packed
        tiles: a tile holds TILE_COLUMNS whole columns, so the cut is a view of the first tiles."""
        if len(self.packed) != 1 or not 1 <= n <= self.out_features:
            raise ValueError(f"a one-part layer keeps 1 … {self.out_features} columns, not {n}")
        cut = object.__new__(KQuantLinear)
        cut.__dict__.update(self.__dict__)
        tiles, all_tiles = -(-n // TILE_COLUMNS), -(-self.out_features // TILE_COLUMNS)
        cut.packed = [self.packed[0][: self.packed[0].numel() // all_tiles * tiles]]
        cut.columns, cut.out_features = [n], n
        cut.bias = None if self.bias is None else self.bias[:n]
        return cut

    @property
    def nbytes(self) -> int:
        return sum(p.numel() for p in self.packed) + (0 if self.bias is None else self.bias.numel() * 4)


class KQuantEmbedding:
    """Token embeddings kept as their k-quant blocks; a lookup dequantizes only the rows it reads."""

    def __init__(self, weight: KQuantWeight):
        self.weight = weight
        self._dequantize = kquant_kernels().dequantize

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:  # tokens [N] -> [N, hidden] float32
        rows = self._dequantize(self.weight.kind, self.weight.raw[tokens.cpu()])  # [N, whole super-blocks]
        return rows if rows.shape[1] == self.weight.cols else rows[:, : self.weight.cols].contiguous()

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def nbytes(self) -> int:
        return self.weight.raw.numel()

