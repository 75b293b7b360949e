"""γ policies: how many tokens to draft next step.

- constant: always γ.
- heuristic: Hugging Face's original schedule: start at 5 (or the given γ), +2 when every draft
  token was accepted, −1 otherwise, never below 1.
- analytic: the γ that maximises E[tokens] / (γ·c + T(γ+1)/T(1)) for the α and costs measured in
  this run (α: the geometric estimate from accepted counts; c and T(n) from timings, T(n)/T(1) at the
  context the sequence has reached: `CostModel.verify_cost`). A drafter of token trees verifies more
  positions than its depth: its steps are priced at T(w·γ+1)/T(1), w the nodes its trees have held per
  depth so far in this request.
- auto: analytic, and γ = 0 (plain steps) while even the best γ is predicted slower than plain
  decoding; every `PROBE_EVERY` plain steps it drafts one token to measure α again, and resumes
  when speculation would pay (the policy `--draft auto` plans with).

The analytic policies keep the steps a draft session hints at (`DraftSession.hint`: prompt lookup's
matched suffix length) apart: each class has its own α, from its own prior, its own γ and its own pause,
and a class whose proposals cost no draft forward (`Hint.free`: `hybrid`'s prompt-lookup steps beside its
draft model's) is priced at c = 0.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from verispec.control.batch import Outlook
from verispec.control.costs import CostModel
from verispec.control.theory import expected_speedup, optimal_gamma
from verispec.errors import InvalidParameterError
from verispec.types import AcceptanceStats, Hint

__all__ = ["GammaPolicy", "ConstantGamma", "HeuristicGamma", "AnalyticGamma", "make_gamma_policy", "check_gamma_policy", "POLICIES", "PROBE_EVERY"]

PROBE_EVERY = 16  # plain steps between the one-token drafts of a paused `auto` policy


class GammaPolicy(ABC):
    @abstractmethod
    def next_gamma(self, hint: Hint | None = None) -> int:
        """The next step's γ; `hint`: the draft session's class for that step (`DraftSession.hint`), if any."""

    def update(self, proposed: int, accepted: int, context: int | None = None, hint: Hint | None = None,
               nodes: int | None = None) -> None:
        """Told after each step how many of `proposed` draft tokens were accepted (a tree's: along its deepest
        path), how many tokens the sequence holds now (the context the next step attends; None: unknown), the
        step's hint and, for a token tree, how many nodes it held."""

    def outlook(self, gamma: int, hint: Hint | None = None, lag: int = 0) -> Outlook:
        """The next step (`gamma` drafts, of the class `hint`, its draft model `lag` tokens behind: `DraftSession.lag`)
        for sizing it among others (`control/batch.py`). Default: its γ stays (a policy that measures no costs)."""
        return Outlook(gamma)


class ConstantGamma(GammaPolicy):
    def __init__(self, gamma: int):
        self.gamma = gamma

    def next_gamma(self, hint: Hint | None = None) -> int:
        return self.gamma


class HeuristicGamma(GammaPolicy):
    def __init__(self, gamma: int = 5, max_gamma: int = 32):
        self.gamma, self.max_gamma = gamma, max_gamma

    def next_gamma(self, hint: Hint | None = None) -> int:
        return self.gamma

    def update(self, proposed: int, accepted: int, context: int | None = None, hint: Hint | None = None,
               nodes: int | None = None) -> None:
        if proposed == 0:
            return
        self.gamma = min(self.gamma + 2, self.max_gamma) if accepted == proposed else max(self.gamma - 1, 1)


@dataclass
class _Steps:
    """A class of steps (every step, or those of one `Hint` key): its acceptance so far, its γ, its pause."""

    prior_alpha: float
    gamma: int
    free: bool = False  # its proposals cost no draft forward (`Hint.free`)
    seen: AcceptanceStats = field(default_factory=AcceptanceStats)
    paused_steps: int = 0  # plain steps since speculation paused


