"""The plan chosen from measured costs (`--draft auto`) and the `auto` γ policy that pauses speculation
inside a request when it loses.

The plan is a pure function of the measured verification curve T(n), each drafter's cost c and its α
prior, checked against the theory's numbers; the policy is checked step by step on fed outcomes; the
CLI's default (`--dtype auto --draft auto`) is run end to end on the tiny model.
"""

from __future__ import annotations

import json

import pytest
import torch

from verispec.control import CostModel
from verispec.control.costs import LONG_CONTEXT, SHORT_CONTEXT
from verispec.control.gamma import PROBE_EVERY, make_gamma_policy
from verispec.control.plan import ALPHA_PRIORS, BACKEND_MARGIN, LOOKUP_EMPTY, MARGIN, best_gamma, choose_plan, worth_measuring
from verispec.control.theory import expected_speedup
from verispec.types import Hint

FLAT = [1.0, 1.01, 1.08, 1.15, 1.31]  # T(n) of a flat verifier (int8 on AVX-512): speculation pays
STEEP = [1.0, 1.89, 2.56, 3.13, 3.58]  # T(n) of ggml's Q4_K_M on the same CPU: nearly linear


def test_a_flat_curve_plans_the_drafter_the_theory_prefers():
    plan = choose_plan("int8", FLAT, {"ngram": 0.0, "model": 0.31}, max_gamma=4)
    speedup, gamma = plan.predicted["ngram"]
    assert (gamma, speedup) == best_gamma(ALPHA_PRIORS["ngram"], 0.0, FLAT, 4)
    assert speedup == pytest.approx(expected_speedup(ALPHA_PRIORS["ngram"], gamma, 0.0, lambda g: FLAT[g] / FLAT[0]))
    best = max(plan.predicted, key=lambda spec: plan.predicted[spec][0])
    assert plan.drafter == best and plan.gamma == plan.predicted[best][1] >= 1
    assert "plan: int8 · draft" in plan.summary()


def test_a_steep_curve_or_a_costly_draft_plans_plain_decoding():
    """ggml's curve: even a free drafter at α 0.5 is predicted slower than plain decoding."""
    plan = choose_plan("gguf", STEEP, {"ngram": 0.0, "model": 0.62}, max_gamma=4)
    assert plan.drafter == "none" and plan.gamma == 0
    assert all(speedup < MARGIN for speedup, _ in plan.predicted.values())
    assert "plain decoding" in plan.summary() and "ngram" in plan.summary()


def test_hybrid_is_prompt_lookup_with_its_empty_steps_given_to_its_draft():
    """`hybrid` is predicted as prompt lookup's steps with the share that draft nothing (`LOOKUP_EMPTY`) taken by its
    draft model: on a flat curve a draft at c 0.14 (SmolLM2 beside the 1.5B, timed in turns) raises the prediction
    and is the plan, as in the formula by hand; a draft costing more than its extra tokens bring (c 0.6) lowers it and
    prompt lookup stays the plan. The bound before measuring is that prediction at the least cost."""
    lookup_plan = choose_plan("kquant", FLAT, {"ngram": 0.0}, max_gamma=4)
    lookup = lookup_plan.predicted["ngram"]
    cheap = choose_plan("kquant", FLAT, {"ngram": 0.0, "hybrid:draft=small": 0.14}, max_gamma=4)
    assert cheap.drafter == "hybrid:draft=small" and cheap.predicted["hybrid:draft=small"][0] > lookup[0]
    speedup, gamma = cheap.predicted["hybrid:draft=small"]
    time = LOOKUP_EMPTY + (1 - LOOKUP_EMPTY) * FLAT[lookup[1]]
    alpha = ALPHA_PRIORS["hybrid"]
    extra_tokens, extra_time = alpha * (1 - alpha**gamma) / (1 - alpha), 0.14 * gamma + FLAT[gamma] - 1
    assert speedup == pytest.approx((lookup[0] * time + LOOKUP_EMPTY * extra_tokens) / (time + LOOKUP_EMPTY * extra_time))
    costly = choose_plan("kquant", FLAT, {"ngram": 0.0, "hybrid:draft=small": 0.6}, max_gamma=4)
    assert costly.drafter == "ngram" and costly.predicted["hybrid:draft=small"][0] < lookup[0]
    worth, bound = worth_measuring(0.14, FLAT, 4, lookup[0], ALPHA_PRIORS["hybrid"], lookup)
    assert worth and bound == pytest.approx(speedup)
    assert not worth_measuring(0.6, FLAT, 4, lookup[0], ALPHA_PRIORS["hybrid"], lookup)[0]


