"""`benchmarks/gpu/measure.py` runs end to end on the CPU with tiny shapes (its smoke test; on a GPU it
measures the shipped shapes: see the script's docstring), on random weights and on a real folder, and
`ship_weights.py` brings a folder over in parts that join to the same weights."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

GPU = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu"
SCRIPT = GPU / "measure.py"


def _script(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_measure_runs_on_cpu_with_tiny_shapes(tmp_path):
    measure = _script(SCRIPT)
    out = tmp_path / "out.jsonl"
    assert measure.main(["--device", "cpu", "--tiny", "--max-n", "2", "--prompts", "1", "--new-tokens", "4",
                         "--batch", "3", "--workdir", str(tmp_path), "--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records[0]["kind"] == "env" and records[0]["device"] == "cpu"
    costs = [r for r in records if r["kind"] == "cost"]
    assert {(r["role"], r["mode"]) for r in costs} == {(role, mode) for role in ("target", "draft") for mode in ("eager", "graph")}
    speeds = {(r["system"], r["method"]): r for r in records if r["kind"] == "speed"}
    assert set(speeds) == {("verispec", m) for m in ("none", "ngram", "model", "tree", "hybrid")} | {
        ("hf", "plain"), ("hf", "assisted"), ("hf", "prompt_lookup")}
    assert all(r["tokens"] == 4 for r in speeds.values())
    assert all(r["same_as_plain"] == 1 for (system, method), r in speeds.items() if system == "verispec" and method != "none")
    batches = {r["method"]: r for r in records if r["kind"] == "batch"}
    assert set(batches) == {"none", "ngram", "model", "tree", "hybrid"} and all(r["tokens"] == 12 for r in batches.values())
    assert batches["none"]["same_as_alone"] == 3  # three requests of the one prompt, stepped together
    assert all(r["same_as_alone"] == 3 for r in batches.values())  # greedy speculation under load: plain's tokens
    predicted = {r["method"]: r for r in records if r["kind"] == "predicted"}
    assert set(predicted) == {"model", "ngram"} and len(predicted["model"]["speedups_by_gamma"]) == 8
    assert not [r for r in records if r["kind"] == "error"]


def test_weights_travel_in_parts_and_join_to_the_same_model(tiny_target, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    ship = _script(GPU / "ship_weights.py")
    monkeypatch.setattr(ship, "PART_BYTES", 2000)  # a tiny model in several parts
    manifest = ship.split("tiny", tmp_path / "parts", source=tiny_target)
    assert len(manifest["parts"]) > 1
    (tmp_path / "call" / "site").mkdir(parents=True)  # a carried folder beside the parts stays out of the store
    for part in manifest["parts"] + ["tiny.json"]:  # one call per part: each brings one file
        carried = tmp_path / "call" / part
        carried.parent.mkdir(parents=True, exist_ok=True)
        carried.write_bytes((tmp_path / "parts" / part).read_bytes())
        ship.keep(carried.parent, tmp_path / "store")
        carried.unlink()
    folder = ship.join(tmp_path / "store", tmp_path / "real")
    original, joined = load_file(tiny_target / "model.safetensors"), load_file(folder / "model.safetensors")
    assert original.keys() == joined.keys()
    assert all(joined[k].dtype == torch.bfloat16 and torch.equal(joined[k], original[k].to(torch.bfloat16)) for k in original)
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    (tmp_path / "store" / manifest["parts"][0]).write_bytes(b"torn")
    with pytest.raises(SystemExit, match="digest"):  # a damaged part must not join
        ship.join(tmp_path / "store", tmp_path / "again")


def test_measure_runs_a_real_folder_on_questions(tiny_target, tmp_path):
    questions = tmp_path / "questions.jsonl"
    questions.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) for i, (c, t) in enumerate(
        [("writing", "t3 t4 t5 t6 t3 t4 t5"), ("rag", "t9 t8 t7 t9 t8 t7 t9")])))
    out = tmp_path / "out.jsonl"
    assert _script(SCRIPT).main(["--device", "cpu", "--real", str(tiny_target), "--questions", str(questions),
                                 "--max-n", "2", "--new-tokens", "6", "--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert not [r for r in records if r["kind"] == "error"]
    speeds = {(r["system"], r["method"]): r for r in records if r["kind"] == "speed"}
    assert set(speeds) == {("verispec", "none"), ("verispec", "ngram"), ("verispec", "stand"), ("hf", "plain"),
                           ("hf", "prompt_lookup")}
    assert speeds[("verispec", "ngram")]["same_as_plain"] == 2 and speeds[("verispec", "stand")]["same_as_plain"] == 2
    assert not [r for r in records if r["kind"] == "predicted"]  # measured acceptance, nothing predicted


def test_measure_takes_gamma_and_policy_per_method(tmp_path):
    from conftest import make_tiny_model

    target = make_tiny_model(tmp_path / "model", vocab_size=300, seed=3)  # outputs that do not repeat themselves at once
    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps({"question_id": 0, "category": "rag", "turns": ["t19 t28 t7 t99 t18 t27 t9 t44 t51"]}))
    out = tmp_path / "out.jsonl"
    assert _script(SCRIPT).main(["--device", "cpu", "--real", str(target), "--questions", str(questions), "--max-n", "2",
                                 "--new-tokens", "40", "--methods", "none,ngram@2,ngram@heuristic,ngram@sometimes,stand@3,stand@3,lookup:nodes=4,table_nodes=2@3",
                                 "--hf-methods", "none", "--no-launched", "--profile", "ngram@2,lookup:nodes=4,table_nodes=2@3", "--out",
                                 str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    runs = [(r["method"], r["gamma"], r["policy"], r.get("again", False)) for r in records
            if r["kind"] == "speed" and r["system"] == "verispec"]
    assert runs == [("none", 0, "constant", False), ("ngram", 2, "constant", False), ("ngram", 4, "heuristic", False),
                    ("stand", 3, "constant", False), ("stand", 3, "constant", False),
                    ("lookup:nodes=4,table_nodes=2", 3, "constant", False),  # a spec's options stay together
                    ("none", 0, "constant", True)]  # plain measured again after the methods
    stands = [(r["tau"], r["alpha"]) for r in records if r.get("method") == "stand"]
    # each pass drafts from an empty STAND table: a table kept from an earlier pass over the same prompt drafts
    # its whole output (tau 3.6 here) where a fresh one drafts what this pass has seen (1.3)
    assert stands[0] == stands[1] and stands[0][0] < 2
    assert not [r for r in records if r["kind"] == "speed" and r["system"] == "hf"]
    assert all(r["same_as_cold"] == 1 and r["cold_common_prefix"] == [r["tokens"]] and r["cold_tok_s"] > 0
               for r in records if r["kind"] == "speed")
    profiles = [r for r in records if r["kind"] == "profile"]
    assert [(p["method"], p["gamma"]) for p in profiles] == [("ngram", 2), ("lookup:nodes=4,table_nodes=2", 3)]
    profile = profiles[0]
    assert profile["steps"] > 0 and len(profile["top"]) == 30
    assert any("loop.py" in row[0] for row in profile["top"])
    errors = [r for r in records if r["kind"] == "error"]
    assert len(errors) == 1 and "ngram@sometimes" in errors[0]["what"] and "unknown gamma policy" in errors[0]["error"]


def test_linear_widths_runs_on_cpu_with_tiny_shapes(tmp_path):
    out = tmp_path / "widths.jsonl"
    assert _script(GPU / "linear_widths.py").main(["--device", "cpu", "--tiny", "--max-m", "3", "--calls", "2", "--repeats", "2",
                                                   "--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    linears = [(r["name"], r["m"]) for r in records if r["kind"] == "linear"]
    assert linears == [(name, m) for name in ("qkv", "o", "gate_up", "down", "head") for m in (1, 2, 3)]
    assert [r["m"] for r in records if r["kind"] == "attention"] == [1, 2, 3]
    assert all(r["seconds"] > 0 for r in records if r["kind"] != "env")
    assert all(r["weight_first_seconds"] > 0 for r in records if r["kind"] == "linear")


def test_step_kernels_runs_on_cpu_with_tiny_shapes(tmp_path):
    out = tmp_path / "steps.jsonl"
    assert _script(GPU / "step_kernels.py").main(["--device", "cpu", "--tiny", "--widths", "1,3", "--steps", "2",
                                                  "--sdpa", "default,math", "--workdir", str(tmp_path), "--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records[0]["kind"] == "env" and records[0]["device"] == "cpu"
    steps = [r for r in records if r["kind"] == "step_kernels"]
    assert [(r["sdpa"], r["mode"], r["n"]) for r in steps] == [
        (sdpa, mode, n) for sdpa in ("default", "math") for mode in ("graph", "eager") for n in (1, 3)]
    math = [r for r in steps if r["sdpa"] == "math"]  # held to the math backend: no fused attention kernel ran
    assert not any("flash" in k["name"] for r in math for k in r["kernels"])
    assert any("flash" in k["name"] for r in steps if r["sdpa"] == "default" for k in r["kernels"])  # torch's CPU choice
    for record in steps:
        assert record["wall_us"] > 0 and record["busy_us"] > 0
        assert sum(record["families_us"].values()) == pytest.approx(record["busy_us"])  # on a CPU: the operators' own times
        assert {"linear", "attention"} <= set(record["families_us"])


def test_step_kernels_counts_overlapping_kernels_once():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    step_kernels = _script(GPU / "step_kernels.py")

    def kernel(name, start, end, device_type=DeviceType.CUDA):
        span = SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
        return SimpleNamespace(name=name, device_type=device_type, time_range=span, self_cpu_time_total=0)

    events = [kernel("gemv", 0, 10), kernel("gemv", 20, 30), kernel("flash_fwd", 25, 40),  # overlaps the second gemv
              kernel("aten::linear", 0, 100, DeviceType.CPU)]  # the host's operator: not device time
    totals, calls, busy = step_kernels.kernel_times(events, torch.device("cuda"))
    assert totals == {"gemv": 20, "flash_fwd": 15} and calls == {"gemv": 2, "flash_fwd": 1}
    assert busy == 30  # 0–10 and 20–40: the overlap once
    assert [step_kernels.family(name) for name in ("ampere_bf16_s16816gemm", "rows_linear", "fmha_cutlassF", "attend",
                                                    "vectorized_elementwise_kernel", "RMSNorm", "something")] == [
        "linear", "linear", "attention", "attention", "elementwise", "norm", "other"]
