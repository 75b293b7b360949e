"""Chain verification: the rejection rule of speculative sampling, vectorised over the block.

Sampling (Leviathan et al.; Chen et al.): accept draft token x at position i with probability
min(1, target_probs[i, x] / draft_probs[i, x]); at the first rejection sample from
norm(max(target_probs − draft_probs, 0)); when all γ are accepted, sample a bonus token from the
target's distribution after the block. A deterministic drafter is a point mass: accept with
probability target_probs[i, x], and the residual is the target distribution with x removed.
Greedy: accept while the draft equals the target's argmax.
"""

from __future__ import annotations

import torch

from verispec.sampling.samplers import multinomial, uniform
from verispec.types import Origin, Verdict

__all__ = ["verify_greedy", "verify_sampled", "residual_distribution"]


def _first_false(mask: torch.Tensor) -> int:
    """Index of the first False in a 1-D bool tensor, or its length if all True."""
    rejected = (~mask).nonzero()
    return int(rejected[0, 0]) if len(rejected) else int(mask.shape[0])


def verify_greedy(draft_tokens: torch.Tensor, target_tokens: torch.Tensor) -> Verdict:
    """draft_tokens [γ]; target_tokens [γ+1] = the target's choice after each prefix."""
    gamma = draft_tokens.shape[0]
    if gamma == 0:  # plain decoding: the target's token (no tensor work: each op costs after a forward)
        return Verdict(0, int(target_tokens[0]), Origin.BONUS)
    accepted = _first_false(draft_tokens.to(target_tokens.device) == target_tokens[:gamma])
    origin = Origin.BONUS if accepted == gamma else Origin.RECOVERED
    return Verdict(accepted, int(target_tokens[accepted]), origin)


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor | None, token: int) -> torch.Tensor:
    """norm(max(target − draft, 0)) for one position [vocab]; point-mass draft when draft_probs is None."""
    if draft_probs is None:
        residual = target_probs.clone()
        residual[token] = 0.0
    else:
        residual = (target_probs - draft_probs).clamp_min(0.0)
    total = residual.sum()
    if total <= 0:  # only reachable through rounding when target == draft: then nothing can be rejected
        return target_probs
    return residual / total


def verify_sampled(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> Verdict:
    """draft_tokens [γ]; draft_probs [γ, vocab] or None (point mass); target_probs [γ+1, vocab]."""
    gamma = draft_tokens.shape[0]
    if gamma == 0:  # plain decoding: a draw from the target's row (no other tensor work: each op costs after a forward)
        return Verdict(0, int(multinomial(target_probs[:1], generator)), Origin.BONUS)
    device = target_probs.device  # the whole rule runs there; only the accepted count and the next token come back
    positions = torch.arange(gamma, device=device)
    draft_tokens = draft_tokens.to(device)
    target_at_draft = target_probs[positions, draft_tokens]  # [γ]
    draft_at_draft = draft_probs[positions, draft_tokens] if draft_probs is not None else torch.ones(gamma, device=device)
    draws = uniform(gamma, generator, device)  # [γ]
    accepted = _first_false(draws * draft_at_draft < target_at_draft)
    if accepted == gamma:
        bonus = multinomial(target_probs[gamma : gamma + 1], generator)
        return Verdict(gamma, int(bonus), Origin.BONUS)
    residual = residual_distribution(
        target_probs[accepted],
        draft_probs[accepted] if draft_probs is not None else None,
        int(draft_tokens[accepted]),
    )
    recovered = multinomial(residual[None], generator)
    return Verdict(accepted, int(recovered), Origin.RECOVERED)
