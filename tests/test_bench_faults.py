"""`verispec bench` under faults, on tiny random models: a prompt too long for the context, a method that
raises, an interrupted run, --plots without matplotlib, an unwritable --json; and its --help."""

import json
import sys
import types

import pytest

from verispec.cli import main as cli_main
from verispec.models.llama_cpp import WINDOW
from verispec.tools.bench import compare

LONG = 130  # words (tokens) in the over-long question: the tiny models have 128 positions


def _questions(folder, *turns):
    """A Spec-Bench file of one question per turn: writing-1, rag-2, rag-3, …"""
    file = folder / "questions.jsonl"
    rows = [{"question_id": i, "category": "writing" if i == 1 else "rag", "turns": [turn]}
            for i, turn in enumerate(turns, start=1)]
    file.write_text("\n".join(json.dumps(r) for r in rows))
    return file


@pytest.fixture
def questions(tmp_path):
    """writing-1 and rag-3 fit the tiny models' context; rag-2 does not."""
    return _questions(tmp_path, "t3 t4 t5 t6", " ".join(f"t{3 + i % 40}" for i in range(LONG)), "t10 t11 t12 t10 t11")


def _argv(tiny_text_pair, questions, out, methods="hf-plain,vs:none,vs:model", *extra):
    target, draft = tiny_text_pair
    return ["bench", "--target", str(target), "--draft", str(draft), "--methods", methods,
            "--questions", str(questions), "--max-new-tokens", "12", "--json", str(out), *extra]


def _no_model_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(compare.Models, "__init__", refuse)


def test_a_long_prompt_and_a_failing_method_cost_only_their_own_results(tiny_text_pair, questions, tmp_path,
                                                                         monkeypatch, capsys):
    generate = compare.VerispecMethod.generate
    calls = {"vs:model": 0}

    def model_draft_fails_after_its_warm_up(self, prompt_ids, max_new_tokens, seed):
        if self.name == "vs:model":
            calls["vs:model"] += 1
            if calls["vs:model"] > 1:
                raise RuntimeError("draft model exploded")
        return generate(self, prompt_ids, max_new_tokens, seed)

    monkeypatch.setattr(compare.VerispecMethod, "generate", model_draft_fails_after_its_warm_up)
    out = tmp_path / "bench.json"
    assert cli_main(_argv(tiny_text_pair, questions, out)) == 1  # a generation failed

    data = json.loads(out.read_text())
    runs = data["runs"]
    skipped = [r for r in runs if r.get("skipped")]
    assert runs[:3] == skipped  # named at the start, before any generation
    assert {r["method"] for r in skipped} == {"hf-plain", "vs:none", "vs:model"}
    assert all(r["prompt"] == "rag-2" for r in skipped)
    assert all(r["prompt_tokens"] >= LONG and "exceed" in r["error"] and "context of 128" in r["error"] for r in skipped)
    failed = [r for r in runs if "error" in r and not r["skipped"]]
    assert sorted((r["method"], r["prompt"], r["error"]) for r in failed) == [
        ("vs:model", p, "RuntimeError: draft model exploded") for p in ("rag-3", "writing-1")]
    ran = [r for r in runs if "error" not in r]
    assert sorted((r["method"], r["prompt"]) for r in ran) == [
        (m, p) for m in ("hf-plain", "vs:none") for p in ("rag-3", "writing-1")]
    assert set(data["methods"]) == {"hf-plain", "vs:none"}
    assert data["methods"]["vs:none"]["identical_to_baseline"] == 1.0
    assert data["config"]["measured_prompts"] == 2 and data["config"]["finished"] is True

    report = capsys.readouterr().out
    assert "| vs:none |" in report and "## Not measured" in report
    for r in failed:
        assert f"| vs:model | {r['prompt']} | failed | RuntimeError: draft model exploded |" in report
    for r in skipped:
        assert f"| {r['method']} | {r['prompt']} | skipped | {r['error']} |" in report


