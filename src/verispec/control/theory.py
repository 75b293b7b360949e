"""The theory of speculative decoding (Leviathan et al., 2023; Chen et al., 2023) as functions.

α: acceptance rate, Σₓ min(target_prob(x), draft_prob(x)). γ: draft length. c: cost of one draft
token relative to one target forward. verify_cost(γ): T(γ+1)/T(1), the cost of verifying γ+1
positions relative to decoding one (1 when verification is free, as those papers assume).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from verispec.errors import InvalidParameterError

__all__ = ["acceptance_rate", "expected_tokens", "expected_speedup", "optimal_gamma", "curve_verify_cost", "speedup_table"]


def acceptance_rate(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """α per row: Σₓ min(target_probs, draft_probs) over [..., vocab]."""
    return torch.minimum(target_probs, draft_probs).sum(dim=-1)


def expected_tokens(alpha: float, gamma: float) -> float:
    """E[tokens per step] = (1 − α^(γ+1)) / (1 − α); γ may be a mean draft length (non-integer)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, gamma: float, c: float, verify_cost: Callable[[int], float] | None = None) -> float:
    """E[tokens] / (γ·c + T(γ+1)/T(1)); the papers' (1−α^(γ+1)) / ((1−α)(γc+1)) when verify_cost is None."""
    verify = verify_cost(gamma) if verify_cost is not None else 1.0
    return expected_tokens(alpha, gamma) / (gamma * c + verify)


def optimal_gamma(alpha: float, c: float, max_gamma: int = 16, verify_cost: Callable[[int], float] | None = None) -> int:
    """The γ in [1, max_gamma] with the highest expected speedup."""
    return max(range(1, max_gamma + 1), key=lambda g: expected_speedup(alpha, g, c, verify_cost))


def curve_verify_cost(curve: Sequence[float]) -> Callable[[int], float]:
    """verify_cost(γ) from a measured curve T(1), T(2), … (seconds or ratios): T(γ+1)/T(1), the last
    entry standing in for longer verifications."""
    if not curve or any(t <= 0 for t in curve):
        raise InvalidParameterError(f"a verify-cost curve needs positive values T(1), T(2), …; got {list(curve)}")
    return lambda gamma: curve[min(gamma + 1, len(curve)) - 1] / curve[0]


def speedup_table(alpha: float, c: float, max_gamma: int = 16, verify_cost: Callable[[int], float] | None = None) -> list[dict]:
    """One row per γ in [1, max_gamma]: expected tokens per step, expected speedup, and whether it is the optimum."""
    if not 0 <= alpha <= 1:
        raise InvalidParameterError(f"alpha (acceptance rate) must lie in [0, 1], got {alpha}")
    if c < 0:
        raise InvalidParameterError(f"c (draft/target cost ratio) must be ≥ 0, got {c}")
    if max_gamma < 1:
        raise InvalidParameterError(f"max_gamma must be ≥ 1, got {max_gamma}")
    best = optimal_gamma(alpha, c, max_gamma, verify_cost)
    return [
        {"gamma": g, "expected_tokens": expected_tokens(alpha, g),
         "speedup": expected_speedup(alpha, g, c, verify_cost), "optimal": g == best}
        for g in range(1, max_gamma + 1)
    ]
