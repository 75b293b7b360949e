"""Linear layers with weights prepacked once for the CPU's small-batch matmul kernels.

Measured on the 2-core CPU (one 8960×1536 layer): plain `F.linear` costs 3.0 ms for one fp32 row
and 6–10 ms for 2–8 rows, because the weight is re-laid-out on every call; the same weight
prepacked for oneDNN costs 1.7 ms for one row and 2.9 ms for eight. In bf16 prepacking halves the
single-row cost (1.36 → 0.60 ms) and keeps it flat to 8 rows. Verification of γ+1 positions is
therefore nearly as cheap as one decode step only with packed weights. Elsewhere (GPU, or a torch
build without oneDNN) the layer falls back to `F.linear`, and so do tiny layers (under 64K weights),
where oneDNN's fixed cost per call (~0.2 ms) exceeds the matmul itself. oneDNN packs bf16 weights
only on CPUs with AVX-512 or AVX-NE-CONVERT; on an AVX2-only CPU (e.g. some AMD EPYC machines) a
bf16 layer stays plain `F.linear`.

oneDNN lays a packed weight out for an expected number of rows (`rows`), and the choice matters on
this AVX2 CPU. Packed for 1 row, the 1.5B costs 272 ms for one position but 500–650 ms for 2–8
(a matrix-vector kernel that falls off a cliff at the second row); packed for 4 rows it costs
283–296 ms for one and 300–500 ms for 2–8 (BENCHMARKS.md, "Packing for the rows a forward
carries"). So a draft, which decodes one token at a time, packs for 1 row and a target, which
verifies γ+1 positions at once, for `VERIFY_ROWS`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["PackedLinear", "packing_available", "MIN_PACKED_WEIGHTS", "VERIFY_ROWS"]

MIN_PACKED_WEIGHTS = 1 << 16
VERIFY_ROWS = 4  # the rows a verifying target packs for (2–16 measure alike; 1 is the cliff)


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