def test_the_plan_drafts_no_further_than_the_backend_verifies_exactly():
    plan = choose_plan("gguf", FLAT, {"ngram": 0.0}, max_gamma=1, alphas={"ngram": 0.9})
    assert plan.gamma == 1 and plan.predicted["ngram"][1] == 1
    assert choose_plan("gguf", FLAT, {"ngram": 0.0}, max_gamma=0).drafter == "none"  # nothing verifies exactly


def _steep_costs(c: float) -> CostModel:
    return CostModel([1.0, 1.89, 2.56, 3.13, 3.58], draft_token_seconds=c)


def test_a_draft_model_is_measured_only_where_its_least_cost_could_win():
    """The bound is the prediction at the least cost with no catching-up cost: any cost the draft can have
    predicts no more, so a draft left unmeasured could never have been the plan."""
    rival = best_gamma(ALPHA_PRIORS["ngram"], 0.0, FLAT, 4)[1]
    worth, bound = worth_measuring(0.05, FLAT, 4, rival)  # nearly free on a flat curve: measure it
    assert worth and bound > rival
    worth, bound = worth_measuring(0.32, STEEP, 4, rival)  # the shipped pair's share of weights, ggml's curve
    assert not worth and bound == best_gamma(ALPHA_PRIORS["model"], 0.32, STEEP, 4)[1] < MARGIN
    for c in (0.32, 0.4, 0.6, 1.0):
        for catch_up in (1.0, 1.2):
            assert best_gamma(ALPHA_PRIORS["model"], c, STEEP, 4, catch_up)[1] <= bound
    assert not worth_measuring(0.0, FLAT, 0, 0.0)[0]  # nothing verifies exactly: no draft can be the plan


def test_a_shipped_target_fetches_no_draft_model_that_could_not_win(tiny_target, tiny_draft, monkeypatch):
    """With a shipped pair's sizes (`least_cost_ratio`), a draft as large as its target is never loaded, neither as
    the draft model nor as `hybrid`'s draft (`hybrid_draft_for`, its head cut to `hybrid_draft_vocab` ids on
    verispec's own runner, whole on llama.cpp's): the plan lists their bounds; a draft a thousandth of its size is
    loaded and measured for both (the control)."""
    import verispec.engine.build as build
    from verispec.models import registry

    hybrid = f"hybrid:draft={tiny_draft},window={build.HYBRID_WINDOW},vocab=24"
    for draft_weights, measured in ((10**9, False), (10**6, True)):
        shipped = {str(tiny_target): registry.ShippedModel("t", (), "file", "t", hybrid_draft=str(tiny_draft),
                                                           hybrid_draft_vocab=24, step_weights=10**9),
                   str(tiny_draft): registry.ShippedModel("d", (), "file", "d", step_weights=draft_weights)}
        monkeypatch.setattr(build, "SHIPPED_MODELS", shipped)
        monkeypatch.setattr(registry, "SHIPPED_MODELS", shipped)
        builder = build.EngineBuilder(str(tiny_target), default_draft=str(tiny_draft))
        plan = builder.plan(4, "float32")
        for spec in ("model", hybrid):
            assert (spec in plan.predicted) == measured and (spec in plan.bounds) != measured
        assert (str(tiny_draft) in builder.models.names) == measured
        if not measured:
            assert "model ≤" in plan.summary() and f"{hybrid} ≤" in plan.summary() and "(not measured)" in plan.summary()
    assert hybrid.removesuffix(",vocab=24") in builder._draft_candidates(own_runner=False)  # a llama.cpp draft's head stays whole


