"""γ for requests stepped together: each request's γ, cut where the batch's requests gain by it.

Alone, a request's γ policy prices a step of γ drafts at γ·c + T(γ+1)/T(1). Stepped together (`engine/together.py`:
the server's batch, `Engine.generate_batch`), k requests share ONE target pass over all their positions, so a draft
position costs what it adds to that pass — on a curve that rises with the pass's width, more than it cost alone
(8 requests each verifying γ+1 = 6 positions make a pass of 48) — and every request in the step pays it, since each
waits for the whole pass. `size_together` starts from each request's own γ and cuts, one draft token at a time, the
one whose removal leaves the batch's score highest, down to no drafts at all, and keeps the best γs it met: the
pass's curve is concave (the first position past one a row costs the most), so near the top each single cut may lose
where cutting them all gains, and a descent that stopped at the first losing cut kept drafts the batch was better
without (BENCHMARKS.md, "AMX": the batch's descent). The score is Σ_i log(E[tokens_i] / t), the step's
time t = drafting + T(Σ n_i)/T(1), E[tokens] = (1 − α^(γ+1))/(1 − α): the product of the requests' expected rates
(proportional fairness), not their sum. A request's drafts stay where they raise its own rate by a larger factor than
they slow the step for all k; the sum kept drafts of a well-accepted request that slowed the others by almost as much
as they gained, and the least accepted requests, whose tokens come one a step, made the latency's tail
(BENCHMARKS.md, "AMX": the batch's score).

Each draft token is priced at its c, as alone: requests draft side by side and share a draft model's pass only
where they meet in one (`drafters/batching.py`), which no step can count on, so no saving is assumed; a request whose
draft model fell behind the sequence in steps it drafted nothing in pays its catching up (`Outlook.catch_up`) with its
first draft token, so a request once cut stays cut while the batch is better without its drafts. The target's
pass is priced on its measured costs (`CostModel.pass_cost`: the curve, its wide points and what a row adds). γ only
ever falls, never below 0, and only for requests whose output γ cannot change (`Outlook.fixed` False: greedy, or
sampled without a seed, whose draws are promised only in distribution, which γ never changes; an analytic policy,
not a probe); a lone request is never resized.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from verispec.control.theory import expected_tokens

__all__ = ["Outlook", "drafting_cost", "size_together"]


@dataclass(frozen=True)
class Outlook:
    """One request's next step as its own γ policy sizes it, and what sizing it among others needs."""

    gamma: int  # its γ alone (0: a plain step)
    alpha: float = 0.0  # its step class's acceptance estimate
    c: float = 0.0  # seconds a draft token / T(1); 0 where its proposals cost no forward (prompt lookup)
    width: float = 1.0  # positions verified per depth (a token tree's nodes per depth; 1 for a chain)
    catch_up: float = 0.0  # T(1)s its draft model spends on committed tokens it lacks before its first draft (`DraftSession.lag`)
    fixed: bool = True  # its γ must stay (seeded sampled: γ changes the draws; a constant policy; a probe)


def drafting_cost(outlook: Outlook, gamma: int) -> float:
    """T(1)s a request spends drafting `gamma` tokens: each at its c, and a draft model behind the sequence catching up
    before its first."""
    return gamma * outlook.c + (outlook.catch_up if gamma else 0.0)


class _Batch:
    """The step's score (Σ log of the requests' expected rates) at the current γs, updated a cut at a time."""

    def __init__(self, outlooks: Sequence[Outlook], gammas: list[int], pass_cost: Callable[[int], float]):
        self.outlooks, self.gammas, self.pass_cost = outlooks, gammas, pass_cost
        self.log_tokens = sum(self._log_tokens(o, g) for o, g in zip(outlooks, gammas))
        self.positions = sum(self._positions(o, g) for o, g in zip(outlooks, gammas))
        self.drafting = sum(drafting_cost(o, g) for o, g in zip(outlooks, gammas))

    @staticmethod
    def _log_tokens(o: Outlook, g: int) -> float:
        return math.log(expected_tokens(o.alpha, g))  # 0 at γ 0: a plain step's one token

    @staticmethod
    def _positions(o: Outlook, g: int) -> int:
        return round(g * o.width) + 1

    def _cut(self, i: int) -> tuple[float, int, float]:
        """What request i drafting one token fewer changes: (log tokens, positions, drafting)."""
        o, g = self.outlooks[i], self.gammas[i]
        return (self._log_tokens(o, g - 1) - self._log_tokens(o, g), self._positions(o, g - 1) - self._positions(o, g),
                drafting_cost(o, g - 1) - drafting_cost(o, g))

    def score(self, i: int | None = None) -> float:
        """Σ_i log(E[tokens_i] / the step's time in T(1)) at the current γs (with request i drafting one fewer)."""
        log_tokens, positions, drafting = self._cut(i) if i is not None else (0.0, 0, 0.0)
        step_time = self.drafting + drafting + self.pass_cost(self.positions + positions)  # in T(1)
        return self.log_tokens + log_tokens - len(self.gammas) * math.log(step_time)

    def cut(self, i: int) -> None:
        log_tokens, positions, drafting = self._cut(i)
        self.log_tokens += log_tokens
        self.positions += positions
        self.drafting += drafting
        self.gammas[i] -= 1


def size_together(outlooks: Sequence[Outlook], pass_cost: Callable[[int], float]) -> list[int]:
    """Each request's γ for a step taken together (module docstring): its own, or less where the batch gains;
    `pass_cost(n)`: T(n)/T(1) of one target pass over n positions."""
    if len(outlooks) < 2 or all(o.fixed for o in outlooks):
        return [o.gamma for o in outlooks]
    batch = _Batch(outlooks, [o.gamma for o in outlooks], functools.cache(pass_cost))  # each cut asks every request's
    best, best_gammas = batch.score(), list(batch.gammas)
    while cuts := [(batch.score(i), i) for i, o in enumerate(outlooks) if not o.fixed and batch.gammas[i] > 0]:
        score, i = max(cuts)
        batch.cut(i)
        if score > best:
            best, best_gammas = score, list(batch.gammas)
    return best_gammas
