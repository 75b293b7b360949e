"""Int8 linear layers: per-output-channel symmetric weights, activations quantized on the fly.

Uses PyTorch's quantized dynamic linear (fbgemm / x86 engine: int8 weights prepacked once,
activations quantized per call, fp32 out), the kernel behind `quantize_dynamic`. On the AVX2-only
CPU this project runs on, oneDNN cannot pack bf16, and `torch._weight_int8pack_mm` measured 2–6×
slower than packed fp32 (its CPU kernel is not tuned for small batches), while the dynamic int8
linear reads a quarter of the fp32 bytes and ran at about half the fp32 time for the 0.5B draft's
MLP shapes. Rounding changes the draft's logits slightly; the target still verifies, so decoding
stays lossless — only α can move, which `verispec design` measures.
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["Int8Linear", "int8_available"]


def int8_available() -> bool:
    return hasattr(torch.ops.quantized, "linear_dynamic") and bool(torch.backends.quantized.supported_engines)


class Int8Linear:
    """y ≈ x Wᵀ + b with W [out, in] stored as int8 with one fp32 scale per output row."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        weight = weight.detach().float()
        self.out_features, self.in_features = weight.shape
        scales = (weight.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()  # [out]
        zero_points = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensor creation warns about a future deprecation
            warnings.simplefilter("ignore")
            quantized = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(quantized, None if bias is None else bias.float())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x [rows, in] (float32) -> [rows, out]
        return torch.ops.quantized.linear_dynamic(x.float(), self.packed, True)