def test_the_auto_policy_pauses_when_speculation_loses_and_probes_to_resume():
    """Rejections on a steep curve: γ drops to 0 (plain steps), with a one-token probe every
    PROBE_EVERY steps; once the probes are accepted it speculates again. The analytic policy never
    pauses (control)."""
    policy = make_gamma_policy("auto", 2, _steep_costs(0.0))
    analytic = make_gamma_policy("analytic", 2, _steep_costs(0.0))
    for _ in range(4):
        policy.update(2, 0)
        analytic.update(2, 0)
    assert analytic.next_gamma() >= 1
    gammas = [policy.next_gamma() for _ in range(PROBE_EVERY)]
    assert gammas == [0] * (PROBE_EVERY - 1) + [1]
    for _ in range(200):  # the probes accepted: α climbs until speculation pays again
        policy.update(1, 1)
        if policy.next_gamma() >= 1:
            break
    assert policy.next_gamma() >= 1


def test_the_policy_sizes_and_pauses_each_hinted_class_of_steps_apart():
    """Prompt lookup's classes (`DraftSession.hint`): one-token matches always rejected, three-token matches
    always accepted. The weak class pauses (γ 0, probing), the strong one drafts far, each from its own prior;
    steps without a hint keep the starting γ. Without hints the same steps share one α and one γ, which drafts
    after the weak matches too (control)."""
    costs = CostModel([1.0, 1.15, 1.2, 1.25, 1.3, 1.45, 1.6, 1.75, 1.9, 2.05, 2.2, 2.35, 2.5], draft_token_seconds=0.0)
    weak, strong = Hint(1, 0.25), Hint(3, 0.8)
    hinted, shared = make_gamma_policy("auto", 2, costs), make_gamma_policy("auto", 2, costs)
    assert hinted.next_gamma(strong) > hinted.next_gamma(weak) >= 1  # the priors alone part them
    for _ in range(12):
        hinted.update(hinted.next_gamma(weak) or 1, 0, hint=weak)
        gamma = hinted.next_gamma(strong)
        hinted.update(gamma, gamma, hint=strong)
        shared.update(1, 0)
        shared.update(gamma, gamma)
    assert sorted(hinted.next_gamma(weak) for _ in range(PROBE_EVERY)) == [0] * (PROBE_EVERY - 1) + [1]  # one probe
    assert hinted.next_gamma(strong) >= 6 and hinted.next_gamma() == 2  # unhinted steps: the starting γ
    assert shared.next_gamma() >= 1 and shared.alpha == pytest.approx(hinted.alpha)  # one γ: drafts after weak matches too


