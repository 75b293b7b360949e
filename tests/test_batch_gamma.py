"""γ for requests stepped together (`control/batch.py`): cuts only where the batch's score (Σ log of the requests'
expected rates) gains, never for a request whose draws depend on γ (seeded) or whose policy prices nothing, never
alone; and through `Engine.generate_batch`, a batch that cuts greedy requests' drafts still gives every request what
it gets alone."""

from __future__ import annotations

import math

import pytest

from verispec import Engine, GenerationConfig, SamplingParams
from verispec.control import CostModel
from verispec.control.batch import Outlook, size_together
from verispec.drafters import DraftModelDrafter, NgramDrafter
from verispec.models.loading import load_model


def flat_then_steep(knee: int, slope: float):
    """T(n)/T(1): 1 up to `knee` positions, then `slope` more a position."""
    return lambda positions: 1.0 + max(0, positions - knee) * slope


def test_a_lone_request_and_fixed_requests_keep_their_gamma():
    steep = flat_then_steep(1, 1.0)  # every position costs a whole T(1)
    assert size_together([Outlook(6, 0.3, fixed=False)], steep) == [6]
    assert size_together([Outlook(6, 0.3), Outlook(5, 0.3)], steep) == [6, 5]  # fixed: seeded sampled, constant, probes
    # the fixed one keeps 6 (a pass of 7 + the other's); the other keeps the one draft whose ×1.3 to its tokens outweighs
    # the pass of 9 positions, not 8, for both (1.3 / (9/8)² > 1); a second would not (1.39 / 1.3 = 1.07 < (10/9)² = 1.23)
    assert size_together([Outlook(6, 0.3), Outlook(5, 0.3, fixed=False)], steep) == [6, 1]


def test_a_flat_pass_keeps_every_gamma_and_a_steep_one_cuts_the_least_accepted_first():
    outlooks = [Outlook(4, 0.9, fixed=False), Outlook(4, 0.3, fixed=False), Outlook(4, 0.6, fixed=False)]
    assert size_together(outlooks, flat_then_steep(64, 0.1)) == [4, 4, 4]
    cut = size_together(outlooks, flat_then_steep(6, 0.05))
    assert cut[1] < cut[2] <= cut[0] and cut != [4, 4, 4] and all(0 <= g <= 4 for g in cut)


def test_cuts_raise_the_batch_score_and_end_where_no_single_cut_gains():
    from verispec.control.batch import _Batch

    outlooks = [Outlook(g, a, c, fixed=False) for g, a, c in [(6, 0.8, 0.0), (3, 0.5, 0.15), (5, 0.4, 0.15), (2, 0.7, 0.3)]]
    pass_cost = flat_then_steep(4, 0.08)
    start = _Batch(outlooks, [o.gamma for o in outlooks], pass_cost).score()
    sized = size_together(outlooks, pass_cost)
    end = _Batch(outlooks, list(sized), pass_cost)
    assert end.score() > start
    for i, g in enumerate(sized):  # a local optimum: no further single cut gains
        assert g == 0 or end.score(i) <= end.score()


def test_cuts_go_past_a_losing_cut_to_the_best_gammas_on_a_concave_pass():
    """A pass whose first position past one a row costs the most (T 1 for two rows of one position, 1.6 for three, then
    0.01 a position): two requests at γ 3 and α 0.3 score 2·log 1.417 − 2·log 1.65 = −0.30, a single cut lowers that
    (−0.31: the pass barely cheaper, a token's worth lost), but no drafts at all score 0. A descent that stopped at the
    first losing cut kept every draft (the positive control); the cuts go on to the bottom and keep the best."""
    from verispec.control.batch import _Batch

    outlooks = [Outlook(3, 0.3, fixed=False), Outlook(3, 0.3, fixed=False)]

    def pass_cost(positions: int) -> float:
        return 1.0 if positions <= 2 else 1.6 + 0.01 * (positions - 3)

    own = _Batch(outlooks, [3, 3], pass_cost)
    assert own.score(0) < own.score() and own.score(1) < own.score()  # every single cut loses
    assert _Batch(outlooks, [0, 0], pass_cost).score() > own.score()
    assert size_together(outlooks, pass_cost) == [0, 0]