class AnalyticGamma(GammaPolicy):
    """α is estimated with a prior worth `prior_weight` judged tokens, so early steps do not swing γ.
    may_pause: γ 0 while speculation is predicted to lose, with a one-token probe every PROBE_EVERY steps.
    Steps the session hints at (`DraftSession.hint`) are measured, sized and paused by their class, each
    from its own prior; the rest share one estimate."""

    def __init__(self, costs: CostModel, gamma: int = 4, max_gamma: int = 12, prior_alpha: float = 0.7, prior_weight: float = 8.0,
                 may_pause: bool = False):
        self.costs, self.max_gamma, self.may_pause = costs, max_gamma, may_pause
        self.prior_weight = prior_weight
        self.overall = _Steps(prior_alpha, gamma)  # every step (α for reports); sizes the steps without a hint
        self.classes: dict[int, _Steps] = {}  # hint key -> its steps
        self.tree_nodes = self.tree_depth = 0  # over this request's token trees: nodes drafted, their depths summed

    @property
    def alpha(self) -> float:
        """This request's acceptance rate over every step so far (with the prior)."""
        return self._alpha(self.overall)

    def _alpha(self, steps: _Steps) -> float:
        accepted = steps.prior_alpha * self.prior_weight + steps.seen.accepted
        return min(max(accepted / (self.prior_weight + steps.seen.judged), 0.01), 0.99)

    def _steps(self, hint: Hint | None) -> _Steps:
        if hint is None:
            return self.overall
        if hint.key not in self.classes:  # a new class starts at the γ its prior calls for
            steps = self.classes[hint.key] = _Steps(hint.prior, self.overall.gamma, hint.free)
            self._retune(steps, None)
        return self.classes[hint.key]

    def next_gamma(self, hint: Hint | None = None) -> int:
        steps = self._steps(hint)
        if steps.gamma == 0:
            steps.paused_steps += 1
            return 1 if steps.paused_steps % PROBE_EVERY == 0 else 0
        return steps.gamma

    def update(self, proposed: int, accepted: int, context: int | None = None, hint: Hint | None = None,
               nodes: int | None = None) -> None:
        if proposed == 0:
            return
        if nodes is not None:
            self.tree_nodes, self.tree_depth = self.tree_nodes + nodes, self.tree_depth + proposed
        self.overall.seen.add(proposed, accepted)
        steps = self._steps(hint)
        if steps is not self.overall:
            steps.seen.add(proposed, accepted)
        self._retune(steps, context)

    def outlook(self, gamma: int, hint: Hint | None = None, lag: int = 0) -> Outlook:
        """Its class's α and the costs it is priced at, the draft model's `lag` tokens to catch up at what each token
        past one adds to its forward (T_d(2)/T_d(1) − 1, as `theory.draft_step_cost`); γ stays while the class is
        paused (a probe, a plain step) or before costs are known."""
        steps, c = self._steps(hint), self.costs.draft_cost_ratio()
        if c is None or steps.gamma == 0 or gamma == 0:
            return Outlook(gamma)
        if steps.free:  # no draft forward: nothing to pay, nothing to catch up
            return Outlook(gamma, self._alpha(steps), 0.0, self.positions(gamma) / gamma, fixed=False)
        catch_up = c * (self.costs.draft_catch_up - 1.0) * lag
        return Outlook(gamma, self._alpha(steps), c, self.positions(gamma) / gamma, catch_up, fixed=False)

    def positions(self, gamma: int) -> int:
        """The draft positions a step of depth γ verifies: γ for a chain, γ times the nodes per depth of the
        token trees drafted so far (at least γ)."""
        if not self.tree_depth:
            return gamma
        return max(gamma, round(gamma * self.tree_nodes / self.tree_depth))

    def _retune(self, steps: _Steps, context: int | None) -> None:
        """The γ with the highest expected speedup at the class's α (0 while even that loses, if pausing)."""
        c = self.costs.draft_cost_ratio()
        if c is None:
            return
        alpha, catch_up = self._alpha(steps), self.costs.draft_catch_up
        if steps.free:  # no draft forward to pay for, none to catch up
            c, catch_up = 0.0, 1.0
        # a step of depth γ verifies positions(γ) draft tokens, after `context` tokens
        verify_cost = lambda gamma: self.costs.verify_cost(self.positions(gamma), context)  # noqa: E731
        gamma = optimal_gamma(alpha, c, self.max_gamma, verify_cost, catch_up)
        loses = expected_speedup(alpha, gamma, c, verify_cost, catch_up) < 1.0
        steps.gamma = 0 if self.may_pause and loses else gamma


POLICIES = ("constant", "heuristic", "analytic", "auto")


def check_gamma_policy(name: str | None, gamma: int | None) -> None:
    """Raise InvalidParameterError unless `name` (None: the engine's) is a γ policy and `gamma` (None:
    the engine's) an integer ≥ 1: a request's settings, checked before any work."""
    if gamma is not None and (not isinstance(gamma, int) or isinstance(gamma, bool) or gamma < 1):
        raise InvalidParameterError(f"gamma (draft length) must be an integer ≥ 1, got {gamma!r}")
    if name is not None and name not in POLICIES:
        raise InvalidParameterError(f"unknown gamma policy {name!r}: use one of {', '.join(POLICIES)}")


def make_gamma_policy(name: str, gamma: int, costs: CostModel, max_gamma: int = 12) -> GammaPolicy:
    check_gamma_policy(name, gamma)
    if name == "constant":
        return ConstantGamma(gamma)
    if name == "heuristic":
        return HeuristicGamma(gamma, max_gamma=max(max_gamma, gamma))
    return AnalyticGamma(costs, gamma, max_gamma=max(max_gamma, gamma), may_pause=name == "auto")
