"""Int8 linear layers whose rows do not depend on each other: the kernel of the `int8` precision.

y ≈ x Wᵀ + b with W [out, in] stored as int8, one fp32 scale per output channel (symmetric,
scale = row absmax / 127), prepacked ONCE for fbgemm (PyTorch's x86 quantized backend), and the
activations quantized on the fly with one scale PER ROW:

    absmax[m] = max_k |x[m, k]|                                   # [rows, 1]
    q[m, k]   = round(x[m, k] / absmax[m] · 63) + 64   ∈ [1, 127]  # uint8, 7 bits
    acc[m, n] = Σ_k (q[m, k] − 64) · W_int8[n, k]                 # exact int32
    y[m, n]   = acc[m, n] · (1/63) · w_scale[n] · absmax[m] + b[n]

Every step is either elementwise or an exact integer sum, so row m of the result is bit-for-bit
the same whether x holds 1 row (decoding) or γ+1 rows (verifying a draft), or other requests' rows
(server batches). That is what keeps greedy speculative decoding on this path token-identical to
greedy plain decoding of the same quantized model. PyTorch's own dynamic int8 linear
(`quantized.linear_dynamic`, the kernel behind `quantize_dynamic`) takes ONE activation scale for
the whole call — the max over all rows — so a row's result there changes with the other rows.

fbgemm only offers per-tensor activation parameters, so each row is first divided by its absmax
(every row then spans [−1, 1]) and quantized with the fixed scale 1/63 and zero point 64 through
`quantized.linear_with_input_q_dq_qweight_dq_output_fp32`; the absmax is multiplied back after.
7-bit activations ([1, 127]) keep AVX2's int16 pair sums (u8·s8 + u8·s8 ≤ 127·127·2 < 2¹⁵) from
saturating, as fbgemm's own `reduce_range` does.

Why fbgemm: among the CPU int8 kernels PyTorch offers, it is the one that reads a quarter of fp32's
bytes at a fraction of packed fp32's time (`PackedLinear`) for a few rows; `torch._int_mm` and
`torch._weight_int8pack_mm` have no tuned small-batch x86 kernels and oneDNN's `qlinear_pointwise`
is no faster than fp32 (BENCHMARKS.md#avx2-int8-kernels-and-where-a-step-goes,
`benchmarks/probes/int8_kernels.py`). The elementwise work around the matmul (absmax, scaling,
rounding, the residual rows, scaling back) runs in a small C++ extension (`kernels/int8.cpp`) when
it can be built: the same float operations in the same order, so the same bits, instead of ~15
separate torch operations (its gain: the same BENCHMARKS section, `benchmarks/probes/int8_overhead.py`,
"torch" against "python"). Where fbgemm is missing (another CPU architecture), the same arithmetic
runs in float64, where integer sums of this size are exact: slow but identical in meaning.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from verispec.models.kernels import extension

__all__ = ["Int8Linear", "int8_available", "quantize_per_channel", "ACT_LEVELS", "ACT_ZERO"]

ACT_LEVELS = 63  # |q − zero point| ≤ 63: 7-bit activations
ACT_ZERO = 64
RESIDUAL_LEVELS = 126  # the rounding error (|e| ≤ 1/2 step) quantized again on 7 bits: e ≈ fine / 126


def int8_available() -> bool:
    """Whether this torch build has the fbgemm kernel (else `Int8Linear` runs its float64 fallback)."""
    return (
        "fbgemm" in torch.backends.quantized.supported_engines
        and hasattr(torch.ops.quantized, "linear_with_input_q_dq_qweight_dq_output_fp32")  # a torch op this build may lack
    )


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (q [out, in] int8 in [−127, 127], scales [out] float32)."""
    weight = weight.detach().float()
    scales = (weight.abs().amax(dim=1) / 127.0).clamp_min(1e-12)  # [out]
    q = torch.round(weight / scales[:, None]).clamp_(-127, 127).to(torch.int8)  # [out, in]
    return q, scales


class Int8Linear:
    """y ≈ x Wᵀ + b: int8 per-channel weights, per-row 7-bit activations, exact int32 sums.

    Built from quantized values (`weight_q` [out, in] int8, `scales` [out] float32, as
    `quantize_per_channel` returns them, or as read back from the int8 cache), or from float weights
    with `Int8Linear.from_float`.
    """

    def __init__(self, weight_q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                 use_fbgemm: bool | None = None, residual: bool = True):
        self.out_features, self.in_features = weight_q.shape
        self.residual = residual
        self.bias = None if bias is None else bias.detach().float().contiguous()  # [out]
        self.use_fbgemm = int8_available() if use_fbgemm is None else use_fbgemm
        if self.use_fbgemm:
            zero_points = torch.zeros(self.out_features, dtype=torch.long)
            with warnings.catch_warnings():  # quantized tensor creation warns about a future deprecation
                warnings.simplefilter("ignore")
                quantized = torch._make_per_channel_quantized_tensor(weight_q, scales.double(), zero_points, 0)
                self.packed = torch.ops.quantized.linear_prepack(quantized, None)
            self.weight_q = self.scales = None
        else:
            self.packed = None
            self.weight_q, self.scales = weight_q, scales.float()  # [out, in] int8, [out]

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, **options) -> Int8Linear:
        """Quantize W [out, in] per output channel (`quantize_per_channel`) and build the layer."""
        return cls(*quantize_per_channel(weight), bias, **options)

    @property
    def nbytes(self) -> int:
        """Bytes of the stored weights: int8 values, one fp32 scale per channel, the fp32 bias."""
        bias = 0 if self.bias is None else self.bias.numel() * 4
        return self.out_features * (self.in_features + 4) + bias

    def _integer_matmul(self, q: torch.Tensor) -> torch.Tensor:
        """Σ_k q[m, k]·W_int8[n, k]·w_scale[n] for integer-valued q [rows, in] in [−63, 63] -> [rows, out]."""
        if self.use_fbgemm:  # scale 1 and zero point 64: fbgemm's own rounding of integers is exact
            return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(q, 1.0, ACT_ZERO, self.packed)
        return (F.linear(q.double(), self.weight_q.double()) * self.scales.double()).float()  # exact sums in float64

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x [rows, in] float32 -> [rows, out] float32
        fused = extension("int8")
        if fused is not None:  # the same arithmetic as below, in two C++ calls instead of ~15 torch ops
            q, absmax = fused.split_rows(x, self.residual)  # [2·rows or rows, in], [rows, 1]
            return fused.join_rows(self._integer_matmul(q), absmax, self.bias, self.residual)
        rows = x.shape[0]
        absmax = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)  # [rows, 1]
        scaled = x / absmax * ACT_LEVELS  # [rows, in] in [−63, 63]
        coarse = torch.round(scaled)  # [rows, in] integers
        if not self.residual:
            return self._finish(self._integer_matmul(coarse.contiguous()), absmax)
        fine = torch.round((scaled - coarse) * RESIDUAL_LEVELS)  # [rows, in] integers in [−63, 63]
        acc = self._integer_matmul(torch.cat([coarse, fine]))  # [2·rows, out]: one pass over the weights
        return self._finish(acc[:rows] + acc[rows:] / RESIDUAL_LEVELS, absmax)

    def _finish(self, y: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
        y = y * (absmax / ACT_LEVELS)  # [rows, out]
        return y if self.bias is None else y + self.bias
