"""One tiny end-to-end `verispec bench` run on random models: greedy fp32 outputs must equal hf-plain's."""

import json

import pytest

from verispec.cli import main as cli_main


@pytest.fixture
def questions(tmp_path):
    file = tmp_path / "questions.jsonl"
    rows = [{"question_id": 1, "category": "writing", "turns": ["t3 t4 t5 t6"]},
            {"question_id": 2, "category": "roleplay", "turns": ["t9 t8"]},
            {"question_id": 3, "category": "rag", "turns": ["t10 t11 t12 t10 t11"]}]
    file.write_text("\n".join(json.dumps(r) for r in rows))
    return file


def _bench(tiny_text_pair, questions, tmp_path, *extra):
    target, draft = tiny_text_pair
    out = tmp_path / "bench.json"
    argv = ["bench", "--target", str(target), "--draft", str(draft), "--methods", "hf-plain,vs:none,vs:model",
            "--questions", str(questions), "--max-new-tokens", "12", "--json", str(out), *extra]
    assert cli_main(argv) == 0
    return json.loads(out.read_text())


def test_greedy_bench_is_identical_to_baseline(tiny_text_pair, questions, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))  # the analytic policy caches measured costs
    data = _bench(tiny_text_pair, questions, tmp_path, "--per-category", "1", "--plots", str(tmp_path / "plots"))
    assert data["config"]["prompts"] == ["writing-1", "rag-3"]  # MT-bench categories: one group, one prompt
    methods = data["methods"]
    for name in ("hf-plain", "vs:none", "vs:model"):
        assert methods[name]["identical_to_baseline"] == 1.0
        assert set(methods[name]["per_category"]) == {"mt_bench", "rag"}
        assert methods[name]["tokens_per_second"] > 0 and methods[name]["weights_mib"] > 0
    assert methods["vs:model"]["mean_accepted_length"] >= 1.0
    assert methods["vs:model"]["predicted_speedup"] is not None
    assert methods["vs:model"]["cost_model_speedup"] > 0 and methods["vs:none"].get("cost_model_speedup") is None
    assert all(len(r["token_ids"]) > 0 for r in data["runs"])
    assert (tmp_path / "plots" / "speedup_vs_gamma.png").exists()
    assert "| vs:model |" in capsys.readouterr().out


def test_sampled_bench_reports_identity_as_na(tiny_text_pair, questions, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    data = _bench(tiny_text_pair, questions, tmp_path, "--temperature", "0.8", "--categories", "rag", "--device", "cpu")
    assert data["config"]["temperature"] == 0.8 and data["config"]["prompts"] == ["rag-3"]
    assert data["config"]["device"] == "cpu" and data["config"]["gpu"] is None
    assert all(m["identical_to_baseline"] is None for m in data["methods"].values())
    assert "| n/a |" in capsys.readouterr().out


def test_bench_on_the_hugging_face_runner_measures_its_weights(tiny_text_pair, questions, tmp_path, monkeypatch):
    """--dtype hf: the weights of a target and draft on the Hugging Face runner are their modules' bytes
    (this crashed at the end of a run, after every generation, before)."""
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    data = _bench(tiny_text_pair, questions, tmp_path, "--dtype", "hf", "--categories", "rag")
    methods = data["methods"]
    assert methods["vs:none"]["identical_to_baseline"] == methods["vs:model"]["identical_to_baseline"] == 1.0
    assert methods["vs:none"]["weights_mib"] == methods["hf-plain"]["weights_mib"] > 0  # the same target module
    assert methods["vs:model"]["weights_mib"] >= methods["vs:none"]["weights_mib"]  # plus the draft's (rounded to 0.1)


def test_a_hugging_face_runner_s_weights_are_its_module_s_bytes(tiny_text_pair):
    from verispec.models.loading import load_model
    from verispec.tools.bench.memory import MIB, runner_weights_mib

    runner = load_model(tiny_text_pair[0], "hf").runner
    expected = sum(p.numel() * p.element_size() for p in runner.model.parameters()) / MIB  # no shared tensors here
    assert runner_weights_mib(runner) == pytest.approx(expected, rel=0.05)


def test_bench_runs_the_auto_plan(tiny_text_pair, questions, tmp_path, monkeypatch, capsys):
    """`vs:auto` is the plan `verispec generate` runs by default: printed at load, identical to hf-plain."""
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    target, draft = tiny_text_pair
    out = tmp_path / "bench.json"
    assert cli_main(["bench", "--target", str(target), "--draft", str(draft), "--methods", "hf-plain,vs:auto",
                     "--questions", str(questions), "--categories", "rag", "--max-new-tokens", "12", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["methods"]["vs:auto"]["identical_to_baseline"] == 1.0
    captured = capsys.readouterr()
    assert "vs:auto: plan: float32 ·" in " ".join((captured.out + captured.err).split())


def test_bench_loads_the_target_only_in_its_methods_precisions(tiny_text_pair, questions, tmp_path, monkeypatch):
    """Methods that name their precision: the prompts are encoded by the first one's target, so the
    target is never loaded in the unused --dtype (float32) for its tokenizer alone."""
    from verispec.engine.build import EngineBuilder

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    loaded, target_in = [], EngineBuilder.target
    monkeypatch.setattr(EngineBuilder, "target",
                        lambda self, precision=None: loaded.append(precision or self.dtype) or target_in(self, precision))
    target, draft = tiny_text_pair
    out = tmp_path / "bench.json"
    assert cli_main(["bench", "--target", str(target), "--draft", str(draft), "--methods", "vs:none[int8],vs:ngram[int8]",
                     "--questions", str(questions), "--categories", "rag", "--max-new-tokens", "8", "--json", str(out)]) == 0
    assert set(loaded) == {"int8"}
    assert all(run["token_ids"] for run in json.loads(out.read_text())["runs"])


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal of a machine without a GPU")
def test_bench_on_cuda_without_a_gpu_says_so(tiny_text_pair, questions, tmp_path, capsys):
    target, draft = tiny_text_pair
    assert cli_main(["bench", "--target", str(target), "--draft", str(draft), "--methods", "hf-plain,vs:none",
                     "--questions", str(questions), "--device", "cuda", "--json", str(tmp_path / "b.json")]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
