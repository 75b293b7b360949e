"""`benchmarks/gpu/measure.py` runs end to end on the CPU with tiny shapes (its smoke test; on a GPU it
measures the shipped shapes: see the script's docstring)."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu" / "measure.py"


def test_measure_runs_on_cpu_with_tiny_shapes(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_measure", SCRIPT)
    measure = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(measure)
    out = tmp_path / "out.jsonl"
    assert measure.main(["--device", "cpu", "--tiny", "--max-n", "2", "--prompts", "1", "--new-tokens", "4",
                         "--workdir", str(tmp_path), "--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records[0]["kind"] == "env" and records[0]["device"] == "cpu"
    costs = [r for r in records if r["kind"] == "cost"]
    assert {(r["role"], r["mode"]) for r in costs} == {(role, mode) for role in ("target", "draft") for mode in ("eager", "graph")}
    speeds = {(r["system"], r["method"]): r for r in records if r["kind"] == "speed"}
    assert set(speeds) == {("verispec", m) for m in ("none", "ngram", "model", "tree", "hybrid")} | {
        ("hf", "plain"), ("hf", "assisted"), ("hf", "prompt_lookup")}
    assert all(r["tokens"] == 4 for r in speeds.values())
    assert all(r["same_as_plain"] == 1 for (system, method), r in speeds.items() if system == "verispec" and method != "none")
    predicted = {r["method"]: r for r in records if r["kind"] == "predicted"}
    assert set(predicted) == {"model", "ngram"} and len(predicted["model"]["speedups_by_gamma"]) == 8
    assert not [r for r in records if r["kind"] == "error"]
