"""Summary metrics, Markdown, JSON and figures on synthetic benchmark records (no models)."""

import json

import pytest

from verispec.control.theory import expected_speedup
from verispec.tools.bench.plots import write_bench_plots
from verispec.tools.bench.report import markdown_report, summarize, write_json


def _stats(accepted: list[int], proposed: int, c: float) -> dict:
    steps = len(accepted)
    return {"steps": steps, "proposed_tokens": proposed * steps, "mean_accepted_length": (sum(accepted) + steps) / steps,
            "acceptance_rate": 0.75, "per_position_acceptance": [0.9, 0.6, 0.3], "cost_ratio": c}


def _records() -> list[dict]:
    def rec(method, prompt, category, tps, ids, stats=None, extra=5.0):
        r = {"method": method, "prompt": prompt, "category": category, "tokens_per_second": tps,
             "token_ids": ids, "new_tokens": len(ids), "peak_extra_mib": extra}
        return r | ({"stats": stats} if stats else {})

    return [
        rec("hf-plain", "a", "code", 10.0, [1, 2]), rec("hf-plain", "b", "mt_bench", 20.0, [3]),
        rec("vs:model", "a", "code", 25.0, [1, 2], _stats([3, 1], 3, 0.2), extra=12.0),
        rec("vs:model", "b", "mt_bench", 30.0, [4], _stats([2, 2], 3, 0.2)),
    ]


CONFIG = {"target": "t", "draft": "d", "dtype": "float32", "max_new_tokens": 8, "measured_prompts": 2,
          "temperature": 0.0, "process_peak_rss_mib": 321.0, "cpu": "Some CPU, 2 CPUs, avx2 fma"}


def test_summary_metrics():
    summary = summarize(_records(), ["hf-plain", "vs:model", "vs:absent"], weights_mib={"hf-plain": 100.0, "vs:model": 150.0})
    assert "vs:absent" not in summary
    vs = summary["vs:model"]
    assert vs["speedup"] == pytest.approx(55 / 30)
    assert vs["per_category"]["code"]["speedup"] == pytest.approx(2.5)
    assert vs["identical_to_baseline"] == 0.5
    assert vs["mean_gamma"] == pytest.approx(3.0)
    assert vs["predicted_speedup"] == pytest.approx(expected_speedup(0.75, 3, 0.2))
    assert vs["memory_mib"] == pytest.approx(150.0 + 12.0)
    assert "predicted_speedup" not in summary["hf-plain"]
    assert vs["cost_model_speedup"] is None  # records written without the cost model's prediction


def test_the_cost_models_prediction_is_tokens_over_predicted_costs_summed():
    """Per generation `cost_model_speedup` (its tokens over its predicted cost); over generations the tokens
    over the summed costs, not the mean of the ratios."""
    records = _records()
    records[2]["stats"] |= {"new_tokens": 30, "cost_model_speedup": 1.5}  # cost 20
    records[3]["stats"] |= {"new_tokens": 10, "cost_model_speedup": 1.0}  # cost 10
    vs = summarize(records, ["hf-plain", "vs:model"])["vs:model"]
    assert vs["cost_model_speedup"] == pytest.approx(40 / 30)
    assert vs["per_category"]["code"]["cost_model_speedup"] == pytest.approx(1.5)
    assert "predicted (costs)" in markdown_report(summarize(records, ["hf-plain", "vs:model"]), CONFIG)


def test_speculative_outputs_are_compared_with_plain_decoding_on_their_own_backend():
    def rec(method, prompt, ids, backend, plain):
        return {"method": method, "prompt": prompt, "category": "code", "tokens_per_second": 10.0, "token_ids": ids,
                "new_tokens": len(ids), "peak_extra_mib": None, "backend": backend, "plain": plain}

    records = [rec("llama-cpp-like", "a", [9], None, False) | {"method": "llama-cpp"},
               rec("vs:none[kquant]", "a", [1, 2], "kquant", True), rec("vs:none[kquant]", "b", [3], "kquant", True),
               rec("vs:none[gguf]", "a", [1, 5], "gguf", True),
               rec("vs:ngram[kquant]", "a", [1, 2], "kquant", False), rec("vs:ngram[kquant]", "b", [4], "kquant", False),
               rec("vs:auto[auto]", "a", [1, 5], "gguf", False), rec("vs:ngram[int8]", "a", [1, 2], "int8", False)]
    summary = summarize(records, ["llama-cpp", "vs:none[kquant]", "vs:none[gguf]", "vs:ngram[kquant]", "vs:auto[auto]",
                                  "vs:ngram[int8]"])
    assert summary["vs:ngram[kquant]"]["identical_to_plain"] == 0.5  # b differs from kquant's plain output
    assert summary["vs:auto[auto]"]["identical_to_plain"] == 1.0  # against gguf's plain, the backend it ran
    assert summary["vs:ngram[int8]"]["identical_to_plain"] is None  # no plain run on int8
    assert summary["vs:none[kquant]"]["identical_to_plain"] is None and summary["llama-cpp"]["identical_to_plain"] is None
    assert "| = plain |" in markdown_report(summary, CONFIG)