def test_a_request_keeps_only_the_drafts_that_gain_it_more_than_they_slow_the_others():
    """Three plain requests beside one well-accepted request (α 0.9, γ 6) on a pass that costs 0.1 T(1) a position past
    4: its 6 drafts give the step the most tokens a unit of time (the sum's choice), but slow the three others' single
    token by 1.6×; the score keeps the 2 whose gain to it (2.71 tokens against 1) outweighs that for all four."""
    outlooks = [Outlook(6, 0.9, fixed=False)] + [Outlook(0)] * 3
    pass_cost = flat_then_steep(4, 0.1)

    def tokens_per_time(gamma: int) -> float:  # the sum's measure, as the previous rule priced it
        return (3 + (1 - 0.9 ** (gamma + 1)) / 0.1) / pass_cost(4 + gamma)

    assert max(range(7), key=tokens_per_time) == 6
    assert size_together(outlooks, pass_cost) == [2, 0, 0, 0]


def test_drafting_and_tree_widths_are_priced():
    from verispec.control.batch import _Batch

    batch = _Batch([Outlook(2, 0.5, 0.2, fixed=False), Outlook(3, 0.5, 0.0, 4.0, fixed=False)], [2, 3], lambda n: float(n))
    assert batch.drafting == pytest.approx(0.4) and batch.positions == 3 + 13  # a tree of 4 nodes a depth: 12 + 1
    assert batch.score(1) == pytest.approx(_Batch(batch.outlooks, [2, 2], lambda n: float(n)).score())


def test_a_draft_model_behind_the_sequence_pays_its_catching_up_with_its_first_draft():
    """Two requests alike but for one's draft model, 40 tokens behind (cut in the steps before) at 0.02 T(1) a token:
    0.8 T(1) before its first draft, more than its drafts gain it, so it stays cut; priced without that (the positive
    control) both keep the same γs."""
    from verispec.control.batch import _Batch

    pass_cost = flat_then_steep(2, 0.05)
    behind = [Outlook(3, 0.6, 0.1, fixed=False), Outlook(3, 0.6, 0.1, catch_up=40 * 0.02, fixed=False)]
    level = [behind[0], behind[0]]
    assert _Batch(behind, [0, 1], pass_cost).drafting == pytest.approx(0.1 + 0.8)
    assert _Batch(behind, [2, 0], pass_cost).drafting == pytest.approx(0.2)  # no drafts: no catching up
    sized = size_together(level, pass_cost)
    assert sized[0] == sized[1] > 0
    assert size_together(behind, pass_cost) == [sized[0], 0]


def test_a_model_session_counts_the_committed_tokens_its_draft_lacks(tiny_target, tiny_draft):
    target, draft = load_model(tiny_target, "int8"), load_model(tiny_draft, "int8")
    prompt = PROMPTS[1]
    session = DraftModelDrafter(draft, target.vocab_size).start(prompt)
    assert session.lag(prompt) == 0  # prefilled but for the last token, which every step feeds
    later = prompt + [4, 6, 8, 10, 12]  # five tokens committed in steps the draft model sat out
    session.commit(later)
    assert session.lag(later) == 5
    session.propose(later, 2, SamplingParams(), None)
    assert session.lag(later) == 0
    unread = DraftModelDrafter(draft, target.vocab_size).start_chunked(prompt)  # no prefill yet
    assert unread.lag(prompt) == 0 and unread.lag(later) == 5  # a prompt not read yet is not counted: it is read once
    assert NgramDrafter().start(prompt).lag(later) == 0


