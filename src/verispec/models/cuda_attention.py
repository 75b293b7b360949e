"""Row-invariant attention for a replayed GPU step: up to `MAX_ROWS` queries over a pooled KV storage under a
mask, in one Triton kernel whose blocking never depends on the queries.

`scaled_dot_product_attention` chooses its kernel and blocking by the number of queries, so a position's
attention output changes with the positions its forward holds (`benchmarks/gpu/linear_widths.py` records
whether it does), and it runs over the whole storage whatever part of it holds keys. This kernel gives every
query head one program that walks the storage in blocks of `BLOCK_KV` slots from slot 0 up to the step's last
new slot, with an online softmax; the queries of a step are one tile of `MAX_ROWS` rows (missing rows zero,
never stored). A query's sums therefore run in the same order whether it is a decode step's only row or one
of a verification's rows (a fully masked block leaves its running sums bit for bit as they were), and the
storage's capacity and the slots past the step cost nothing. With the row-invariant linears
(`cuda_linear.py`) a target's replayed decode and verification steps give a position the same logits.

Turned on with the linears (`VERISPEC_CUDA_KERNELS=rows`; `Transformer.forward_static` calls it). Under
`TRITON_INTERPRET=1` the dots are float32 products summed row by row, as in `cuda_linear.py`.
"""

from __future__ import annotations

import functools
import math
import os

import torch

from verispec.models.cuda_linear import MAX_ROWS

__all__ = ["BLOCK_KV", "static_attention", "supports"]

BLOCK_KV = 64  # storage slots per block of the walk
MASKED = -1.0e30  # a masked score: finite, so a block with nothing visible yet leaves no NaN behind


def supports(head_dim: int, rows: int) -> bool:
    """Whether the kernel takes this step: a power-of-two head size (the tile's width) and ≤ MAX_ROWS queries."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and 1 <= rows <= MAX_ROWS


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n"])  # one compiled kernel for any number of queries
    def attend(q, k, v, visible, slots, out, n, group, scale, q_head, q_row, k_head, k_slot, v_head, v_slot, visible_row,
               out_head, out_row, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_KV: tl.constexpr,
               WIDEN: tl.constexpr, MASKED: tl.constexpr):
        head = tl.program_id(0)
        kv_head = head // group  # grouped-query attention: `group` query heads share a key/value head
        row = tl.arange(0, BLOCK_M)  # [BLOCK_M]
        dim = tl.arange(0, HEAD_DIM)  # [HEAD_DIM]
        queries = tl.load(q + head * q_head + row[:, None] * q_row + dim[None, :], mask=row[:, None] < n, other=0.0)
        end = (tl.load(slots + n - 1) + 1).to(tl.int32)  # one past the step's last new slot: nothing beyond it is visible
        best = tl.full((BLOCK_M,), MASKED, tl.float32)  # running max of each query's scores
        total = tl.zeros((BLOCK_M,), tl.float32)  # running sum of exp(score − best)
        acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)  # running Σ exp(score − best) · value
        for first in range(0, end, BLOCK_KV):
            slot = first + tl.arange(0, BLOCK_KV)  # [BLOCK_KV]
            keys = tl.load(k + kv_head * k_head + slot[:, None] * k_slot + dim[None, :], mask=slot[:, None] < end, other=0.0)
            values = tl.load(v + kv_head * v_head + slot[:, None] * v_slot + dim[None, :], mask=slot[:, None] < end, other=0.0)
            seen = tl.load(visible + row[:, None] * visible_row + slot[None, :],
                           mask=(row[:, None] < n) & (slot[None, :] < end), other=0) != 0  # [BLOCK_M, BLOCK_KV]
            if WIDEN:  # the interpreter: float32 products summed per row (its dot is numpy's)
                products = tl.sum(queries.to(tl.float32)[:, None, :] * keys.to(tl.float32)[None, :, :], 2)
            else:
                products = tl.dot(queries, tl.trans(keys))
            scores = tl.where(seen, products * scale, MASKED)  # [BLOCK_M, BLOCK_KV]
            new_best = tl.maximum(best, tl.max(scores, 1))
            weights = tl.where(seen, tl.exp(scores - new_best[:, None]), 0.0)  # [BLOCK_M, BLOCK_KV]
            correction = tl.exp(best - new_best)  # [BLOCK_M]: 1 where this block raised nothing
            total = total * correction + tl.sum(weights, 1)
            if WIDEN:
                acc = acc * correction[:, None] + tl.sum(weights[:, :, None] * values.to(tl.float32)[None, :, :], 1)
            else:
                acc = tl.dot(weights.to(values.dtype), values, acc * correction[:, None])  # [BLOCK_M, HEAD_DIM]
            best = new_best
        result = acc / tl.maximum(total, 1e-30)[:, None]  # a row beyond n has total 0 (and is not stored)
        tl.store(out + head * out_head + row[:, None] * out_row + dim[None, :], result.to(out.dtype.element_ty),
                 mask=row[:, None] < n)

    return attend


def static_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
                     slots: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Attention of q [heads, n, head_dim] over a storage keys, values [kv_heads, capacity, head_dim] where
    visible [n, capacity] (bool) says which slots each query sees, the step's new keys at slots [n] (ascending:
    nothing past slots[-1] is read) -> [heads, n, head_dim] in q's dtype. n ≤ MAX_ROWS, a power-of-two head size."""
    heads, n, head_dim = q.shape
    if not supports(head_dim, n):
        raise ValueError(f"static_attention takes 1…{MAX_ROWS} queries of a power-of-two head size, got {n} of {head_dim}")
    if keys.stride(-1) != 1 or values.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("static_attention needs the head dimension contiguous")
    visible = visible.contiguous()
    out = torch.empty(heads, n, head_dim, dtype=q.dtype, device=q.device)
    _kernel()[(heads,)](
        q, keys, values, visible, slots, out, n, heads // keys.shape[0], scale or 1.0 / math.sqrt(head_dim),
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1), visible.stride(0),
        out.stride(0), out.stride(1), HEAD_DIM=head_dim, BLOCK_M=MAX_ROWS, BLOCK_KV=BLOCK_KV,
        WIDEN=os.environ.get("TRITON_INTERPRET") == "1", MASKED=MASKED, num_warps=4, num_stages=2)
    return out
