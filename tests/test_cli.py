"""The command line on tiny models: the --json shape other tools rely on, beam mode, clear errors."""

import json

import pytest

from verispec.cli import main

STATS_KEYS = {
    "new_tokens", "steps", "mean_accepted_length", "acceptance_rate", "per_position_acceptance",
    "draft_seconds", "target_seconds", "cost_ratio", "tokens_per_second", "wall_seconds",
}


def _run_json(capsys, *argv) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_json_has_the_documented_shape(capsys, tiny_target, tiny_draft):
    out = _run_json(capsys, "generate", "t5 t9 t2 t7", "--raw", "--json", "--target", str(tiny_target),
                    "--draft", str(tiny_draft), "--max-new-tokens", "12", "--gamma-policy", "constant")
    assert {"text", "token_ids", "finish_reason", "stats"} <= out.keys()
    assert STATS_KEYS <= out["stats"].keys()
    assert 1 <= len(out["token_ids"]) <= 12 and out["stats"]["new_tokens"] == len(out["token_ids"])


def test_speculative_and_plain_cli_agree_and_beam_mode_runs(capsys, tiny_target, tiny_draft):
    common = ["t11 t3 t3 t8", "--raw", "--json", "--target", str(tiny_target), "--max-new-tokens", "10"]
    # the target drafting for itself: every draft token is accepted, so fewer steps, same tokens
    spec = _run_json(capsys, "generate", *common, "--draft", str(tiny_target), "--gamma-policy", "constant")
    plain = _run_json(capsys, "generate", *common, "--draft", "none")
    assert spec["token_ids"] == plain["token_ids"] and spec["stats"]["steps"] < plain["stats"]["steps"]
    beam = _run_json(capsys, "generate", *common, "--num-beams", "3")
    assert beam["num_beams"] == 3 and 1 <= len(beam["token_ids"]) <= 10


@pytest.mark.parametrize("argv, message", [
    (["--target", "no-such-model-7b"], "unknown model"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "1.5"], "top_p"),
    (["--gamma", "0"], "gamma"),
])
def test_bad_input_exits_2_with_a_message(capsys, tiny_target, argv, message):
    base = ["generate", "t3", "--raw", "--target", str(tiny_target), "--draft", "none"]
    assert main(base + argv) == 2
    assert message in capsys.readouterr().err
