"""A step taken together keeps its account (`engine/together.StepAccount`): its seconds by part beside what the cost
model its batch was sized on priced them at; the server's `/metrics` sums them and gives measured ÷ priced over the
latest priced steps."""

from __future__ import annotations

import pytest

from verispec import Engine, GenerationConfig
from verispec.control import CostModel
from verispec.control.batch import drafting_cost
from verispec.control.costs import LONG_CONTEXT, SHORT_CONTEXT
from verispec.drafters import DraftModelDrafter
import verispec.engine.together as together
from verispec.engine.together import StepAccount
from verispec.models.loading import load_model
from verispec.serving.http.metrics import COST_WINDOW_STEPS, Metrics

PROMPTS = [[5, 9, 2, 7, 5, 9, 2, 7], [22, 3, 3, 3, 8, 2, 30, 42, 5], [40, 41, 40, 41]]


def test_t1_in_seconds_follows_the_context_between_and_past_the_two_curves():
    costs = CostModel([0.010, 0.011], long_target_seconds=[0.020, 0.022])
    assert costs.one_seconds() == costs.one_seconds(10) == pytest.approx(0.010)  # at or before the short curve: its T(1)
    assert costs.one_seconds((SHORT_CONTEXT + LONG_CONTEXT) // 2) == pytest.approx(0.015)
    assert costs.one_seconds(2 * LONG_CONTEXT - SHORT_CONTEXT) == pytest.approx(0.030)  # extrapolated past the long one
    assert CostModel([0.010, 0.011]).one_seconds(5000) == pytest.approx(0.010)  # no long curve: the short T(1)
    assert CostModel().one_seconds() is None


def step_batch(engine: Engine, configs: list[GenerationConfig], monkeypatch) -> tuple[StepAccount, list, list[int]]:
    """Three requests prefilled and stepped once together with an account: (the account, the outlooks the batch
    was sized on, the γs it sized)."""
    generations = [engine.start(prompt, config) for prompt, config in zip(PROMPTS, configs)]
    for generation in generations:
        while not generation.prefill_step():
            pass
    seen = {}
    size_together = together.size_together

    def recorded(outlooks, pass_cost):
        seen["outlooks"], seen["gammas"] = list(outlooks), size_together(outlooks, pass_cost)
        return seen["gammas"]
    monkeypatch.setattr(together, "size_together", recorded)
    account = StepAccount()
    outcomes = together.step_together(generations, account)
    assert not any(isinstance(outcome, BaseException) for outcome in outcomes)
    for generation in generations:
        generation.close()
    return account, seen["outlooks"], seen["gammas"]


def test_a_step_is_priced_as_its_batch_was_sized(tiny_target, tiny_draft, monkeypatch):
    """The drafts at their c with the draft model's catching up, the pass at T(positions)/T(1) after the rows' mean
    context, both in seconds of the measured T(1); its parts measured, within the whole."""
    target = load_model(tiny_target, "int8")
    target.eos_ids = frozenset()
    engine = Engine(target, DraftModelDrafter(load_model(tiny_draft, "int8"), target.vocab_size), gamma=3,
                    gamma_policy="analytic")
    costs = CostModel([0.010] * 6 + [0.011, 0.012], 0.0005, 1.2)  # seconds: T(n) flat to 6 positions, c 0.05
    monkeypatch.setattr(engine, "costs_for", lambda *args, **kwargs: costs)
    account, outlooks, gammas = step_batch(engine, [GenerationConfig(max_new_tokens=8)] * 3, monkeypatch)
    assert sum(gammas) > 0  # the positive control: something was drafted, so the drafting's price is not 0 by default
    assert account.priced_drafting == pytest.approx(0.010 * sum(map(drafting_cost, outlooks, gammas)))
    assert account.priced_drafting >= 0.0005 * sum(gammas)  # each draft token's seconds, a catching up on top
    positions = sum(gammas) + len(gammas)  # each row verifies its drafts and the token before them
    context = sum(len(p) + 1 for p in PROMPTS) // len(PROMPTS)  # each prompt and its first token
    assert account.costs is costs and account.context == context and (account.rows, account.positions) == (3, positions)
    assert account.priced_pass == pytest.approx(costs.one_seconds(context) * costs.pass_cost(positions, 3, context))
    assert 0 < account.drafting and 0 < account.target_pass and account.drafting + account.target_pass <= account.total


def test_a_step_no_policy_prices_is_measured_alone(tiny_target, monkeypatch):
    engine = Engine(load_model(tiny_target, "int8"), None)  # plain decoding measures no costs
    account, _, _ = step_batch(engine, [GenerationConfig(max_new_tokens=8)] * 3, monkeypatch)
    assert account.priced_drafting is None and account.priced_pass is None and account.costs is None
    assert 0 < account.target_pass <= account.total


def test_metrics_sum_the_parts_and_give_measured_over_priced_for_the_latest_priced_steps():
    metrics = Metrics()
    metrics.record_step(2, StepAccount(0.01, 0.05, 0.07))  # unpriced: in the parts, not in the ratio
    assert metrics.cost_ratios() == {}
    metrics.record_step(3, StepAccount(0.02, 0.10, 0.13, 0.01, 0.04))
    assert metrics.cost_ratios() == pytest.approx({"drafting": 2.0, "target_pass": 2.5})
    text = metrics.render()
    assert 'verispec_step_part_seconds_total{part="target_pass"} 0.150000' in text
    assert 'verispec_step_part_seconds_total{part="rest"} 0.020000' in text
    assert 'verispec_step_priced_seconds_total{part="target_pass",value="priced"} 0.040000' in text
    assert 'verispec_step_cost_ratio{part="target_pass"} 2.5000' in text
    for _ in range(COST_WINDOW_STEPS):  # the latest steps only: the machine as it runs now
        metrics.record_step(3, StepAccount(0.0, 0.04, 0.05, 0.0, 0.04))
    assert metrics.cost_ratios() == {"target_pass": pytest.approx(1.0)}  # drafting priced 0: left out


def test_a_load_test_holds_a_server_s_steps_against_their_prices(tiny_target, tiny_draft, monkeypatch):
    """Between two readings of `/metrics`, a level's steps measured over priced, by part; a server whose policy
    prices nothing (a constant γ) gives none."""
    import asyncio

    from server_helpers import MODEL, LocalServer, tiny_engine

    from verispec.serving.http import create_app
    from verispec.tools.bench.loadtest import measured_over_priced, run_level

    assert measured_over_priced({("target_pass", "measured"): 1.0, ("target_pass", "priced"): 1.0},
                                {("target_pass", "measured"): 4.0, ("target_pass", "priced"): 2.0,
                                 ("drafting", "measured"): 0.5, ("drafting", "priced"): 0.0}) == {"target_pass": 3.0}
    body = {"prompt": "t5 t6 t7 t5 t6 t7", "max_tokens": 8, "temperature": 0}
    for policy, priced in [("analytic", {"target_pass", "drafting"}), ("constant", set())]:
        engine = tiny_engine(tiny_target, draft=tiny_draft)
        engine.gamma_policy = policy
        monkeypatch.setattr(engine, "costs_for", lambda *args, **kwargs: CostModel([0.010] * 6 + [0.011, 0.012], 0.0005, 1.2))
        with LocalServer(create_app(engine, model_name=MODEL, max_batch=4)) as server:
            row = asyncio.run(run_level(server.url, MODEL, 3, 6, body))
        assert row["failures"] == 0 and set(row["measured_over_priced"]) == priced
        assert all(ratio > 0 for ratio in row["measured_over_priced"].values())


def test_a_server_s_stop_says_what_it_did_in_one_line():
    metrics = Metrics()
    metrics.record_request("/v1/completions", 200)
    metrics.record_request("/v1/completions", 400)
    metrics.record_verification(3, 2, 3)
    metrics.record_step(1, StepAccount(0.5, 2.0, 3.0, 0.25, 1.0))
    assert metrics.summary() == ("served 1 requests (1 not), 3 tokens in 1 steps · τ 3.00 · α 0.67 · steps: drafting 0.5 s · "
                                 "target pass 2.0 s · rest 0.5 s · 2.00× priced")
    assert "priced" not in Metrics().summary()  # nothing priced, nothing said