def test_a_method_whose_warm_up_fails_is_left_out_and_the_others_run(tiny_text_pair, questions, tmp_path, monkeypatch):
    def broken(self, prompt_ids, max_new_tokens, seed):
        raise ValueError("no kernel for this shape")

    monkeypatch.setattr(compare.VerispecMethod, "generate", broken)
    out = tmp_path / "bench.json"
    assert cli_main(_argv(tiny_text_pair, questions, out, "hf-plain,vs:none")) == 1
    runs = json.loads(out.read_text())["runs"]
    failed = [r for r in runs if "error" in r and not r["skipped"]]
    assert [(r["method"], r["prompt"], r["error"]) for r in failed] == [
        ("vs:none", "warm-up", "ValueError: no kernel for this shape")]
    assert sorted(r["method"] for r in runs if "error" not in r) == ["hf-plain", "hf-plain"]  # both prompts that fit


def test_results_are_on_disk_as_each_generation_finishes(tiny_text_pair, tmp_path, monkeypatch, capsys):
    """Ctrl-C (or a kill) on the second prompt: the first prompt's results are already in the JSON."""
    questions, out = _questions(tmp_path, "t3 t4 t5 t6", "t10 t11 t12 t10 t11"), tmp_path / "bench.json"
    on_disk_at_the_interrupt = []
    hf_generate, vs_generate = compare.HFMethod.generate, compare.VerispecMethod.generate

    def interrupting(original):
        def generate(self, prompt_ids, max_new_tokens, seed):
            if seed == 1:  # the second prompt
                on_disk_at_the_interrupt.append(json.loads(out.read_text()))
                raise KeyboardInterrupt
            return original(self, prompt_ids, max_new_tokens, seed)

        return generate

    monkeypatch.setattr(compare.HFMethod, "generate", interrupting(hf_generate))
    monkeypatch.setattr(compare.VerispecMethod, "generate", interrupting(vs_generate))
    assert cli_main(_argv(tiny_text_pair, questions, out, "hf-plain,vs:none")) == 130

    def finished_pairs(data):
        return sorted((r["method"], r["prompt"]) for r in data["runs"] if "error" not in r)

    first = sorted((m, "writing-1") for m in ("hf-plain", "vs:none"))
    [snapshot] = on_disk_at_the_interrupt
    assert finished_pairs(snapshot) == first
    assert snapshot["config"]["finished"] is False and "hf-plain" in snapshot["methods"]
    final = json.loads(out.read_text())
    assert finished_pairs(final) == first and final["config"]["interrupted"] is True
    assert "INTERRUPTED" in capsys.readouterr().out


def test_plots_without_matplotlib_fail_before_any_model_loads(tiny_text_pair, questions, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    _no_model_loads(monkeypatch)
    plots, out = tmp_path / "plots", tmp_path / "bench.json"
    assert cli_main(_argv(tiny_text_pair, questions, out, "hf-plain", "--plots", str(plots))) == 2
    err = capsys.readouterr().err
    assert "--plots needs matplotlib" in err and "Traceback" not in err
    assert not plots.exists() and not out.exists()


def test_an_unwritable_json_path_fails_before_any_model_loads(tiny_text_pair, questions, tmp_path, monkeypatch, capsys):
    _no_model_loads(monkeypatch)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert cli_main(_argv(tiny_text_pair, questions, blocker / "bench.json", "hf-plain")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "Traceback" not in err


def test_the_llama_cpp_baseline_gets_the_context_of_verispec_s_gguf_runner(tmp_path, monkeypatch):
    """The same context as `vs:…[gguf]` (WINDOW, capped at the file's training context), not a smaller one
    of its own that a long question overflows."""
    loaded = {}

    class FakeLlama:
        def __init__(self, model_path, n_ctx, **kwargs):
            loaded["n_ctx"], self.model = n_ctx, "model"

    fake = types.ModuleType("llama_cpp")
    fake.Llama = FakeLlama
    fake.llama_model_n_ctx_train = lambda model: train_context
    fake.llama_print_system_info = lambda: b"CPU : AVX2 = 1 | "
    speculative = types.ModuleType("llama_cpp.llama_speculative")
    speculative.LlamaPromptLookupDecoding = object
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", speculative)

    for train_context, context in ((4 * WINDOW, WINDOW), (WINDOW // 2, WINDOW // 2), (0, WINDOW)):
        method = compare.LlamaCppMethod.load("llama-cpp", tmp_path / "m.gguf", frozenset({0}), 0.0)
        assert loaded["n_ctx"] == WINDOW and method.context == context


def test_help_names_the_command(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main(["bench", "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("usage: verispec bench ")
