"""The theory formulas against hand-computed values, the optimum's limits, and `verispec analyze`."""

import pytest
import torch

from verispec.control.theory import (acceptance_rate, curve_verify_cost, draft_step_cost, expected_speedup, expected_tokens,
                                     optimal_gamma, speedup_table)
from verispec.cli import main as cli_main
from verispec.errors import InvalidParameterError


def test_expected_tokens_by_hand():
    assert expected_tokens(0.8, 4) == pytest.approx(3.3616)  # (1 − 0.8^5) / 0.2
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert expected_tokens(0.0, 7) == pytest.approx(1.0)
    assert expected_tokens(1.0, 3) == 4.0


def test_expected_speedup_by_hand():
    # (1 − 0.8^5) / ((1 − 0.8)(4·0.1 + 1)) = 3.3616 / 1.4
    assert expected_speedup(0.8, 4, 0.1) == pytest.approx(3.3616 / 1.4)
    # with a verification cost T(5)/T(1) = 2: 3.3616 / (0.4 + 2)
    assert expected_speedup(0.8, 4, 0.1, lambda g: 2.0) == pytest.approx(3.3616 / 2.4)


def test_a_draft_models_catching_up_costs_more_after_full_acceptance():
    assert draft_step_cost(0.8, 4, 0.1) == pytest.approx(0.4)  # a flat draft curve: the papers' γ·c
    assert draft_step_cost(0.8, 0, 0.1, 1.75) == 0.0  # a step that drafts nothing runs no draft forward
    # γ = 1 after a full acceptance (probability α) feeds two tokens at T_d(2)/T_d(1) = 1.75: 0.6 · (1 + 0.78 · 0.75)
    assert draft_step_cost(0.78, 1, 0.6, 1.75) == pytest.approx(0.6 * (1 + 0.78 * 0.75))
    assert expected_speedup(0.78, 1, 0.6, lambda g: 1.65, 1.75) == pytest.approx(1.78 / (0.6 * 1.585 + 1.65))
    assert expected_speedup(0.8, 4, 0.1, lambda g: 2.0, 1.0) == expected_speedup(0.8, 4, 0.1, lambda g: 2.0)
    assert optimal_gamma(0.9, 0.3, 8, lambda g: 1.0, catch_up=3.0) >= optimal_gamma(0.9, 0.3, 8, lambda g: 1.0)


def test_optimal_gamma_limits():
    for alpha in (0.1, 0.5, 0.9):
        assert optimal_gamma(alpha, 0.0, max_gamma=10) == 10  # free drafts: draft as far as allowed
        assert optimal_gamma(alpha, 5.0, max_gamma=10) == 1  # drafts dearer than the target: shortest
    assert optimal_gamma(0.8, 0.1, max_gamma=16) == 6  # by the table: 2.470× at γ = 6 beats 2.460× and 2.448×


def test_speedup_table_marks_one_optimum_and_checks_inputs():
    rows = speedup_table(0.8, 0.1, max_gamma=8)
    assert [r["gamma"] for r in rows] == list(range(1, 9))
    assert [r["gamma"] for r in rows if r["optimal"]] == [6]
    assert rows[3]["expected_tokens"] == pytest.approx(3.3616)
    for bad in ({"alpha": 1.5, "c": 0.1}, {"alpha": 0.5, "c": -1.0}, {"alpha": 0.5, "c": 0.1, "max_gamma": 0}):
        with pytest.raises(InvalidParameterError):
            speedup_table(**bad)


def test_curve_verify_cost():
    cost = curve_verify_cost([0.2, 0.22, 0.4])  # seconds for n = 1, 2, 3
    assert cost(1) == pytest.approx(1.1)
    assert cost(2) == pytest.approx(2.0)
    assert cost(9) == pytest.approx(2.0)  # beyond the curve: its last value
    with pytest.raises(InvalidParameterError):
        curve_verify_cost([])


