"""Linear layers with weights prepacked once for the CPU's small-batch matmul kernels.

Plain `F.linear` re-lays the weight out on every call, so on a CPU its cost grows quickly with the
rows of the call; the same weight prepacked once for oneDNN stays close to its one-row cost for a
few rows, in fp32 and (where oneDNN packs it) bf16. Verification of γ+1 positions is therefore
nearly as cheap as one decode step only with packed weights (BENCHMARKS.md#avx2-verification-cost-tn).
Elsewhere (GPU, or a torch build without oneDNN) the layer falls back to `F.linear`, and so do tiny
layers (under `MIN_PACKED_WEIGHTS` weights), where oneDNN's fixed cost per call exceeds the matmul
itself. oneDNN packs bf16 weights only on CPUs with AVX-512 or AVX-NE-CONVERT; on an AVX2-only CPU
(e.g. some AMD EPYC machines) a bf16 layer stays plain `F.linear`.

oneDNN lays a packed weight out for an expected number of rows (`rows`), and the choice matters on
an AVX2 CPU: packed for 1 row, a matrix-vector kernel serves one position well but falls off a cliff
at the second; packed for a few rows, one position costs slightly more and 2–8 positions far less
(BENCHMARKS.md#avx2-verification-cost-tn). So a draft, which decodes one token at a time, packs for
1 row and a target, which verifies γ+1 positions at once, for `VERIFY_ROWS`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["PackedLinear", "packing_available", "MIN_PACKED_WEIGHTS", "VERIFY_ROWS"]

MIN_PACKED_WEIGHTS = 1 << 16
VERIFY_ROWS = 4  # the rows a verifying target packs for (BENCHMARKS.md#avx2-verification-cost-tn)


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear:
    """y = x Wᵀ + b with W [out, in] prepacked for oneDNN when on CPU, laid out for `rows` rows per call."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True, rows: int = 1):
        self.out_features, self.in_features = weight.shape
        self.bias = bias.contiguous() if bias is not None else None
        big = weight.numel() >= MIN_PACKED_WEIGHTS
        self.packed = pack and big and weight.device.type == "cpu" and packing_available()
        self.weight = weight.contiguous()
        if self.packed:
            try:
                self.weight = torch.ops.mkldnn._reorder_linear_weight(self.weight, rows)
            except RuntimeError:  # this CPU lacks the instructions oneDNN needs for this dtype
                self.packed = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x [rows, in] -> [rows, out]
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
