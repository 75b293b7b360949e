"""Where the microseconds of one GPU step go (issue #32): the kernels of a forward of n positions, by family.

`measure.py` gives T(n), the wall time of a replayed step, and `linear_widths.py` times each kind of layer alone;
neither says which part of T(2) − T(1) comes from which kernels of the real step. This runs, for each width n in
--widths after --context cached positions, --steps forwards of a runner as decoding calls them (`runner.forward`,
replayed as CUDA graphs, then launched eagerly) under `torch.profiler`, and sums every kernel the GPU ran by name and
by family (linear, attention, norm, elementwise, copy, sample, other). Wall time is timed apart, without the
profiler; what the kernels leave of it is `idle`: launches, host work and waits. Then the change of each family from
n = 1: which kernels make the step wider than one position. --sdpa repeats it with `scaled_dot_product_attention`
held to each named backend (math, efficient, cudnn, flash: one that cannot take the step's masked, grouped-query
call is recorded as an error), to see whether another attention kernel keeps T(2) near T(1).

Random weights of a shipped shape (`configs.json`, as `measure.py` draws them on the device) or a real folder
(--real, e.g. `ship_weights.py`'s). On a CPU the profiler sees operators, not kernels (each one's own time): the
smoke test. One JSON line per (mode, width) to --out, and a table on stdout.
    On the GPU machine: PYTHONPATH=src python benchmarks/gpu/step_kernels.py --model smollm2-135m-instruct
    Smoke test on a CPU, in seconds: --device cpu --tiny
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))  # measure.py beside this file, however this one was loaded
from measure import build_random_model, elapsed  # noqa: E402

from verispec.engine.build import EngineBuilder  # noqa: E402
from verispec.models.device import resolve_device, synchronize  # noqa: E402

# a kernel's (or CPU operator's) family, by the first pattern its lowercased name matches
FAMILIES = (
    ("attention", r"attention|attend|flash|fmha|softmax"),
    ("linear", r"gemm|gemv|cublas|cutlass|xmma|linear|aten::(addmm|mm|matmul)"),
    ("norm", r"norm|rsqrt|pow|mean"),
    ("copy", r"copy|index|cat|fill|scatter|gather|clone|arange|embedding|where"),
    ("sample", r"argmax|max|sort|topk|log_softmax"),
    ("elementwise", r"elementwise|vectorized|silu|mul|add|sub|neg|exp|compare|bitwise|ge_|lt_|le_|gt_|eq_|and|or_"),
)


def family(name: str) -> str:
    lower = name.lower()
    return next((group for group, pattern in FAMILIES if re.search(pattern, lower)), "other")


def kernel_times(events, device: torch.device) -> tuple[dict[str, float], dict[str, int], float]:
    """({name: µs summed}, {name: calls}, µs the device was busy: the union of the kernels' intervals) of the
    profiled events: kernels on a GPU (graph replays included), each operator's own time on a CPU."""
    totals: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    intervals = []
    for event in events:
        if device.type == "cuda":
            if event.device_type != DeviceType.CUDA:
                continue
            microseconds = event.time_range.elapsed_us()
            intervals.append((event.time_range.start, event.time_range.end))
        else:
            if event.device_type != DeviceType.CPU:
                continue
            microseconds = event.self_cpu_time_total
        totals[event.name] += microseconds
        calls[event.name] += 1
    if device.type != "cuda":
        return totals, calls, sum(totals.values())
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):  # the union: overlapping kernels (two streams) counted once
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return totals, calls, busy


def step_profile(runner, device: torch.device, n: int, context: int, steps: int, graphs: bool, sdpa: str = "default") -> dict:
    """One width's record: wall µs a step (median of `steps`, no profiler), then the kernels of `steps` more
    under the profiler (µs a step, by family and by name) and the device's idle µs a step. `sdpa`: the attention
    backend the step is held to ("default": torch's choice), captured with it."""
    with sdpa_backend(sdpa):
        return _profile(runner, device, n, context, steps, graphs) | {"sdpa": sdpa}


def sdpa_backend(name: str):
    """A context holding `scaled_dot_product_attention` to backend `name` (math, efficient, cudnn, flash), or
    nothing for "default"."""
    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "flash": SDPBackend.FLASH_ATTENTION}
    return nullcontext() if name == "default" else sdpa_kernel([backends[name]])


def _profile(runner, device: torch.device, n: int, context: int, steps: int, graphs: bool) -> dict:
    runner.use_graphs(graphs)
    cache = runner.new_cache(context + n + 1)
    runner.forward(cache, torch.zeros(context, dtype=torch.long, device=device), logits="none")  # prefill, eager
    tokens = torch.randint(0, runner.config.vocab_size, (n,), device=device)  # [n]

    def step():
        runner.forward(cache, tokens, logits="all")  # [n, vocab], as a decode step or a verification asks
        cache.truncate(context)

    wall = elapsed(step, device, steps) * 1e6  # after a first step, which captures the graph or warms the kernels
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        for _ in range(steps):
            step()
        synchronize(device)
    cache.release()
    totals, calls, busy = kernel_times(profiler.events(), device)
    per_step = {name: microseconds / steps for name, microseconds in totals.items()}
    families: dict[str, float] = defaultdict(float)
    for name, microseconds in per_step.items():
        families[family(name)] += microseconds
    return {"kind": "step_kernels", "mode": "graph" if graphs else "eager", "n": n, "context": context, "steps": steps,
            "wall_us": wall, "busy_us": busy / steps, "idle_us": max(0.0, wall - busy / steps),
            "families_us": dict(sorted(families.items(), key=lambda kv: -kv[1])),
            "kernels": sorted(({"name": name[:160], "family": family(name), "us": us, "calls": calls[name] / steps}
                               for name, us in per_step.items()), key=lambda k: -k["us"])}


