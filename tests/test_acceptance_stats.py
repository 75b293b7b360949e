"""The one acceptance-statistics type (`verispec.types.AcceptanceStats`) and the places that count with it.

The engine's per-generation statistics, the server's metrics, the batch tally, the analytic γ policy
and the online drafter all count α, τ and per-position acceptance with it, so these tests pin its
arithmetic once: a hand-computed example, and merge = adding the steps one by one.
"""

import random

import pytest

from verispec.control.costs import CostModel
from verispec.control.gamma import AnalyticGamma
from verispec.serving.cluster.batch import Tally
from verispec.serving.http.metrics import Metrics
from verispec.types import AcceptanceStats, GenerationStats, StepRecord

# (proposed, accepted) per step; (0, 0) is a plain step with no draft
STEPS = [(3, 3), (3, 1), (2, 0), (0, 0), (4, 2)]


def _counted(steps) -> AcceptanceStats:
    stats = AcceptanceStats()
    for proposed, accepted in steps:
        stats.add(proposed, accepted)
    return stats


def test_a_hand_computed_example():
    """Per position i: steps that kept i over steps that drafted i — position 0 is drafted by four steps
    and kept by three, position 2 drafted by three and kept by one. A rate taken over all five steps
    (plain step included), or an α over proposed rather than judged tokens (6/12), fails here."""
    stats = _counted(STEPS)
    assert (stats.steps, stats.proposed, stats.accepted) == (5, 12, 6)
    assert stats.judged == 3 + 2 + 1 + 0 + 3  # accepted + the first rejected one, where there was one
    assert stats.alpha == pytest.approx(6 / 9)
    assert stats.tau == pytest.approx((6 + 5) / 5)  # accepted tokens plus the target's own, per step
    assert stats.per_position == pytest.approx([3 / 4, 2 / 4, 1 / 3, 0 / 1])
    assert stats.histogram == {3: 1, 1: 1, 0: 2, 2: 1}


def test_empty_stats_read_as_zero_and_impossible_steps_are_refused():
    stats = AcceptanceStats()
    assert (stats.alpha, stats.tau, stats.per_position) == (0.0, 0.0, [])
    with pytest.raises(ValueError):
        stats.add(2, 3)


def test_merge_equals_adding_the_steps_one_by_one():
    """Random steps split at random into parts, counted apart and merged: everything equals counting
    them in one go (a merge that forgot the per-position counts or the histogram fails)."""
    rng = random.Random(0)
    for _ in range(50):
        steps = [(p, rng.randint(0, p)) for p in (rng.randint(0, 6) for _ in range(rng.randint(0, 30)))]
        cuts = sorted(rng.sample(range(len(steps) + 1), k=min(3, len(steps) + 1)))
        parts = [steps[a:b] for a, b in zip([0, *cuts], [*cuts, len(steps)])]
        merged = AcceptanceStats()
        for part in parts:
            merged.merge(_counted(part))
        assert merged == _counted(steps)


def test_every_counter_agrees_with_the_one_type():
    """The engine's GenerationStats, the server's metrics, the batch tally, the analytic γ policy read
    the same steps the same way."""
    reference = _counted(STEPS)
    generation, metrics = GenerationStats(), Metrics()
    policy = AnalyticGamma(CostModel(), prior_weight=1e-9)  # a negligible prior: α is the counted one
    for proposed, accepted in STEPS:
        generation.record(StepRecord(proposed, accepted, 0.0, 0.0))
        metrics.record_verification(proposed, accepted, accepted + 1)
        policy.update(proposed, accepted)
    assert generation.acceptance == metrics.acceptance == reference
    assert generation.to_dict()["per_position_acceptance"] == [round(x, 4) for x in reference.per_position]
    rendered = metrics.render()
    assert f"verispec_acceptance_rate {reference.alpha:.4f}" in rendered
    assert f'verispec_position_acceptance_rate{{position="2"}} {1 / 3:.4f}' in rendered
    assert policy.alpha == pytest.approx(reference.alpha)

    tally = Tally()
    row = {"new_tokens": 11, "steps": 5, "proposed_tokens": 12, "accepted_tokens": 6, "judged_tokens": 9}
    tally.add("results", row, 1.0)
    tally.add("errors", {}, 0.5)
    assert (tally.alpha, tally.tau) == (pytest.approx(reference.alpha), pytest.approx(reference.tau))
    assert tally.to_dict() == {"results": 1, "errors": 1, "new_tokens": 11, "steps": 5, "accepted": 6, "judged": 9,
                               "seconds": 1.5, "tau": 2.2, "alpha": 0.6667, "tokens_per_second": 7.333}


def test_c_counts_the_steps_a_draft_model_drafted():
    """A hybrid's prompt-lookup steps (`free`) draft many tokens for nothing: c is the draft model's seconds per token
    it drafted over the target's seconds per step, those steps left out; with only free steps, over all of them."""
    stats = GenerationStats()
    stats.record(StepRecord(2, 2, 0.020, 0.100))  # the draft model: 2 tokens in 20 ms
    stats.record(StepRecord(8, 8, 0.001, 0.100, free=True))  # prompt lookup: 8 tokens in 1 ms
    assert stats.cost_ratio == pytest.approx((0.020 / 2) / (0.200 / 2))
    lookup = GenerationStats()
    lookup.record(StepRecord(8, 8, 0.001, 0.100, free=True))
    assert lookup.cost_ratio == pytest.approx((0.001 / 8) / 0.100)
