"""The plan: the drafter and γ a target runs with, chosen from measured costs (`--draft auto`).

Each candidate drafter has a measured cost c (seconds per draft token / T(1); 0 for a model-free
drafter) and an expected acceptance α (a prior until requests measure it: public prompts accept
markedly less than the built-in set). Its predicted speedup over plain decoding on the same backend
is the best E[tokens] / (γ·c + T(γ+1)/T(1)) over the draft lengths the backend verifies exactly, from
the backend's measured verification curve T(n) on this CPU. The plan speculates with the best
candidate only when that beats plain decoding by `MARGIN` (work outside the forwards is not in the
model yet); otherwise it decodes plain. Inside a request the `auto` γ policy keeps measuring α,
pauses speculation when it loses and probes now and then to resume.

A draft model is measured (fetched, loaded, timed) only where it could be the plan: its predicted speedup
at the least cost it can have (`registry.least_cost_ratio`: its share of the weights a step reads; the
prediction falls as c grows) must beat plain decoding's `MARGIN` and the candidates measured before it
(`worth_measuring`); otherwise the plan lists that bound instead (`bounds`).

`hybrid` (prompt lookup where it matches, a far smaller draft model elsewhere: `registry.hybrid_draft_for`) is
predicted as prompt lookup is, with the steps where lookup drafts nothing (`LOOKUP_EMPTY` of them on public
prompts) given to its draft (`hybrid_speedup`).

Where several backends can run the target's file (llama.cpp and verispec's kquant runner for a Q4_K_M
GGUF), each gets its own plan from its own measured curve, and `choose_backend` keeps the one with
the fewest predicted seconds a token (its T(1) over its predicted speedup), if that beats the default
backend by `BACKEND_MARGIN`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from verispec.control.theory import curve_verify_cost, draft_step_cost, expected_speedup, expected_tokens

__all__ = ["ALPHA_PRIORS", "BACKEND_MARGIN", "LOOKUP_EMPTY", "MARGIN", "Plan", "best_gamma", "choose_backend", "choose_plan",
           "hybrid_speedup", "worth_measuring"]

# α before a request measures its own: prompt lookup accepted 0.40–0.43 at its first positions on public
# prompts (Spec-Bench groups + HumanEval, gguf and kquant runs in BENCHMARKS.md), the 0.5B draft 0.78–0.82,
# `hybrid`'s draft model (SmolLM2 through the text: `hybrid_speedup`; also its steps' prior in the γ policy) 0.59–0.61
ALPHA_PRIORS = {"ngram": 0.4, "model": 0.7, "hybrid": 0.6}
# the share of prompt lookup's steps that draft nothing on public prompts (478 of 1,078 on the AMX Xeon, 2026-11-27):
# `hybrid` gives them to its draft model
LOOKUP_EMPTY = 0.44
MARGIN = 1.1  # a predicted speedup must reach this to be worth a drafter's memory and per-step work
# another backend of the same file must be predicted faster by this much (more than the few per cent a
# measured T(1) moves between runs): on an AVX2 build the kquant runner at 0.93 of ggml's seconds a token
# was kept off by MARGIN and the plan ran 0.90× llama.cpp where kquant plain ran 1.10× (BENCHMARKS.md)
BACKEND_MARGIN = 1.04


def best_gamma(alpha: float, c: float, curve: Sequence[float], max_gamma: int, catch_up: float = 1.0) -> tuple[int, float]:
    """(γ in 1…max_gamma with the highest expected speedup, that speedup) on the measured curve, a draft
    model catching up at `catch_up` = T_d(2)/T_d(1)."""
    verify = curve_verify_cost(curve)
    return max(((g, expected_speedup(alpha, g, c, verify, catch_up)) for g in range(1, max_gamma + 1)), key=lambda pair: pair[1])


def hybrid_speedup(lookup: tuple[float, int], alpha: float, c: float, curve: Sequence[float], max_gamma: int,
                   catch_up: float = 1.0) -> tuple[float, int]:
    """`hybrid`'s predicted speedup and its draft model's γ: prompt lookup's steps as `lookup` (its predicted speedup
    and γ) predicts them, but the share LOOKUP_EMPTY that draft nothing (a token for T(1)) taken by the draft model
    (E[tokens] for its drafting + T(γ+1)/T(1)). Those steps raise the speedup where the draft's extra tokens per
    extra time beat it."""
    verify = curve_verify_cost(curve)
    speedup, gamma = lookup
    time = LOOKUP_EMPTY + (1.0 - LOOKUP_EMPTY) * verify(gamma)  # a lookup step's mean cost, in T(1)
    tokens = speedup * time

    def mixed(g: int) -> float:
        extra_tokens = expected_tokens(alpha, g) - 1.0
        extra_time = draft_step_cost(alpha, g, c, catch_up) + verify(g) - 1.0
        return (tokens + LOOKUP_EMPTY * extra_tokens) / (time + LOOKUP_EMPTY * extra_time)
    best = max(range(1, max_gamma + 1), key=mixed)
    return mixed(best), best


@dataclass(frozen=True)
class Plan:
    """What runs: the precision, the drafter spec ("none": plain decoding) and its starting γ, and
    every candidate's predicted speedup over plain decoding (with the γ it was predicted at);
    `token_seconds`: the backend's measured T(1); `prefill_seconds`: its measured seconds a prompt token (where
    backends were compared); `backends`: each backend considered → its plan's predicted seconds a token
    (`choose_backend`), `prefills` → its seconds a prompt token; `bounds`: each candidate left unmeasured → the
    most it could be predicted (`worth_measuring`)."""

    precision: str
    drafter: str
    gamma: int
    predicted: dict[str, tuple[float, int]]
    token_seconds: float | None = None
    prefill_seconds: float | None = None
    backends: dict[str, float] = field(default_factory=dict)
    prefills: dict[str, float] = field(default_factory=dict)
    bounds: dict[str, float] = field(default_factory=dict)

    @property
    def speedup(self) -> float:
        """The predicted speedup of what runs over plain decoding on the same backend (1 for plain)."""
        return self.predicted[self.drafter][0] if self.drafter in self.predicted else 1.0

    def summary(self) -> str:
        """One line for the user: what was chosen, and why."""
        considered = ", ".join(f"{name} {speedup:.2f}× (γ {gamma})" for name, (speedup, gamma) in self.predicted.items())
        chosen = "plain decoding" if self.drafter == "none" else f"draft {self.drafter}, γ {self.gamma}"
        considered += "".join(f", {name} ≤ {bound:.2f}× (not measured)" for name, bound in self.bounds.items())
        line = f"plan: {self.precision} · {chosen} · predicted over plain: {considered.lstrip(', ') or 'nothing to compare'}"
        if len(self.backends) > 1:
            line += " · predicted ms a token: " + ", ".join(f"{name} {seconds * 1e3:.1f}" for name, seconds in self.backends.items())
        if len(self.prefills) > 1:
            line += " · a prompt token: " + ", ".join(f"{name} {seconds * 1e3:.1f}" for name, seconds in self.prefills.items())
        return line


def choose_plan(precision: str, curve: Sequence[float], costs: dict[str, float], max_gamma: int,
                alphas: dict[str, float] | None = None, catch_ups: dict[str, float] | None = None) -> Plan:
    """The plan for a target whose verification curve is `curve` (T(1), T(2), … in seconds), given
    each candidate drafter's cost ratio c (`costs`: spec → c), α prior and draft model's catch-up cost
    (`catch_ups`: spec → T_d(2)/T_d(1), 1 where absent); `max_gamma` is the longest draft the backend
    verifies exactly."""
    alphas = ALPHA_PRIORS if alphas is None else alphas
    catch_ups = catch_ups or {}
    predicted: dict[str, tuple[float, int]] = {}
    if max_gamma >= 1 and curve:
        for spec, c in costs.items():
            kind, catch_up = spec.split(":")[0], catch_ups.get(spec, 1.0)
            if kind == "hybrid" and "ngram" in predicted:  # prompt lookup, its empty steps the draft model's
                predicted[spec] = hybrid_speedup(predicted["ngram"], alphas[kind], c, curve, max_gamma, catch_up)
            else:
                gamma, speedup = best_gamma(alphas[kind], c, curve, max_gamma, catch_up)
                predicted[spec] = (speedup, gamma)
    best = max(predicted, key=lambda spec: predicted[spec][0], default=None)
    token_seconds = curve[0] if curve else None
    if best is None or predicted[best][0] < MARGIN:
        return Plan(precision, "none", 0, predicted, token_seconds)
    return Plan(precision, best, predicted[best][1], predicted, token_seconds)


def worth_measuring(least_c: float, curve: Sequence[float], max_gamma: int, rival: float,
                    alpha: float = ALPHA_PRIORS["model"], lookup: tuple[float, int] | None = None) -> tuple[bool, float]:
    """(whether a draft model of cost ratio c ≥ `least_c` could be the plan, the most it could be predicted):
    at c = least_c and no catching-up cost (the prediction only falls from there) it must beat both
    `MARGIN` and `rival`, the best speedup predicted for the candidates measured already. `lookup`: the draft
    is `hybrid`'s, predicted over prompt lookup's prediction (`hybrid_speedup`)."""
    if max_gamma < 1 or not curve:
        return False, 0.0
    bound = hybrid_speedup(lookup, alpha, least_c, curve, max_gamma)[0] if lookup else best_gamma(alpha, least_c, curve, max_gamma)[1]
    return bound >= max(MARGIN, rival), bound


def choose_backend(plans: Sequence[Plan]) -> Plan:
    """The first plan (the default backend) unless another is predicted faster by `BACKEND_MARGIN` in
    seconds a token (its measured T(1) over its predicted speedup), or is no slower than that margin there and
    faster by it in seconds a prompt token (`prefill_seconds`, where measured: a request's time is its prompt's
    prefill and its tokens' steps). Switching backend switches numerics, so a gain within a measurement's noise
    is not worth it. Every backend's prediction is kept in `backends`."""
    seconds = {plan.precision: plan.token_seconds / plan.speedup for plan in plans}
    default = plans[0]

    def gains(plan: Plan) -> bool:
        decode, base = seconds[plan.precision], seconds[default.precision]
        faster_prefill = (plan.prefill_seconds is not None and default.prefill_seconds is not None
                          and plan.prefill_seconds * BACKEND_MARGIN < default.prefill_seconds)
        return decode * BACKEND_MARGIN < base or (faster_prefill and decode <= base * BACKEND_MARGIN)

    best = min((plan for plan in plans[1:] if gains(plan)), key=lambda plan: seconds[plan.precision], default=default)
    prefills = {plan.precision: plan.prefill_seconds for plan in plans if plan.prefill_seconds is not None}
    return replace(best, backends=seconds, prefills=prefills)
