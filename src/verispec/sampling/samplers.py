"""Samplers: argmax, multinomial (by inverse transform) and Gumbel-max draws, and Gumbel-top-k (k distinct tokens in
one pass).

All randomness flows through an explicit `torch.Generator` owned by the request: never a global
reseed, so one seed reproduces one output. The generator lives on the target's device (`torch.Generator`
is per device); a draw over rows held elsewhere (a model-free drafter's host-side rows while the
target runs on a GPU) is made on the generator's device and returned beside the rows. On the CPU
nothing moves, so a seed gives the same output as before devices existed.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["CDF_BLOCK", "argmax", "inverse_cdf", "multinomial", "uniform", "gumbel_noise", "gumbel_max", "gumbel_topk", "without_replacement_probs"]


def argmax(scores: torch.Tensor) -> torch.Tensor:
    """[n, vocab] -> [n] (or [vocab] -> []): the first index of each row's largest value (a NaN counts as
    largest, as in torch). A float32 row on the CPU goes through numpy, several times faster than torch's
    argmax over one long vocabulary row on few cores (BENCHMARKS.md, llama.cpp parity); greedy decoding
    takes one per token."""
    if scores.device.type == "cpu" and scores.dtype == torch.float32 and not scores.requires_grad:
        return torch.from_numpy(np.asarray(np.argmax(scores.numpy(), axis=-1), dtype=np.int64))
    return scores.argmax(dim=-1)


def _draw_device(generator: torch.Generator | None, where: torch.device) -> torch.device:
    """Where a draw with `generator` must be made (its own device; None: torch's default generator of `where`)."""
    return generator.device if generator is not None else where


CDF_BLOCK = 1024  # tokens a block of `inverse_cdf`'s two-level search


def multinomial(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row from probs [n, vocab] (weights ≥ 0, any positive sum) -> [n] (on probs' device): one uniform
    draw per row from `generator`, turned into a token by `inverse_cdf`, faster than torch.multinomial over a large
    vocabulary on the CPU (`benchmarks/probes/sampler_speed.py`)."""
    device = _draw_device(generator, probs.device)
    weights = probs.to(device)
    draws = torch.rand(weights.shape[0], 1, generator=generator, device=device, dtype=torch.float64)  # [n, 1]
    return inverse_cdf(weights, draws).to(probs.device)


def inverse_cdf(weights: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """The token of each row of weights [n, vocab] whose cumulative mass first exceeds draws [n, 1] (in [0, 1)) times
    the row's total -> [n]: a draw from the row's distribution, never a token of weight 0. Two levels, so that no
    float32 running sum over the whole vocabulary rounds a token's mass: the masses of blocks of CDF_BLOCK tokens
    (pairwise sums) accumulated in float64 pick the block, a float64 running sum inside it the token. Raises
    ValueError for a negative weight or a row without positive finite mass."""
    rows, vocab = weights.shape
    blocks = -(-vocab // CDF_BLOCK)
    padded = torch.nn.functional.pad(weights.float(), (0, blocks * CDF_BLOCK - vocab)).view(rows, blocks, CDF_BLOCK)
    masses = padded.sum(-1, dtype=torch.float64)  # [n, blocks]
    ends = masses.cumsum(-1)  # [n, blocks]
    total = ends[:, -1:]  # [n, 1]
    if not bool(((total > 0) & torch.isfinite(total)).all()) or bool(padded.amin() < 0):
        raise ValueError("a distribution to sample needs weights ≥ 0 and a positive, finite total "
                         "(got a negative weight, a row of zeros, inf or NaN)")
    target = draws.to(torch.float64) * total  # [n, 1]
    # the first block whose end passes the target (rounding may put it at the end: then the last block with mass)
    block = torch.minimum(torch.searchsorted(ends, target, right=True), (ends < total).sum(-1, keepdim=True))  # [n, 1]
    before = ends.gather(1, block) - masses.gather(1, block)  # [n, 1] the mass of the blocks before it
    inside = padded.gather(1, block[:, :, None].expand(-1, -1, CDF_BLOCK)).squeeze(1).double().cumsum(-1)  # [n, CDF_BLOCK]
    last = (inside < inside[:, -1:]).sum(-1, keepdim=True)  # [n, 1] the block's last token with weight
    token = torch.minimum(torch.searchsorted(inside, (target - before).clamp(min=0), right=True), last)  # [n, 1]
    return (block * CDF_BLOCK + token).squeeze(-1)


def uniform(shape: torch.Size | tuple[int, ...] | int, generator: torch.Generator | None,
            device: torch.device | None = None) -> torch.Tensor:
    """Uniform(0, 1) draws of `shape` on `device` (None: the CPU), drawn on the generator's device."""
    device = device or torch.device("cpu")
    return torch.rand(shape, generator=generator, device=_draw_device(generator, device)).to(device)


def gumbel_noise(shape: torch.Size | tuple[int, ...], generator: torch.Generator | None,
                 device: torch.device | None = None) -> torch.Tensor:
    """Standard Gumbel noise −log(−log U), U ~ Uniform(0, 1), on `device` (None: the CPU)."""
    draws = uniform(shape, generator, device).clamp_(min=1e-20, max=1.0 - 1e-7)
    return -torch.log(-torch.log(draws))


def gumbel_max(logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """A draw from softmax(logits) per row, as argmax(logits + Gumbel): [n, vocab] -> [n]."""
    return (logits.float() + gumbel_noise(logits.shape, generator, logits.device)).argmax(dim=-1)


def gumbel_topk(logits: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
    """k distinct tokens per row, distributed as k draws without replacement from softmax(logits).

    logits [n, vocab] (−inf allowed for excluded tokens) -> [n, k]; order is the draw order.
    """
    perturbed = logits.float() + gumbel_noise(logits.shape, generator, logits.device)
    return torch.topk(perturbed, k, dim=-1).indices


def without_replacement_probs(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The distribution each of k draws without replacement came from, given the draws before it.

    probs [vocab]; tokens [k] distinct, in draw order -> [k, vocab]: row i is `probs` with tokens[:i]
    removed and renormalised (row 0 is `probs` itself). The verifier needs exactly these rows.
    """
    onehot = torch.nn.functional.one_hot(tokens, probs.shape[-1]).to(torch.int32)  # [k, vocab]
    earlier = (onehot.cumsum(0) - onehot) > 0  # [k, vocab]: drawn before row i
    rows = probs[None].expand(tokens.shape[0], -1).masked_fill(earlier, 0.0)
    return rows / rows.sum(dim=-1, keepdim=True)