def test_hybrids_draft_model_reads_the_prompt_at_its_first_proposal(tiny_target, tiny_draft, monkeypatch):
    """`hybrid` opened by the engine (`start_chunked`) feeds its draft model nothing until that model proposes
    (`ModelSession.defer_prefill`): a request served by prompt lookup throughout never runs its draft's prefill; the
    first proposal feeds prompt and output at once, and the draft is the one a session prefilled at start makes."""
    from verispec.drafters import HybridDrafter

    target, draft = load_model(tiny_target, "int8"), load_model(tiny_draft, "int8")
    drafter = HybridDrafter(DraftModelDrafter(draft, target.vocab_size))
    forwards = []
    ragged = draft.runner.forward_ragged
    monkeypatch.setattr(draft.runner, "forward_ragged", lambda caches, feeds, *rest, **kw: forwards.append(len(feeds[0]))
                        or ragged(caches, feeds, *rest, **kw))
    forward = draft.runner.forward
    monkeypatch.setattr(draft.runner, "forward", lambda cache, feed, *rest, **kw: forwards.append(len(feed))
                        or forward(cache, feed, *rest, **kw))
    prompt = PROMPTS[1]
    session = drafter.start_chunked(prompt)
    assert session.prefill_step(0) and session.prefill_step(None) and forwards == []  # nothing read yet
    later = prompt + [4, 6, 8]  # three tokens prompt lookup (or a plain step) committed
    session.commit(later)
    assert session.lag(later) == 3 and forwards == []
    lazy = session.model.propose(later, 2, SamplingParams(), None)
    assert forwards[0] == len(later)  # prompt and output in one feed
    eager = drafter.start(prompt).model.propose(later, 2, SamplingParams(), None)
    assert lazy.tokens.tolist() == eager.tokens.tolist() and len(lazy.tokens) == 2


def test_the_pass_cost_extrapolates_past_the_measured_curve():
    costs = CostModel([1.0, 1.0, 1.0, 1.0, 1.2, 1.4, 1.6, 1.8])  # T(n) for n = 1…8
    assert costs.pass_cost(8) == pytest.approx(1.8) and costs.pass_cost(3) == 1.0
    assert costs.pass_cost(12) == pytest.approx(1.8 + 4 * 0.2)  # no batch costs: the second half's slope, (1.8 − 1.0) / 4
    assert CostModel().pass_cost(40) == 1.0


PROMPTS = [[5, 9, 2, 7, 5, 9, 2, 7], [22, 3, 3, 3, 8, 2, 30, 42, 5], [40, 41, 40, 41], [20, 21, 22, 20, 21, 22, 20]]


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_a_batch_that_cuts_greedy_drafts_gives_each_request_what_it_gets_alone(tiny_target, tiny_draft, drafter, monkeypatch):
    target = load_model(tiny_target, "int8")
    target.eos_ids = frozenset()
    made = NgramDrafter(max_n=3) if drafter == "ngram" else DraftModelDrafter(load_model(tiny_draft, "int8"), target.vocab_size)
    engine = Engine(target, made, gamma=4, gamma_policy="analytic")
    # verification flat up to 6 positions, then steep: alone γ up to 5 pays; four requests' pass of 24 does not
    costs = CostModel([1.0] * 6 + [1.0 + 0.3 * k for k in range(1, 7)], 0.0 if drafter == "ngram" else 0.05, 1.1)
    monkeypatch.setattr(engine, "costs_for", lambda *args, **kwargs: costs)
    configs = [GenerationConfig(max_new_tokens=24) if i % 2 == 0 else
               GenerationConfig(max_new_tokens=24, sampling=SamplingParams(temperature=1.0), seed=3 + i) for i in range(4)]
    alone = [engine.generate(prompt, config) for prompt, config in zip(PROMPTS, configs)]
    together = engine.generate_batch(PROMPTS, configs, max_batch=4)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    proposed = lambda result: [record.proposed for record in result.stats.records]  # noqa: E731
    for i in (1, 3):  # sampled: γ fixed, the same steps as alone
        assert proposed(together[i]) == proposed(alone[i])
    # the positive control: the greedy requests drafted less among the others than alone
    assert sum(sum(proposed(together[i])) for i in (0, 2)) < sum(sum(proposed(alone[i])) for i in (0, 2))


