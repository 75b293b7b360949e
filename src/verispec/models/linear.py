"""Linear layers with weights prepacked once for the CPU's small-batch matmul kernels.

Plain `F.linear` re-lays the weight out on every call, so on a CPU its cost grows quickly with the
rows of the call; the same weight prepacked once for oneDNN stays close to its one-row cost for a
few rows, in fp32 and (where oneDNN packs it) bf16. Verification of γ+1 positions is therefore
nearly as cheap as one decode step only with packed weights (BENCHMARKS.md#avx2-verification-cost-tn).
Elsewhere (GPU, or a torch build without oneDNN) the layer falls back to `F.linear`, and so do tiny
layers laid out for one row (under `MIN_PACKED_WEIGHTS` weights), where oneDNN's fixed cost per call
exceeds the matmul itself. oneDNN packs bf16 weights only on CPUs with AVX-512 or AVX-NE-CONVERT; on an AVX2-only CPU
(e.g. some AMD EPYC machines) a bf16 layer stays plain `F.linear`.

oneDNN lays a packed weight out for an expected number of rows (`rows`), and the choice matters on
an AVX2 CPU: packed for 1 row, a matrix-vector kernel serves one position well but falls off a cliff
at the second; packed for a few rows, one position costs slightly more and 2–8 positions far less
(BENCHMARKS.md#avx2-verification-cost-tn). So a draft, which decodes one token at a time, packs for
1 row and a target, which verifies γ+1 positions at once, for `VERIFY_ROWS`.

A layer laid out for several rows (a target's) is also row-invariant: row i of its output is the
same bits whatever other rows the call holds, so a request's logits do not change when the server
verifies other requests' rows in the same pass. `F.linear` (MKL) is not: it sums a row in another
order for 1, 2–3 and ≥ 4 rows, and multithreaded also by the row's position. oneDNN's kernels on a
packed weight give a row the same bits in every call of ≥ 2 rows, at any row count, position and
thread count; one row alone is the same on AVX2, but on AVX-512 it takes a matrix-vector kernel that
rounds differently (measured with torch 2.13 / oneDNN 3.12; `tests/test_row_invariance.py` checks
it on the machine at hand, at 1–40 rows, in fp32 and bf16). So such a layer always runs oneDNN, tiny
layers too (their fixed cost per call, ~20 µs, is what invariance costs on toy models), and a
one-row call runs as two rows (the row twice): as fast, within noise (Qwen2.5-1.5B's four layer
shapes, one thread, best of 40: two rows 13.8 ms, one row 13.9 ms on AVX-512; 11.5 and 11.3 ms with
oneDNN held to AVX2). Where oneDNN cannot pack (bf16 without AVX-512, no mkldnn) the layer runs
`F.linear`, and row invariance is not promised (`row_invariant` is False).

On a GPU a target's layer runs `F.linear` (cuBLAS), or, with `VERISPEC_CUDA_KERNELS=rows`, the Triton kernel of
`cuda_linear.py`: row-invariant at any row count (a decode step, a verification, a server's batch and a prompt
give a position the same bits), a tile of 16 rows as cheap as one row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from verispec.models.cuda_linear import RowsLinear, row_kernels_wanted

__all__ = ["PackedLinear", "packing_available", "MIN_PACKED_WEIGHTS", "VERIFY_ROWS"]

MIN_PACKED_WEIGHTS = 1 << 16
VERIFY_ROWS = 4  # the rows a verifying target packs for (BENCHMARKS.md#avx2-verification-cost-tn)


def packing_available() -> bool:
    # hasattr: a torch op this build may lack
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear:
    """y = x Wᵀ + b with W [out, in] prepacked for oneDNN when on CPU, laid out for `rows` rows per call
    (rows > 1: also row-invariant where oneDNN packs it, see the module docstring)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True, rows: int = 1):
        self.out_features, self.in_features = weight.shape
        self.bias = bias.contiguous() if bias is not None else None
        # bytes as stored, packed or not (the weights every call reads)
        self.nbytes = (weight.numel() + (bias.numel() if bias is not None else 0)) * weight.element_size()
        big = weight.numel() >= MIN_PACKED_WEIGHTS
        self.row_invariant = rows > 1  # packed whatever its size, and never called with a single row
        self.weight = weight.contiguous()
        self.rows_kernel = RowsLinear(self.weight, self.bias) if rows > 1 and row_kernels_wanted(weight.device) else None
        self.packed = (pack and (big or self.row_invariant) and weight.device.type == "cpu" and packing_available()
                       and self.rows_kernel is None)
        if self.packed:
            try:
                self.weight = torch.ops.mkldnn._reorder_linear_weight(self.weight, rows)
            except RuntimeError:  # this CPU lacks the instructions oneDNN needs for this dtype
                self.packed = False
        self.row_invariant = self.row_invariant and (self.packed or self.rows_kernel is not None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x [rows, in] -> [rows, out]
        if self.rows_kernel is not None:
            return self.rows_kernel(x)
        if not self.packed:
            return F.linear(x, self.weight, self.bias)
        if self.row_invariant and x.shape[0] == 1:  # oneDNN's multi-row kernel, as in any batched pass
            return torch.ops.mkldnn._linear_pointwise(x.expand(2, -1).contiguous(), self.weight, self.bias, "none", [], "")[:1]
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
