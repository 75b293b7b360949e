"""The theory of speculative decoding (Leviathan et al., 2023; Chen et al., 2023) as functions.

α: acceptance rate, Σₓ min(target_prob(x), draft_prob(x)). γ: draft length. c: cost of one draft
token relative to one target forward. verify_cost(γ): T(γ+1)/T(1), the cost of verifying γ+1
positions relative to decoding one (1 when verification is free, as those papers assume).
catch_up: T_d(2)/T_d(1) of a draft model, what feeding it two tokens costs against one. A draft model
drafts γ tokens in γ forwards, the first of which feeds what the target committed since its last step:
one token, or two after a step that accepted every draft (the draft never fed its own last token),
which happens with probability α^γ. The papers' γ·c is the case catch_up = 1 (a flat draft curve).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from verispec.errors import InvalidParameterError

__all__ = ["acceptance_rate", "expected_tokens", "draft_step_cost", "expected_speedup", "optimal_gamma", "curve_verify_cost",
           "speedup_table"]


def acceptance_rate(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """α per row: Σₓ min(target_probs, draft_probs) over [..., vocab]."""
    return torch.minimum(target_probs, draft_probs).sum(dim=-1)


def expected_tokens(alpha: float, gamma: float) -> float:
    """E[tokens per step] = (1 − α^(γ+1)) / (1 − α); γ may be a mean draft length (non-integer)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def draft_step_cost(alpha: float, gamma: float, c: float, catch_up: float = 1.0) -> float:
    """A step's drafting in T(1): c · (γ − 1 + the catching-up forward), that forward costing 1, or
    `catch_up` after a step that accepted all γ (probability α^γ); 0 for a step that drafts nothing."""
    if gamma <= 0:
        return 0.0
    return c * (gamma + alpha**gamma * (catch_up - 1.0))


def expected_speedup(alpha: float, gamma: float, c: float, verify_cost: Callable[[int], float] | None = None,
                     catch_up: float = 1.0) -> float:
    """E[tokens] / (drafting + T(γ+1)/T(1)); the papers' (1−α^(γ+1)) / ((1−α)(γc+1)) when verify_cost is None
    and catch_up 1."""
    verify = verify_cost(gamma) if verify_cost is not None else 1.0
    return expected_tokens(alpha, gamma) / (draft_step_cost(alpha, gamma, c, catch_up) + verify)


def optimal_gamma(alpha: float, c: float, max_gamma: int = 16, verify_cost: Callable[[int], float] | None = None,
                  catch_up: float = 1.0) -> int:
    """The γ in [1, max_gamma] with the highest expected speedup."""
    return max(range(1, max_gamma + 1), key=lambda g: expected_speedup(alpha, g, c, verify_cost, catch_up))


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