def table(records: list[dict]) -> str:
    """Each width's wall, busy and idle µs and each family's µs, with its change from the mode's first width; then
    the kernels that grew most from the first width to the last."""
    lines = []
    for mode, sdpa in dict.fromkeys((r["mode"], r.get("sdpa", "default")) for r in records):
        rows = [r for r in records if (r["mode"], r.get("sdpa", "default")) == (mode, sdpa)]
        base, widest = rows[0], rows[-1]
        names = list(dict.fromkeys(name for r in rows for name in r["families_us"]))
        lines.append(f"{mode}, attention {sdpa}: µs a step (change from n = {base['n']})")
        lines.append("  n    wall    busy    idle  " + "  ".join(f"{name:>16}" for name in names))
        for r in rows:
            cells = []
            for name in names:
                now, before = r["families_us"].get(name, 0.0), base["families_us"].get(name, 0.0)
                cells.append(f"{now:7.1f} ({now - before:+6.1f})")
            lines.append(f"  {r['n']:<3} {r['wall_us']:7.1f} {r['busy_us']:7.1f} {r['idle_us']:7.1f}  " + "  ".join(cells))
        before = {k["name"]: k["us"] for k in base["kernels"]}
        lines.append(f"  kernels that grew most from n = {base['n']} to {widest['n']}:")
        for kernel in sorted(widest["kernels"], key=lambda k: before.get(k["name"], 0.0) - k["us"])[:8]:
            lines.append(f"    {before.get(kernel['name'], 0.0):7.1f} → {kernel['us']:7.1f} µs  ×{kernel['calls']:.0f}  "
                         f"{kernel['name'][:100]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a name in configs.json (random weights)")
    parser.add_argument("--real", type=Path, default=None, help="a real model folder instead (`ship_weights.py` brings one)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None, help="default bfloat16 on a GPU, float32 on a CPU")
    parser.add_argument("--tiny", action="store_true", help="shrunk shapes (a CPU smoke test)")
    parser.add_argument("--widths", default="1,2,5,13,16", help="positions per forward, the first the baseline")
    parser.add_argument("--context", type=int, default=256, help="cached positions before each forward")
    parser.add_argument("--steps", type=int, default=20, help="forwards timed and profiled per width")
    parser.add_argument("--modes", default="graph,eager", help="replayed graphs and/or eager launches")
    parser.add_argument("--sdpa", default="default",
                        help="attention backends to hold the step to, each a pass: default, math, efficient, cudnn, flash")
    parser.add_argument("--out", type=Path, default=Path("step_kernels.jsonl"))
    parser.add_argument("--workdir", type=Path, default=None, help="where a random model is written (default: a temp dir)")
    args = parser.parse_args(argv)
    widths = [int(n) for n in args.widths.split(",")]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    backends = [b.strip() for b in args.sdpa.split(",") if b.strip()]
    if not widths or min(widths) < 1 or max(widths) > 32 or set(modes) - {"graph", "eager"} or not modes:
        parser.error("--widths: 1 … 32 positions (a step; longer chains are prompts); --modes: graph and/or eager")
    if not backends or set(backends) - {"default", "math", "efficient", "cudnn", "flash"}:
        parser.error("--sdpa: default, math, efficient, cudnn and/or flash")

    device = resolve_device(args.device)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    records = [{"kind": "env", "device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                "torch": torch.__version__, "dtype": dtype, "model": str(args.real or args.model)}]
    with tempfile.TemporaryDirectory(dir=args.workdir) as work:
        folder = args.real or build_random_model(args.model, Path(work) / "model", args.tiny, 1, 20.0, device)
        runner = EngineBuilder(str(folder), dtype, device=str(device)).target().runner
        context = min(args.context, 32) if args.tiny else args.context
        for sdpa in backends:
            for mode in modes:
                for n in widths:
                    try:
                        records.append(step_profile(runner, device, n, context, args.steps, mode == "graph", sdpa))
                    except Exception as error:  # noqa: BLE001 (one failing width or backend never loses the others)
                        records.append({"kind": "error", "mode": mode, "sdpa": sdpa, "n": n,
                                        "error": f"{type(error).__name__}: {str(error)[:300]}"})
                    args.out.write_text("".join(json.dumps(r) + "\n" for r in records))  # kept whatever fails later
    print(json.dumps(records[0]))
    for error in (r for r in records if r["kind"] == "error"):
        print(f"error {error['mode']} attention {error['sdpa']} n={error['n']}: {error['error']}")
    print(table([r for r in records if r["kind"] == "step_kernels"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