def test_a_batch_pass_is_priced_on_the_measured_wide_points_and_rows():
    from verispec.control.costs import BATCH_WIDTHS

    measured = [0.05] + [1.6 + 0.1 * i for i in range(len(BATCH_WIDTHS))]  # ρ, then T(w)/T(1) at BATCH_WIDTHS
    calls = []
    costs = CostModel([1.0, 1.0, 1.0, 1.0, 1.2, 1.4, 1.6, 1.8], batch=lambda: calls.append(1) or measured)
    assert costs.pass_cost(BATCH_WIDTHS[0]) == pytest.approx(1.6) and costs.pass_cost(BATCH_WIDTHS[1], rows=3) == pytest.approx(1.7 + 0.1)
    halfway = (BATCH_WIDTHS[2] + BATCH_WIDTHS[3]) // 2
    want = 1.8 + (1.9 - 1.8) * (halfway - BATCH_WIDTHS[2]) / (BATCH_WIDTHS[3] - BATCH_WIDTHS[2])
    assert costs.pass_cost(halfway) == pytest.approx(want)
    assert costs.pass_cost(12) == pytest.approx(1.8 + (1.6 - 1.8) * 4 / (BATCH_WIDTHS[0] - 8))  # between the curve's end and 16
    assert costs.pass_cost(2 * BATCH_WIDTHS[-1]) > measured[-1] and calls == [1]  # measured once, past the last extrapolated

    def broken():
        calls.append(2)
        raise RuntimeError("no second cache")
    failing = CostModel([1.0, 1.0, 1.0, 1.0, 1.2, 1.4, 1.6, 1.8], batch=broken)
    with pytest.raises(RuntimeError):
        failing.pass_cost(20)
    assert failing.pass_cost(12) == pytest.approx(2.6) and calls == [1, 2]  # not tried again: the curve's second half


def test_batch_costs_are_measured_on_a_real_runner(tiny_target):
    from verispec.control.costs import measure_batch_costs

    runner = load_model(tiny_target, "int8").runner
    row, *wide = measure_batch_costs(runner, rows=3, widths=(4, 8), repeats=3)
    # ratios of timings on a tiny model beside the parallel suite: their size is noise (one T(1) caught behind another
    # worker made T(4)/T(1) 0.14), their shape and sign are not
    assert row >= 0.0 and len(wide) == 2 and all(0.0 < ratio < math.inf for ratio in wide)


def test_a_batch_whose_pricing_fails_steps_at_its_own_gamma(tiny_target, monkeypatch):
    import verispec.engine.together as together

    target = load_model(tiny_target, "int8")
    target.eos_ids = frozenset()
    engine = Engine(target, NgramDrafter(max_n=3), gamma=4, gamma_policy="analytic")
    monkeypatch.setattr(engine, "costs_for", lambda *args, **kwargs: CostModel([1.0] * 8, 0.0))
    config = GenerationConfig(max_new_tokens=12)
    alone = [engine.generate(prompt, config).token_ids for prompt in PROMPTS]

    def broken(outlooks, pass_cost):
        raise RuntimeError("no batch costs")
    monkeypatch.setattr(together, "size_together", broken)
    with pytest.warns(RuntimeWarning, match="own γ: no batch costs"):
        assert [r.token_ids for r in engine.generate_batch(PROMPTS, config, max_batch=4)] == alone


def test_a_server_measures_its_batch_costs_at_start(tiny_target, monkeypatch):
    from server_helpers import MODEL, LocalServer, tiny_engine

    from verispec.serving.http import create_app

    for max_batch, want in [(4, [1]), (1, [])]:  # one request at a time: never a batch, nothing to measure
        measured = []
        costs = CostModel([1.0] * 8, 0.0, batch=lambda measured=measured: measured.append(1) or [0.0] + [2.0] * 6)
        engine = tiny_engine(tiny_target)
        monkeypatch.setattr(engine, "costs_for", lambda *args, costs=costs, **kwargs: costs)
        with LocalServer(create_app(engine, model_name=MODEL, max_batch=max_batch)):
            assert measured == want  # at start, before any request