def test_a_class_that_costs_no_draft_forward_is_priced_at_nothing():
    """`Hint.free` (hybrid's prompt-lookup steps beside its draft model's): at the same α the free class drafts
    further than the class that pays c for each token, and keeps drafting where the paid one pauses."""
    costs = CostModel([1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35, 1.4], draft_token_seconds=0.3)
    lookup, model = Hint(2, 0.5, free=True), Hint(0, 0.5)
    policy = make_gamma_policy("auto", 2, costs, max_gamma=8)
    assert policy.next_gamma(lookup) > policy.next_gamma(model) >= 1
    for _ in range(20):  # both classes accept a quarter of what they draft
        for hint in (lookup, model):
            gamma = policy.next_gamma(hint) or 1
            policy.update(gamma, gamma // 4, hint=hint)
    assert policy.next_gamma(lookup) >= 1 and policy.next_gamma(model) == 0


def test_token_trees_are_priced_by_the_positions_they_verify():
    """A tree drafter's step of depth γ verifies its nodes: on a curve that rises with width the analytic policy
    drafts shallower trees when they hold three nodes a depth than when each depth is one node (a chain, the
    control: the same steps, the same α), and on a flat curve it drafts as deep either way."""
    rising = [1.0 + 0.12 * n for n in range(40)]  # T(1 … 40)
    flat = [1.0 + 0.001 * n for n in range(40)]
    gammas, alphas = {}, set()
    for name, curve in (("rising", rising), ("flat", flat)):
        for nodes_per_depth in (1, 3):
            policy = make_gamma_policy("analytic", 4, CostModel(curve, draft_token_seconds=0.0))
            for _ in range(20):
                policy.update(4, 3, nodes=nodes_per_depth * 4)  # depth 4, three accepted
            gammas[name, nodes_per_depth], alphas = policy.next_gamma(), alphas | {policy.alpha}
            assert policy.positions(5) == nodes_per_depth * 5
    assert len(alphas) == 1
    assert gammas["rising", 3] < gammas["rising", 1]
    assert gammas["flat", 3] == gammas["flat", 1] == 12  # the policy's deepest


def test_verification_costs_follow_the_context_a_step_attends():
    """T(n)/T(1) is measured after SHORT_CONTEXT and LONG_CONTEXT tokens and interpolated linearly in
    between (extrapolated past the long one); the auto policy that speculates after a short context
    pauses after a long one, where each verified position attends far more."""
    short, long = [1.0, 1.05, 1.10, 1.15], [1.0, 1.45, 1.90, 2.35]  # T(1…4), seconds after 64 and 1,024 tokens
    costs = CostModel(short, 0.0, long_target_seconds=long)
    assert costs.verify_cost(1) == costs.verify_cost(1, SHORT_CONTEXT) == pytest.approx(1.05)
    assert costs.verify_cost(1, LONG_CONTEXT) == pytest.approx(1.45)
    assert costs.verify_cost(1, (SHORT_CONTEXT + LONG_CONTEXT) // 2) == pytest.approx(1.25)
    assert costs.verify_cost(1, 2 * LONG_CONTEXT - SHORT_CONTEXT) == pytest.approx(1.85)
    assert costs.verify_cost(1, 0) == pytest.approx(1.05) and CostModel(short, 0.0).verify_cost(1, 5000) == pytest.approx(1.05)
    after = {}
    for context in (100, 1500):
        policy = make_gamma_policy("auto", 2, costs)
        for _ in range(6):
            policy.update(2, 0, context)  # α ≈ 0.35 with the prior: pays only where verifying is cheap
        after[context] = policy.next_gamma()
    assert after[100] >= 1 and after[1500] == 0


def test_the_cost_model_predicts_the_steps_a_generation_took():
    """Tokens over Σ (drafts · c + T(n)/T(1) at the step's context): by hand for three steps; a draft model's catching-up
    forward after the step that kept its whole draft."""
    from verispec.types import StepRecord

    costs = CostModel([1.0, 1.2, 1.4], 0.1, long_target_seconds=[1.0, 1.2 + 0.96, 1.4])  # T(2)/T(1) grows 0.001 a token
    steps = [StepRecord(0, 0, 0.0, 1.0), StepRecord(2, 2, 0.0, 1.0), StepRecord(1, 0, 0.0, 1.0)]  # prefill's token, then two
    cost = 1.0 + (2 * 0.1 + 1.4) + (1 * 0.1 + 1.2 + 0.001 * (SHORT_CONTEXT + 4 - SHORT_CONTEXT))
    assert costs.speedup_of_steps(steps, SHORT_CONTEXT) == pytest.approx(5 / cost)
    steps[2].width = 2  # a tree of depth 1 with two nodes: verified as three positions
    assert costs.speedup_of_steps(steps, SHORT_CONTEXT) == pytest.approx(5 / (cost - 1.204 + 1.4))
    assert CostModel().speedup_of_steps(steps, 10) is None and costs.speedup_of_steps([], 10) is None
    steps[2].width = None
    catching = CostModel([1.0, 1.2, 1.4], 0.1, draft_catch_up=1.5, long_target_seconds=costs.long_target_seconds)
    assert catching.speedup_of_steps(steps, SHORT_CONTEXT) == pytest.approx(5 / (cost + 0.1 * 0.5))  # after the whole draft
    for step in steps[1:]:  # prompt lookup's steps (`hybrid`'s): no draft forward to pay, none to catch up
        step.free = True
    assert catching.speedup_of_steps(steps, SHORT_CONTEXT) == pytest.approx(5 / (cost - 3 * 0.1))


def test_the_steps_a_generation_took_are_priced_in_seconds():
    """Drafting at the draft's seconds a token, each verification at T(1) after its own context (here 2 s a T(1) at
    SHORT_CONTEXT, 4 s at LONG_CONTEXT): what `verispec generate` holds its measured steps against."""
    from verispec.types import StepRecord

    costs = CostModel([2.0, 2.4], 0.5, long_target_seconds=[4.0, 4.8])  # T(2)/T(1) 1.2 at both; c 0.25
    steps = [StepRecord(1, 1, 0.0, 0.0), StepRecord(1, 0, 0.0, 0.0)]
    halfway = (SHORT_CONTEXT + LONG_CONTEXT) // 2  # T(1) 3 s there
    drafting, verification = costs.priced_seconds(steps, halfway - 2)  # the second step verifies at `halfway`
    assert drafting == pytest.approx(2 * 0.5)
    assert verification == pytest.approx(1.2 * costs.one_seconds(halfway - 2) + 1.2 * 3.0)
    assert CostModel().priced_seconds(steps, 10) is None


def test_the_long_curve_is_measured_and_cached_beside_the_short_one(tiny_target, tmp_path, monkeypatch):
    """A target whose context holds LONG_CONTEXT tokens gets both curves (kept apart in the cache table,
    read back later); one with a shorter context only the short one."""
    from conftest import make_tiny_model

    from verispec.models.loading import load_model
    from verispec.paths import read_table

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    model = load_model(make_tiny_model(tmp_path / "long", seed=3, context=2 * LONG_CONTEXT))
    costs = CostModel.calibrated(model, 3)
    assert len(costs.target_seconds) == len(costs.long_target_seconds) == 3
    keys = list(read_table("verify_costs.json"))
    assert len(keys) == 2 and sum(key.endswith(f"|context={LONG_CONTEXT}") for key in keys) == 1
    assert CostModel.calibrated(model, 3).long_target_seconds == costs.long_target_seconds  # read back, not measured
    assert CostModel.calibrated(load_model(tiny_target), 3).long_target_seconds is None  # a 128-token context


def test_a_measured_curve_is_fitted_non_decreasing_before_it_prices_a_step(tiny_target, tmp_path, monkeypatch):
    """A dip in a measured T(n) is noise (more positions are no less work): the points after T(1) are pooled into
    the nearest non-decreasing curve, T(1) kept as measured, a monotone curve left as it is; a calibrated cost
    model reads the cached curve fitted, and the dip no longer prices a deeper γ below a shallower one."""
    from verispec.control import costs as costs_module
    from verispec.control.costs import monotone_curve
    from verispec.models.loading import load_model

    assert monotone_curve([1.0, 1.2, 1.3, 1.1, 1.4]) == pytest.approx([1.0, 1.2, 1.2, 1.2, 1.4])
    assert monotone_curve([1.0, 0.8, 1.1]) == pytest.approx([1.0, 1.0, 1.1])  # never below T(1)
    assert monotone_curve(FLAT) == FLAT and monotone_curve([2.0]) == [2.0] and monotone_curve([]) == []
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    dip = [1.0, 1.2, 1.3, 1.1, 1.4]
    monkeypatch.setattr(costs_module, "measure_verify_curve", lambda runner, n, context=SHORT_CONTEXT: dip[:n])
    for _ in range(2):  # measured, then read back from the cache: fitted both times
        costs = CostModel.calibrated(load_model(tiny_target), 5, long=False)
        assert costs.target_seconds == pytest.approx([1.0, 1.2, 1.2, 1.2, 1.4])
        assert costs.verify_cost(3) >= costs.verify_cost(2)


def test_a_drafts_cost_ratio_is_its_forward_and_the_targets_timed_in_turns(tiny_target, tiny_draft, tmp_path, monkeypatch):
    """c comes from the two single-token forwards timed alternately (`interleaved_token_seconds`), not from two
    curves measured apart (a shared CPU's drift moved it by a third): whatever the curves say, c is the turns'
    ratio, measured once and read back from the cache."""
    from verispec.control import costs as costs_module
    from verispec.models.loading import load_model

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    timed = []
    monkeypatch.setattr(costs_module, "interleaved_token_seconds", lambda runners: timed.append(runners) or [0.04, 0.006])
    target, draft = load_model(tiny_target), load_model(tiny_draft)
    for _ in range(2):
        model = CostModel.calibrated(target, 3, draft, long=False)
        assert model.draft_cost_ratio() == pytest.approx(0.15)
        assert model.draft_token_seconds == pytest.approx(0.15 * model.target_seconds[0])
    assert timed == [[target.runner, draft.runner]]  # once: then the cache


def test_a_curve_is_timed_after_placeholder_slots_not_a_prefill(tiny_target):
    """The own runner times T(n) after `context` slots it counts as held (`placeholder_cache`): no forward feeds the
    context, only the timed positions, and a forward after those slots scores as after any context."""
    from verispec.control.costs import measure_verify_curve
    from verispec.models.loading import load_model

    runner = load_model(tiny_target).runner
    cache = runner.placeholder_cache(100, 104)
    assert cache.length == 100 and cache.capacity >= 104
    assert runner.forward(cache, torch.tensor([3, 4]), logits="all").isfinite().all() and cache.length == 102
    fed, forward = [], runner.forward
    runner.forward = lambda cache, tokens, **kwargs: (fed.append(len(tokens)), forward(cache, tokens, **kwargs))[1]
    assert len(measure_verify_curve(runner, 3, context=100, repeats=1, attempts=1)) == 3
    assert sorted(set(fed)) == [1, 2, 3]  # never the 100-token context


def test_a_plan_times_the_long_context_only_for_the_backend_it_keeps(tmp_path, monkeypatch):
    """Backends are compared on the short-context curve; only the kept plan's γ policy reads the curve after
    LONG_CONTEXT tokens, so only that backend is timed there (a first run measured every backend's)."""
    from conftest import make_tiny_model

    from verispec.engine.build import EngineBuilder
    from verispec.paths import read_table

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    folder = make_tiny_model(tmp_path / "long", seed=5, context=2 * LONG_CONTEXT)
    engine = EngineBuilder(str(folder)).planned_engine(backends=["float32", "int8"], settle=True)
    long_keys = [key for key in read_table("verify_costs.json") if key.endswith(f"|context={LONG_CONTEXT}")]
    expected = 0 if engine.plan.drafter == "none" else 1
    assert len(long_keys) == expected
    curves = [key for key in read_table("verify_costs.json") if not key.startswith("prefill")]
    assert len(curves) == 2 + expected  # each backend's short curve
    if expected:  # the kept backend's (int8 variants are tagged ",int8")
        assert (",int8" in long_keys[0]) == (engine.plan.precision == "int8")
        assert engine.costs.long_target_seconds is not None


def test_cli_default_is_the_auto_plan(capsys, tiny_target):
    """No --dtype, no --draft: a Hugging Face folder runs in float32 (no GGUF), the plan line is
    printed, and the tokens are those of plain decoding."""
    from verispec.cli import main

    common = ["generate", "t11 t3 t3 t8", "--raw", "--json", "--target", str(tiny_target), "--max-new-tokens", "10"]
    assert main(common) == 0
    captured = capsys.readouterr()
    auto = json.loads(captured.out)
    assert "plan: float32 ·" in captured.err and "ngram" in captured.err
    assert main([*common, "--draft", "none", "--dtype", "float32"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == auto["token_ids"]


def test_the_backend_with_the_fewest_predicted_seconds_a_token_is_kept():
    """llama.cpp's steep curve plans plain decoding at its T(1); a flat backend a little slower per
    token that speculates is predicted faster by more than BACKEND_MARGIN, and kept; with a poor drafter, or
    a gain under BACKEND_MARGIN, the first (default) backend stays; a backend 7 % faster at plain decoding (the
    AVX2 build's kquant against ggml) is kept."""
    from verispec.control.plan import choose_backend

    steep = choose_plan("gguf", [0.033 * r for r in STEEP], {"ngram": 0.0}, max_gamma=4)
    flat = choose_plan("kquant", [0.036 * r for r in FLAT], {"ngram": 0.0}, max_gamma=4)
    chosen = choose_backend([steep, flat])
    assert chosen.precision == "kquant" and chosen.drafter == "ngram"
    assert chosen.backends["gguf"] == pytest.approx(0.033)
    assert chosen.backends["kquant"] == pytest.approx(0.036 / flat.predicted["ngram"][0])
    assert "predicted ms a token: gguf 33.0, kquant" in chosen.summary()
    slow = choose_plan("kquant", [0.050 * r for r in FLAT], {"ngram": 0.0}, max_gamma=4, alphas={"ngram": 0.1})
    assert choose_backend([steep, slow]).precision == "gguf"
    # faster, but not by BACKEND_MARGIN: the default backend stays (another backend is other numerics)
    close = choose_plan("kquant", [0.033 * flat.speedup / (BACKEND_MARGIN * 0.99) * r for r in FLAT], {"ngram": 0.0}, max_gamma=4)
    assert close.token_seconds / close.speedup < 0.033 and choose_backend([steep, close]).precision == "gguf"
    plain_faster = choose_plan("kquant", [0.0283 * r for r in STEEP], {"ngram": 0.0}, max_gamma=4, alphas={"ngram": 0.1})
    assert plain_faster.drafter == "none" and choose_backend([steep, plain_faster]).precision == "kquant"


def test_a_backend_as_fast_a_token_and_faster_at_prefill_is_kept():
    """kquant beside llama.cpp on the AVX2 EPYC: T(1) within noise of ggml's, a prompt token 1.6× cheaper. Where
    decoding is within BACKEND_MARGIN the faster prefill decides; never where decoding is slower by more, or
    where a prefill speed is unknown."""
    from dataclasses import replace

    from verispec.control.plan import choose_backend

    def plain(precision, token_seconds, prefill_seconds):
        plan = choose_plan(precision, [token_seconds * r for r in STEEP], {"ngram": 0.0}, max_gamma=2, alphas={"ngram": 0.1})
        assert plan.drafter == "none"
        return replace(plan, prefill_seconds=prefill_seconds)

    gguf, kquant = plain("gguf", 0.070, 0.019), plain("kquant", 0.071, 0.012)
    chosen = choose_backend([gguf, kquant])
    assert chosen.precision == "kquant" and "a prompt token: gguf 19.0, kquant 12.0" in chosen.summary()
    assert choose_backend([gguf, plain("kquant", 0.070 * BACKEND_MARGIN * 1.01, 0.012)]).precision == "gguf"
    assert choose_backend([gguf, plain("kquant", 0.071, 0.019 / BACKEND_MARGIN * 1.01)]).precision == "gguf"
    assert choose_backend([gguf, replace(kquant, prefill_seconds=None)]).precision == "gguf"


def test_backends_are_compared_on_their_t1_timed_in_turns(tiny_target, monkeypatch):
    """Each backend's T(1) is timed alternately with the others' (`interleaved_token_seconds`), and the choice
    reads those, not its curve's T(1), measured a minute apart from the other backend's."""
    import verispec.engine.build as build
    from verispec.control.costs import interleaved_token_seconds
    from verispec.models.loading import load_model

    runners, order = [load_model(tiny_target).runner, load_model(tiny_target, "int8").runner], []
    for index, runner in enumerate(runners):
        def counted(cache, tokens, _index=index, _forward=runner.forward, **kwargs):
            order.append(_index)
            return _forward(cache, tokens, **kwargs)

        runner.forward = counted
    seconds = interleaved_token_seconds(runners, rounds=3)
    assert order == [0, 1] * 3 and all(0 < t < 1 for t in seconds)
    monkeypatch.setattr(build, "prefill_seconds_per_token", lambda model: 0.01)  # a tie: decoding decides
    # 10× apart: beyond any ratio of the two plans' predicted speedups on the tiny model's noisy curves
    for timed, expected in (([1.0, 0.1], "int8"), ([0.1, 1.0], "float32")):
        monkeypatch.setattr(build, "interleaved_token_seconds", lambda runners, _t=timed: _t)
        engine = build.EngineBuilder(str(tiny_target)).planned_engine(backends=["float32", "int8"])
        assert engine.plan.precision == expected and engine.plan.token_seconds == min(timed)
        assert engine.plan.backends[expected] == pytest.approx(min(timed) / engine.plan.speedup)


def test_a_first_run_reads_the_tokenizer_while_the_kernels_compile(monkeypatch, capsys):
    """`auto_backends` reads a GGUF's tokenizer on a thread of its own while kquant's kernels build; both show on the
    one spinner the terminal has (`progress.status` from two threads at once), and each is logged done."""
    import threading
    import time

    import verispec.engine.build as build
    import verispec.models.kquant as kquant
    from verispec.progress import status

    started, threads = threading.Barrier(2, timeout=10), {}

    def read(path):  # each waits for the other to begin: they run at the same time or the barrier times out
        with status("reading"):
            threads["read"] = threading.current_thread().name
            started.wait()
            time.sleep(0.05)

    def compile_kernels(path):
        with status("compiling"):
            threads["compile"] = threading.current_thread().name
            started.wait()
        return True

    monkeypatch.setattr(build, "auto_precision", lambda target, device: "gguf")
    monkeypatch.setattr(build, "gguf_file", lambda target: target)
    monkeypatch.setattr(build, "gguf_tokenizer_folder", read)
    monkeypatch.setattr(kquant, "kquant_suits", compile_kernels)
    assert build.auto_backends("model.gguf") == ["gguf", "kquant"]
    assert threads["compile"] == threading.current_thread().name and threads["read"].startswith("verispec-tokenizer")
    logged = capsys.readouterr().err
    assert "reading: done" in logged and "compiling: done" in logged


def test_a_settled_backend_choice_is_remembered_and_only_that_backend_loads_again(tiny_target):
    """The first run plans every backend (one in memory at a time) and keeps the fastest; a later run with
    the same target, candidates, threads and CPU loads only the backend chosen before."""
    from verispec.engine.build import EngineBuilder, backend_choices

    first = EngineBuilder(str(tiny_target))
    engine = first.planned_engine(backends=["float32", "int8"], settle=True)
    chosen = engine.plan.precision
    assert set(engine.plan.backends) == {"float32", "int8"} and first.dtype == chosen
    assert [key[1] for key in first.models._models] == [chosen]  # the other backend was let go
    assert any(value["precision"] == chosen for value in backend_choices().values())
    later = EngineBuilder(str(tiny_target))
    again = later.planned_engine(backends=["float32", "int8"], settle=True)
    assert again.plan.precision == chosen and again.plan.backends == engine.plan.backends
    assert [key[1] for key in later.models._models] == [chosen]


def test_a_remembered_plan_loads_no_draft_model_it_did_not_choose(tiny_target, tiny_draft, monkeypatch):
    """A shipped target plans prompt lookup against its default draft model, which the first run loads to read
    its cost and then lets go unless the plan chose it (here it chooses prompt lookup); a later run takes the
    remembered plan and loads the draft model only if the plan chose it: both runs hold the same models."""
    import verispec.engine.build as build

    monkeypatch.setattr(build, "SHIPPED_MODELS", {str(tiny_target): None})  # "model" becomes a candidate
    first = build.EngineBuilder(str(tiny_target), default_draft=str(tiny_draft))
    engine = first.planned_engine(backends=["float32", "int8"], settle=True)
    assert set(engine.plan.predicted) == {"ngram", "model"}  # the draft model was loaded to read its cost
    expected = {str(tiny_target)} | ({str(tiny_draft)} if engine.plan.drafter == "model" else set())
    assert {key[0] for key in first.models._models} == expected  # and let go unless chosen
    later = build.EngineBuilder(str(tiny_target), default_draft=str(tiny_draft))
    again = later.planned_engine(backends=["float32", "int8"], settle=True)
    assert again.plan == engine.plan
    assert {key[0] for key in later.models._models} == expected
    assert build.remembered_plan({"precision": "int8"}) is None  # an older record: planned again
    assert build.remembered_plan({"plan": {"precision": "int8", "unknown": 1}}) is None  # another version's form
    other = build.EngineBuilder(str(tiny_target), default_draft=str(tiny_target))  # another default draft: planned anew
    assert other._choice_key(["float32", "int8"]) != later._choice_key(["float32", "int8"])
    key = later._choice_key(["float32", "int8"])
    monkeypatch.setattr(build, "CHOICE_RULE", build.CHOICE_RULE + 1)  # backends compared another way: chosen anew
    assert later._choice_key(["float32", "int8"]) != key
