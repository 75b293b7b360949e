"""A decode step's time and T(n)/T(1) after several context lengths, for shipped models on kquant.

Each position of a verification attends the whole context, so T(n)/T(1) grows with it (the γ policy reads it at a
request's context: `control/costs.py`). Prints, per model and context, T(1) in ms and T(n)/T(1) for each width: the
fastest of `--rounds` rounds of 5 forwards each, rounds over every width so that a drift of the machine touches all.

    python benchmarks/probes/step_costs.py --models qwen2.5-coder-1.5b-instruct --contexts 64,700,1400 --widths 2,3,5,9
"""

from __future__ import annotations

import argparse
import time

import torch

from verispec.models.loading import load_model
from verispec.paths import cpu_summary


def step_seconds(runner, cache, context: int, n: int) -> float:
    """The fastest of 5 forwards over n new positions after `context` cached ones (each rolled back)."""
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        runner.forward(cache, torch.randint(0, 1000, (n,)), logits="all")
        best = min(best, time.perf_counter() - start)
        cache.truncate(context)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--contexts", default="64,700,1400")
    parser.add_argument("--widths", default="2,3,5,9")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    widths = [1, *map(int, args.widths.split(","))]
    print(cpu_summary())
    for name in args.models.split(","):
        runner = load_model(name, "kquant").runner
        for context in map(int, args.contexts.split(",")):
            cache = runner.new_cache(context + max(widths) + 1)
            runner.forward(cache, torch.randint(0, 1000, (context,)), logits="none")
            best = dict.fromkeys(widths, float("inf"))
            for _ in range(args.rounds):
                for n in widths:
                    best[n] = min(best[n], step_seconds(runner, cache, context, n))
            cache.release()
            ratios = " ".join(f"{n}: {best[n] / best[1]:.2f}" for n in widths[1:])
            print(f"{name} after {context} tokens: T(1) {best[1] * 1e3:.1f} ms; T(n)/T(1) {ratios}", flush=True)


if __name__ == "__main__":
    main()
