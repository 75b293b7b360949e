"""A row-invariant linear layer for a verifying target on a GPU: y = x Wᵀ (+ b) in one Triton kernel whose
blocking never depends on the rows.

cuBLAS picks its kernel by shape, and may pick a matrix-vector kernel for one row and matrix kernels of several
tilings for more (whether it does depends on the card, the library and the shapes: BENCHMARKS.md "GPU"). Where it
does, a position's logits change with the number of positions its forward holds, and greedy speculation parts from
plain decoding wherever a near tie flips. This kernel multiplies tiles of `TILE_ROWS` rows (the
missing rows of the last tile read as zeros) in blocks fixed by the weight's shape alone, so row i's sums run
in the same order in every call whatever the other rows hold, and a call of one row costs what one of sixteen
does (the weight is read once; the matrix units idle either way). Every call takes it: a decode step, a
verification, a server's batch of requests' rows and a prompt alike, so a position gets the same bits
whichever of them computes it (a long prompt pays for it: each tile of 16 rows reads the weight again).

Not the default until a GPU measures it against cuBLAS (`benchmarks/gpu/linear_widths.py` times both;
`VERISPEC_CUDA_KERNELS=rows` turns it on for a target's layers: `linear.PackedLinear`). Under
`TRITON_INTERPRET=1` (Triton's CPU interpreter, which the tests use) the dot is float32 products summed row
by row: the interpreter's bfloat16 dot returns garbage, and its float32 dot (numpy's) sums a row differently
by its place in the tile (the GPU tests check that the matrix units do not).
"""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["TILE_ROWS", "RowsLinear", "dot_precision", "row_kernels_wanted"]

TILE_ROWS = 16  # the rows of every tile: the smallest a matrix-unit dot takes
BLOCK_K = 64  # the reduction's block: every shipped model's widths are multiples of it (masked otherwise)


def row_kernels_wanted(device: torch.device) -> bool:
    """Whether a verifying target on `device` runs verispec's row-invariant kernels (`VERISPEC_CUDA_KERNELS=rows`,
    a CUDA device or Triton's CPU interpreter, Triton importable): its linears `RowsLinear`, its attention
    `cuda_attention.static_attention`."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # the tests run the kernels on a CPU
    if (device.type != "cuda" and not interpreted) or os.environ.get("VERISPEC_CUDA_KERNELS", "torch") != "rows":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernel():
    """The Triton kernel, defined on first use (Triton is imported only where a layer runs it)."""
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["rows"])  # one compiled kernel for every row count (Triton would fold rows == 1)
    def rows_linear(x, w, b, y, rows, n, k, x_stride, w_stride, y_stride, HAS_BIAS: tl.constexpr, WIDEN: tl.constexpr,
                    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        row = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] this program's rows
        col = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] its output columns
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, k, BLOCK_K):
            depth = start + tl.arange(0, BLOCK_K)  # [BLOCK_K]
            xs = tl.load(x + row[:, None] * x_stride + depth[None, :],
                         mask=(row[:, None] < rows) & (depth[None, :] < k), other=0.0)  # [BLOCK_M, BLOCK_K]
            ws = tl.load(w + col[:, None] * w_stride + depth[None, :],
                         mask=(col[:, None] < n) & (depth[None, :] < k), other=0.0)  # [BLOCK_N, BLOCK_K]
            if WIDEN:  # the interpreter: float32 products summed per row (its dot is numpy's)
                acc += tl.sum(xs.to(tl.float32)[:, None, :] * ws.to(tl.float32)[None, :, :], 2)
            else:
                acc = tl.dot(xs, tl.trans(ws), acc, input_precision=PRECISION)  # [BLOCK_M, BLOCK_N] float32
        if HAS_BIAS:
            acc += tl.load(b + col, mask=col < n, other=0.0).to(tl.float32)[None, :]
        tl.store(y + row[:, None] * y_stride + col[None, :], acc.to(y.dtype.element_ty),
                 mask=(row[:, None] < rows) & (col[None, :] < n))

    return rows_linear


def dot_precision(dtype: torch.dtype) -> str:
    """How a Triton dot multiplies `dtype` operands: float32 in full ("ieee"; Triton's default, tf32, keeps 10
    bits of mantissa where cuBLAS keeps all 23), half types on the matrix units as they are."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_n(out_features: int, processors: int) -> int:
    """The widest column block (64, 32 or 16) that still gives every multiprocessor a program."""
    return next((block for block in (64, 32) if -(-out_features // block) >= processors), 16)


class RowsLinear:
    """y = x Wᵀ + b with W [out, in] on the GPU, x [rows ≥ 1, in]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight.contiguous()  # [out, in]
        self.bias = bias.contiguous() if bias is not None else None  # [out]
        self.out_features, self.in_features = weight.shape
        device = weight.device
        processors = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
        self.block_n = _block_n(self.out_features, processors)  # fixed by the weight: the same blocking for any rows
        self.widen = os.environ.get("TRITON_INTERPRET") == "1"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x [rows, in] -> [rows, out]
        rows = x.shape[0]
        if rows < 1:
            raise ValueError(f"RowsLinear takes one row or more, got {rows}")
        x = x.contiguous()
        y = torch.empty(rows, self.out_features, dtype=x.dtype, device=x.device)
        grid = (-(-self.out_features // self.block_n), -(-rows // TILE_ROWS))
        _kernel()[grid](x, self.weight, self.bias if self.bias is not None else self.weight, y, rows, self.out_features,
                        self.in_features, x.stride(0), self.weight.stride(0), y.stride(0), HAS_BIAS=self.bias is not None,
                        WIDEN=self.widen, PRECISION=dot_precision(x.dtype), BLOCK_M=TILE_ROWS, BLOCK_N=self.block_n, BLOCK_K=BLOCK_K, num_warps=4, num_stages=4)
        return y