def test_an_analytic_policy_offers_its_class_alpha_and_cost_and_holds_a_paused_class():
    from verispec.control.gamma import AnalyticGamma, ConstantGamma
    from verispec.types import Hint

    policy = AnalyticGamma(CostModel([1.0] * 8, 0.2), gamma=3, may_pause=True)
    drafted, looked_up = policy.outlook(3), policy.outlook(3, Hint(key=2, prior=0.9, free=True))
    assert not drafted.fixed and drafted.c == pytest.approx(0.2) and drafted.alpha == pytest.approx(0.7)
    assert not looked_up.fixed and looked_up.c == 0.0 and looked_up.alpha == pytest.approx(0.9)
    behind = AnalyticGamma(CostModel([1.0] * 8, 0.2, 1.1), gamma=3).outlook(3, None, lag=10)  # T_d(2)/T_d(1) 1.1
    assert behind.catch_up == pytest.approx(0.2 * 0.1 * 10)
    assert policy.outlook(3, Hint(key=2, prior=0.9, free=True), lag=10).catch_up == 0.0  # lookup runs no draft model
    for _ in range(40):  # every draft rejected: the class pauses, its steps (plain or a probe) keep their γ
        policy.update(3, 0)
    assert policy.overall.gamma == 0 and policy.outlook(1).fixed
    assert ConstantGamma(4).outlook(4).fixed and AnalyticGamma(CostModel()).outlook(4).fixed  # nothing priced


def test_steps_that_run_no_draft_model_plan_on_the_calling_thread(tiny_target, tiny_draft, monkeypatch):
    """A request whose step drafts nothing (γ cut to 0) or drafts by prompt lookup (`Hint.free`) plans inline, not
    on a thread of its own waiting to batch draft forwards it will not make; a draft model's step goes to a thread."""
    import verispec.engine.together as together
    from verispec.engine.loop import Proposal
    from verispec.types import Hint

    target, draft = load_model(tiny_target, "int8"), load_model(tiny_draft, "int8")
    engine = Engine(target, DraftModelDrafter(draft, target.vocab_size), gamma=3, gamma_policy="constant")
    generations = [engine.start(prompt, GenerationConfig(max_new_tokens=8)) for prompt in PROMPTS[:3]]
    for generation in generations:
        while not generation.prefill_step():
            pass
    propose = generations[2].propose
    monkeypatch.setattr(generations[2], "propose", lambda: Proposal(Hint(1, 0.5, free=True), *propose()[1:]))
    monkeypatch.setattr(together, "size_together", lambda outlooks, pass_cost: [0] + [o.gamma for o in outlooks[1:]])
    flags = []
    monkeypatch.setattr(together, "draft_together", lambda tasks, batched: flags.append(batched) or [task() for task in tasks])
    plans = together.draft_plans(generations)
    assert flags == [[False, True, False]] and len(plans[0].draft) == 0 and len(plans[1].draft) > 0
    for generation in generations:
        generation.close()


def test_a_prompt_chunk_riding_in_the_pass_is_priced_with_it(tiny_target, monkeypatch):
    """The γs of a step whose pass also holds a prompt chunk (`draft_plans(riding=)`) are sized on that pass: its
    positions and its row priced with the drafts'. On a curve whose first positions past one cost the most, the drafts a
    bare pass cuts are kept beside a chunk that has paid for the width already (the positive control: without it, cut)."""
    import verispec.engine.together as together

    target = load_model(tiny_target, "int8")
    engine = Engine(target, NgramDrafter(max_n=3), gamma=3, gamma_policy="constant")
    generations = [engine.start(prompt, GenerationConfig(max_new_tokens=8)) for prompt in PROMPTS[:2]]
    costs = CostModel([1.0, 1.5, 1.7, 1.8], 0.1)
    monkeypatch.setattr(together, "_costs", lambda generations, ready: costs)
    seen = []
    monkeypatch.setattr(together, "size_together", lambda outlooks, pass_cost: seen.append(pass_cost) or [o.gamma for o in outlooks])
    together.draft_plans(generations, riding=16)
    context = sum(len(g.ids) for g in generations) // 2
    assert seen[0](5) == costs.pass_cost(5 + 16, 3, context) and seen[0](5) != costs.pass_cost(5, 2, context)
    for generation in generations:
        generation.close()
    concave = lambda positions: 1.0 + 0.5 * min(positions - 1, 3)  # noqa: E731 - 1.5 at 2 positions, 2.5 from 4 on
    outlooks = [Outlook(3, 0.4, fixed=False), Outlook(3, 0.4, fixed=False)]
    assert size_together(outlooks, concave) == [0, 0]  # a bare pass: the drafts' width costs more than they gain
    assert size_together(outlooks, lambda positions: concave(positions + 16)) == [3, 3]  # beside a chunk: free