def test_acceptance_rate_is_overlap():
    target_probs = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])  # [rows, vocab]
    draft_probs = torch.tensor([[0.2, 0.3, 0.5], [0.0, 1.0, 0.0]])
    torch.testing.assert_close(acceptance_rate(target_probs, draft_probs), torch.tensor([0.5, 0.0]))


def test_analyze_command_table_and_plots(tmp_path, capsys):
    assert cli_main(["analyze", "--alpha", "0.8", "--c", "0.1", "--max-gamma", "8", "--plots", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| 4 | 3.3616 |" in out
    assert "optimal γ = 6" in out
    assert (tmp_path / "expected_tokens.png").stat().st_size > 0
    assert (tmp_path / "optimal_gamma.png").stat().st_size > 0


def test_analyze_command_needs_both_alpha_and_c(capsys):
    assert cli_main(["analyze", "--alpha", "0.8"]) == 2
    assert "--c" in capsys.readouterr().err


def test_measure_pair_on_tiny_models(tiny_text_pair, tmp_path, capsys):
    from verispec.tools.measure import measure_pair
    from verispec.models.loading import load_model

    tiny_target, tiny_draft = tiny_text_pair
    target, draft = load_model(tiny_target), load_model(tiny_draft)
    prompts = [[3, 4, 5], [7, 8]]
    same = measure_pair(target, target, prompts, max_new_tokens=6, max_gamma=3)
    assert same.greedy_alpha == 1.0 and same.alpha == pytest.approx(1.0, abs=1e-5)  # a model drafts itself perfectly
    assert len(same.target_curve) == 4 and same.c > 0
    other = measure_pair(target, draft, prompts, max_new_tokens=6, max_gamma=3)
    assert len(other.alphas) == len(same.alphas) > 0
    assert 0.0 <= other.alpha < 1.0
    questions = tmp_path / "q.jsonl"
    questions.write_text('{"question_id": 1, "category": "writing", "turns": ["t3 t4 t5"]}\n')
    args = ["analyze", "--measure", "--target", str(tiny_target), "--draft", str(tiny_draft), "--questions",
            str(questions), "--max-new-tokens", "4", "--max-gamma", "3"]
    assert cli_main(args) == 0
    assert "greedy α" in capsys.readouterr().out


def test_width_flips_counts_positions_and_catches_a_width_dependent_model(tiny_text_pair, tmp_path, capsys):
    import dataclasses

    from verispec.tools.measure import width_flips
    from verispec.models.loading import load_model

    target = load_model(tiny_text_pair[0])
    prompts = [[3, 4, 5], [7, 8]]
    exact = width_flips(target, prompts, max_new_tokens=6, width=3)
    assert 0 < exact.positions <= 12 and exact.flips == 0 and exact.median_margin > 0  # fp32: width-invariant

    class WidthDependent:  # shifts every logit row of a multi-position forward towards token 9
        def __init__(self, runner):
            self.runner = runner

        def __getattr__(self, name):
            return getattr(self.runner, name)

        def forward(self, cache, tokens, *args, **kwargs):
            logits = self.runner.forward(cache, tokens, *args, **kwargs)
            if logits is not None and tokens.shape[0] > 1:
                logits[:, 9] += 100.0
            return logits

    skewed = dataclasses.replace(target, runner=WidthDependent(target.runner))
    flipped = width_flips(skewed, prompts, max_new_tokens=6, width=3)
    assert 0 < flipped.flips == len(flipped.flip_margins) <= flipped.positions <= 12
    with pytest.raises(InvalidParameterError, match="width"):
        width_flips(target, prompts, width=1)
    questions = tmp_path / "q.jsonl"
    questions.write_text('{"question_id": 1, "category": "writing", "turns": ["t3 t4 t5"]}\n')
    assert cli_main(["analyze", "--flips", "--target", str(tiny_text_pair[0]), "--questions", str(questions),
                     "--max-new-tokens", "4", "--width", "3", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "positions per forward at 0 (0.00%)" in out and " on cpu, " in out


def test_the_profile_accounts_for_every_step(tiny_target):
    """`analyze --profile`: each method's phases and the rest add up to the steps' wall time, the first
    token (made by the prefill) is not counted as a step, and the table has a row per method, plain first."""
    from verispec.drafters import DraftModelDrafter
    from verispec.engine import Engine
    from verispec.models.loading import load_model
    from verispec.tools.profile import format_loop_curve, format_profile, profile_method

    target = load_model(tiny_target)
    target.eos_ids = frozenset()  # every request runs its 9 tokens
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    plain = profile_method(Engine(target, None), "none", prompts, 9)
    self_draft = DraftModelDrafter(load_model(tiny_target), target.vocab_size)  # the target drafts itself: all accepted
    spec = profile_method(Engine(target, self_draft, gamma=3, gamma_policy="constant"), "model", prompts, 9)
    for row in (plain, spec):
        assert row.tokens == 2 * 8  # 9 new tokens each, the first from the prefill
        assert sum(row.phases.values()) + row.other == pytest.approx(row.seconds)
        assert row.other >= 0 and all(seconds >= 0 for seconds in row.phases.values())
    assert plain.steps == plain.tokens and plain.proposed == 0
    assert len(spec.contexts) == spec.steps and min(plain.contexts) == 4  # each step's context: prompt + tokens so far
    assert spec.steps < spec.tokens and spec.alpha == 1.0 and spec.phases["draft"] > 0
    assert set(plain.forwards) == {1} and len(plain.forwards[1]) == plain.steps  # each step's forward, by its width
    assert sum(map(len, spec.forwards.values())) == spec.steps and max(spec.forwards) == 4  # γ 3: 4 positions
    curve = [0.01, 0.012, 0.013, 0.015]
    table = format_profile([plain, spec], curve, {"model": 0.002})
    assert [line.split("|")[1].strip() for line in table.splitlines()[2:]] == ["none", "model"]
    loop = format_loop_curve([plain, spec], curve, least_steps=1)
    assert "1: 1.00 (1.00)" in loop and "(1.50)" in loop  # the curve's T(4)/T(1) beside the loop's


def test_the_profile_prices_prompt_lookup_steps_without_a_draft_forward():
    """A `hybrid`'s steps proposed by prompt lookup draft for nothing: the prediction from the steps as taken charges c
    only to the draft model's (here 1 of 2 steps of γ 2; α 1, no catching up)."""
    from verispec.tools.profile import MethodProfile, format_profile

    plain = MethodProfile("none", steps=4, tokens=4, seconds=4.0, widths=[0] * 4, free=[False] * 4, forwards={1: [1.0] * 4})
    hybrid = MethodProfile("hybrid", steps=2, tokens=6, seconds=2.4, proposed=4, accepted=4, judged=4, widths=[2, 2],
                           free=[True, False], forwards={3: [1.0, 1.0]})
    row = format_profile([plain, hybrid], [1.0, 1.0, 1.0], {"hybrid": 0.5}).splitlines()[3].split("|")
    assert row[1].strip() == "hybrid" and row[-5].strip() == "2.500×"  # measured: 1 s a token plain, 0.4 s here
    assert row[-4].strip() == f"{6 / (2 * 0.5 + 2 * 1.0):.3f}×"  # as taken: 2.000×, not 6 / (4 · 0.5 + 2) = 1.500×


def test_the_profile_command_runs_every_method_on_every_prompt(tiny_target, tmp_path, capsys):
    """`analyze --profile` end to end: plain decoding first, each method over the same prompts
    (interleaved per prompt), and the curve the predictions use."""
    questions = tmp_path / "q.jsonl"
    questions.write_text('{"question_id": 1, "category": "writing", "turns": ["t3 t4 t5"]}\n'
                         '{"question_id": 2, "category": "coding", "turns": ["t7 t8"]}\n')
    assert cli_main(["analyze", "--profile", "--target", str(tiny_target), "--dtype", "float32", "--methods", "ngram",
                     "--questions", str(questions), "--per-category", "2", "--max-new-tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert "2 prompts" in out and "target T(n)/T(1)" in out
    rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ") and "method" not in line]
    assert rows == ["none", "ngram"]
