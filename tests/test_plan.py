"""The plan chosen from measured costs (`--draft auto`) and the `auto` γ policy that pauses speculation
inside a request when it loses.

The plan is a pure function of the measured verification curve T(n), each drafter's cost c and its α
prior, checked against the theory's numbers; the policy is checked step by step on fed outcomes; the
CLI's default (`--dtype auto --draft auto`) is run end to end on the tiny model.
"""

from __future__ import annotations

import json

import pytest

from verispec.control import CostModel
from verispec.control.gamma import PROBE_EVERY, make_gamma_policy
from verispec.control.plan import ALPHA_PRIORS, BACKEND_MARGIN, MARGIN, best_gamma, choose_plan
from verispec.control.theory import expected_speedup

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


def test_the_plan_drafts_no_further_than_the_backend_verifies_exactly():
    plan = choose_plan("gguf", FLAT, {"ngram": 0.0}, max_gamma=1, alphas={"ngram": 0.9})
    assert plan.gamma == 1 and plan.predicted["ngram"][1] == 1
    assert choose_plan("gguf", FLAT, {"ngram": 0.0}, max_gamma=0).drafter == "none"  # nothing verifies exactly


def _steep_costs(c: float) -> CostModel:
    return CostModel([1.0, 1.89, 2.56, 3.13, 3.58], draft_token_seconds=c)


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
    assert "ms a token: gguf 33.0, kquant" in chosen.summary()
    slow = choose_plan("kquant", [0.050 * r for r in FLAT], {"ngram": 0.0}, max_gamma=4, alphas={"ngram": 0.1})
    assert choose_backend([steep, slow]).precision == "gguf"
    # faster, but not by BACKEND_MARGIN: the default backend stays (another backend is other numerics)
    close = choose_plan("kquant", [0.033 * flat.speedup / (BACKEND_MARGIN * 0.99) * r for r in FLAT], {"ngram": 0.0}, max_gamma=4)
    assert close.token_seconds / close.speedup < 0.033 and choose_backend([steep, close]).precision == "gguf"
    plain_faster = choose_plan("kquant", [0.0283 * r for r in STEEP], {"ngram": 0.0}, max_gamma=4, alphas={"ngram": 0.1})
    assert plain_faster.drafter == "none" and choose_backend([steep, plain_faster]).precision == "kquant"


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
