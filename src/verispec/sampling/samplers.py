"""Samplers: argmax, multinomial and Gumbel-max draws, and Gumbel-top-k (k distinct tokens in one pass).

All randomness flows through an explicit `torch.Generator` owned by the request: never a global
reseed, so one seed reproduces one output. The generator lives on the target's device (`torch.Generator`
is per device); a draw over rows held elsewhere (a model-free drafter's host-side rows while the
target runs on a GPU) is made on the generator's device and returned beside the rows. On the CPU
nothing moves, so a seed gives the same output as before devices existed.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["argmax", "multinomial", "uniform", "gumbel_noise", "gumbel_max", "gumbel_topk", "without_replacement_probs"]


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


def multinomial(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row from probs [n, vocab] -> [n] (on probs' device)."""
    device = _draw_device(generator, probs.device)
    return torch.multinomial(probs.to(device), 1, generator=generator).squeeze(-1).to(probs.device)


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
