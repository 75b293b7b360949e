"""Row-invariant attention for a target's GPU steps: queries over a KV storage under a mask, in one Triton kernel
whose blocking never depends on the queries.

`scaled_dot_product_attention` chooses its kernel and blocking by the number of queries, so a position's
attention output changes with the positions its forward holds (`benchmarks/gpu/linear_widths.py` records
whether it does), and in a replayed step it runs over the whole storage whatever part of it holds keys. Here
each program takes one query head and a tile of `TILE_ROWS` queries (missing rows zero, never stored) and
walks the storage in blocks of `BLOCK_KV` slots, from slot 0 up to the last slot its tile's queries write,
with an online softmax. A query's sums therefore run in the same order whether it is a decode step's only
query, one of a verification's or of a prompt's: a block it sees nothing of leaves its running sums bit for
bit as they were, so walking further for a later query of its tile changes nothing, and the storage's
capacity past the step costs nothing. With the row-invariant linears (`cuda_linear.py`) a target's decode
steps, verifications and prompts give a position the same logits.

Turned on with the linears (`VERISPEC_CUDA_KERNELS=rows`; `Transformer._attend_rows` calls it). Under
`TRITON_INTERPRET=1` the dots are float32 products summed row by row, as in `cuda_linear.py`.
"""

from __future__ import annotations

import functools
import math
import os

import torch

from verispec.models.cuda_linear import TILE_ROWS, dot_precision

__all__ = ["BLOCK_KV", "static_attention", "supports"]

BLOCK_KV = 64  # storage slots per block of the walk
MASKED = -1.0e30  # a masked score: finite, so a block with nothing visible yet leaves no NaN behind


def supports(head_dim: int) -> bool:
    """Whether the kernel takes a model's heads: a power-of-two head size of 16 or more (the tile's width)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n"])  # one compiled kernel for any number of queries
    def attend(q, k, v, visible, slots, out, n, group, scale, q_head, q_row, k_head, k_slot, v_head, v_slot, visible_row,
               out_head, out_row, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_KV: tl.constexpr,
               WIDEN: tl.constexpr, PRECISION: tl.constexpr, MASKED: tl.constexpr):
        head = tl.program_id(0)
        kv_head = head // group  # grouped-query attention: `group` query heads share a key/value head
        row = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] this program's queries
        dim = tl.arange(0, HEAD_DIM)  # [HEAD_DIM]
        queries = tl.load(q + head * q_head + row[:, None] * q_row + dim[None, :], mask=row[:, None] < n, other=0.0)
        last = tl.minimum(tl.program_id(1) * BLOCK_M + BLOCK_M, n) - 1  # the tile's last query
        end = (tl.load(slots + last) + 1).to(tl.int32)  # one past its slot: no query of the tile sees beyond
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
                products = tl.dot(queries, tl.trans(keys), input_precision=PRECISION)
            scores = tl.where(seen, products * scale, MASKED)  # [BLOCK_M, BLOCK_KV]
            new_best = tl.maximum(best, tl.max(scores, 1))
            weights = tl.where(seen, tl.exp(scores - new_best[:, None]), 0.0)  # [BLOCK_M, BLOCK_KV]
            correction = tl.exp(best - new_best)  # [BLOCK_M]: 1 where this block raised nothing
            total = total * correction + tl.sum(weights, 1)
            if WIDEN:
                acc = acc * correction[:, None] + tl.sum(weights[:, :, None] * values.to(tl.float32)[None, :, :], 1)
            else:
                rescaled = acc * correction[:, None]  # [BLOCK_M, HEAD_DIM]
                acc = tl.dot(weights.to(values.dtype), values, rescaled, input_precision=PRECISION)
            best = new_best
        result = acc / tl.maximum(total, 1e-30)[:, None]  # a row beyond n has total 0 (and is not stored)
        tl.store(out + head * out_head + row[:, None] * out_row + dim[None, :], result.to(out.dtype.element_ty),
                 mask=row[:, None] < n)

    return attend


def static_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
                     slots: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Attention of q [heads, n, head_dim] over a storage keys, values [kv_heads, capacity, head_dim] where
    visible [n, ≥ slots[-1] + 1] (bool) says which slots each query sees, the queries' own keys at slots [n]
    (ascending, and no query sees past its own slot) -> [heads, n, head_dim] in q's dtype. A power-of-two head size."""
    heads, n, head_dim = q.shape
    if n < 1 or not supports(head_dim):
        raise ValueError(f"static_attention takes one query or more of a power-of-two head size ≥ 16, got {n} of {head_dim}")
    if keys.stride(-1) != 1 or values.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("static_attention needs the head dimension contiguous")
    visible = visible.contiguous()
    out = torch.empty(heads, n, head_dim, dtype=q.dtype, device=q.device)
    _kernel()[(heads, -(-n // TILE_ROWS))](
        q, keys, values, visible, slots, out, n, heads // keys.shape[0], scale or 1.0 / math.sqrt(head_dim),
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1), visible.stride(0),
        out.stride(0), out.stride(1), HEAD_DIM=head_dim, BLOCK_M=TILE_ROWS, BLOCK_KV=BLOCK_KV,
        WIDEN=os.environ.get("TRITON_INTERPRET") == "1", PRECISION=dot_precision(q.dtype), MASKED=MASKED, num_warps=4,
        num_stages=2)
    return out