def test_sampled_runs_report_identical_as_na():
    config = CONFIG | {"temperature": 0.7}
    summary = summarize(_records(), ["hf-plain", "vs:model"], sampled=True)
    assert summary["vs:model"]["identical_to_baseline"] is None
    text = markdown_report(summary, config)
    assert "sampled at temperature 0.7" in text and "| n/a |" in text


def test_markdown_and_json(tmp_path):
    summary = summarize(_records(), ["hf-plain", "vs:model"])
    text = markdown_report(summary, CONFIG)
    assert "## Per category" in text and "| vs:model | mt_bench |" in text and "predicted" in text
    assert "on Some CPU, 2 CPUs, avx2 fma" in text.splitlines()[0]  # every result names its CPU kind
    assert "--dtype float32 (methods without their own)" in text.splitlines()[0]  # not the precision of every method
    write_json(tmp_path / "out.json", CONFIG, summary, _records())
    data = json.loads((tmp_path / "out.json").read_text())
    assert set(data) == {"config", "methods", "runs"}
    for key in ("speedup", "identical_to_baseline", "mean_accepted_length", "tokens_per_second",
                "predicted_speedup", "per_position_acceptance", "cost_ratio"):
        assert key in data["methods"]["vs:model"]
        assert key in data["methods"]["vs:model"]["per_category"]["code"]


def test_plots_are_written(tmp_path):
    summary = summarize(_records(), ["hf-plain", "vs:model"])
    paths = write_bench_plots(summary, tmp_path / "plots")
    assert [p.name for p in paths] == ["speedup_by_category.png", "acceptance_by_position.png", "speedup_vs_gamma.png"]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_category_bars_show_tokens_per_second_when_the_run_has_no_hf_plain():
    from verispec.tools.bench.plots import category_bars

    with_baseline = summarize(_records(), ["hf-plain", "vs:model"])
    metric, categories, values = category_bars(with_baseline)
    assert metric == "speedup" and categories == ["code", "mt_bench", "overall"]
    assert values["vs:model"] == pytest.approx([2.5, 1.5, 55 / 30])
    without = summarize([r for r in _records() if r["method"] != "hf-plain"], ["vs:model"])
    metric, _, values = category_bars(without)
    assert metric == "tokens_per_second" and values["vs:model"] == pytest.approx([25.0, 30.0, 27.5])


def test_methods_split_keeps_drafter_options():
    from verispec.tools.bench.compare import split_methods

    assert split_methods("hf-plain, vs:stand:k=2,depth=5@constant,vs:none,hf-pld") == [
        "hf-plain", "vs:stand:k=2,depth=5@constant", "vs:none", "hf-pld"]


def test_warm_up_runs_on_a_prompt_outside_the_measured_set():
    """A drafter that learns across requests (STAND, online) must not meet a measured prompt untimed."""
    from verispec.tools.bench.compare import Output, run
    from verispec.tools.bench.prompts import Prompt

    class Recorder:
        def __init__(self, name):
            self.name, self.seen = name, []

        def generate(self, prompt_ids, max_new_tokens, seed):
            self.seen.append(list(prompt_ids))
            return Output([3], 0.1)

    methods = [Recorder("a"), Recorder("b")]
    prompts = [Prompt("code", "p0", "x"), Prompt("chat", "p1", "y")]
    records: list[dict] = []
    run(methods, prompts, [[1, 2], [4, 5]], [9, 9], 4, frozenset({3}), records, lambda label: None)
    assert all(method.seen[0] == [9, 9] and [9, 9] not in method.seen[1:] for method in methods)
    assert len(records) == 4


def test_the_cpu_summary_names_the_vector_flags_and_the_generation(monkeypatch, tmp_path):
    from verispec import paths

    flags = "flags\t\t: fpu sse2 avx avx2 fma f16c avx512f avx512_vnni amx_tile"
    cpuinfo = tmp_path / "cpuinfo"
    processor = "processor\t: {}\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\n" + flags + "\n"
    cpuinfo.write_text("\n".join(processor.format(i) for i in range(2)))
    monkeypatch.setattr(paths, "CPUINFO", cpuinfo)
    paths.cpu_summary.cache_clear()
    paths.cpu_flags.cache_clear()
    try:
        summary = paths.cpu_summary()
    finally:
        paths.cpu_summary.cache_clear()
        paths.cpu_flags.cache_clear()
    assert summary.startswith("AMD EPYC (family 26 model 2), ")
    assert summary.endswith("CPUs, avx2 fma f16c avx512f avx512_vnni amx_tile")
