"""What the shipped 0.5B draft costs on the kquant kernels (issue #31: a draft at c ≤ 0.15).

The 0.5B file keeps its 896-wide layers as Q5_0/Q8_0 blocks, so kquant runs a requantized copy
(`models/requantize.py`: made once, then cached). This probe loads it (printing the seconds and the
process's peak memory: on a fresh cache that includes the requantization), then times, in one process
with the shipped 1.5B target in kquant, the median decode step after --context tokens of the draft with
its full vocabulary, a reduced one (FR-Spec style, `model:vocab=N`) and half its layers; c = that over
the target's step. Rounds over every variant, so a drift of the machine's speed touches them alike.

    python benchmarks/probes/kquant_draft_cost.py [--context 300] [--repeats 15]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

from verispec.models.loading import load_model
from verispec.models.registry import DEFAULT_TARGET, default_draft_for
from verispec.models.variants import derive_model
from verispec.paths import cpu_summary


def prefilled(runner, context: int):
    cache = runner.new_cache(context + 8)
    runner.forward(cache, torch.arange(100, 100 + context), logits="none")
    return cache


def step_seconds(runner, cache, context: int) -> float:
    """Seconds of one one-token decode step after the `context` cached tokens (logits of the head)."""
    cache.truncate(context)
    began = time.perf_counter()
    runner.forward(cache, torch.tensor([7]), logits="last")
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    print(f"{cpu_summary()}, {torch.get_num_threads()} threads, {args.context} cached tokens, median of {args.repeats}")
    target = load_model(DEFAULT_TARGET, "kquant")
    began = time.perf_counter()
    draft = load_model(default_draft_for(DEFAULT_TARGET), "kquant", pack_rows=1)
    print(f"  draft loaded in {time.perf_counter() - began:.1f} s (variant {draft.runner.variant!r}); process peak so far "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    runners = {
        "target (1.5B, the file's blocks)": target.runner,
        "draft, full vocabulary": draft.runner,
        "draft, 32,768 ids": derive_model(draft, None, 32768, False).runner,
        "draft, 16,384 ids": derive_model(draft, None, 16384, False).runner,
        "draft, 12 of 24 layers, 32,768 ids": derive_model(draft, 12, 32768, False).runner,
    }
    caches = {name: prefilled(runner, args.context) for name, runner in runners.items()}
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.repeats):
        for name, runner in runners.items():
            times[name].append(step_seconds(runner, caches[name], args.context))
    medians = {name: statistics.median(seconds) for name, seconds in times.items()}
    base = next(iter(medians.values()))
    for name, runner in runners.items():
        print(f"  {name:36s} {medians[name] * 1e3:6.1f} ms a step  ({runner.linear_bytes / 1e6:4.0f} MB of weights a token)"
              f"  c = {medians[name] / base:.2f}")


if __name__ == "__main__":
    main()
