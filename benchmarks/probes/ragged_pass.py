"""What a server's batched pass costs: `forward_ragged` of k rows against one row, on the compiled stack and the
Python loop.

The scheduler verifies every running request in one target pass and a batched draft would draft them in one pass
too; that only pays if k rows cost much less than k passes. For each model (kquant) and each k, the best of
`--repeats` passes of k rows of `--feed` positions each, on caches of `--context` placeholder slots, timed in
turns with the C++ decoder stack (`kernels/decoder.h`) and with the Python layer loop (`_compiled_layers` off).

    .venv/bin/python benchmarks/probes/ragged_pass.py --models smollm2-135m-instruct,qwen2.5-coder-1.5b-instruct
"""

from __future__ import annotations

import argparse
import time
from unittest import mock

import torch

from verispec.models.loading import load_model
from verispec.models.transformer import Transformer
from verispec.paths import cpu_summary


def pass_seconds(runner, caches, feed: int, repeats: int) -> float:
    """The best of `repeats` passes of one row of `feed` positions on each cache (each cache rolled back after)."""
    lengths, best = [cache.length for cache in caches], float("inf")
    feeds = [torch.zeros(feed, dtype=torch.long) for _ in caches]
    for _ in range(repeats):
        started = time.perf_counter()
        runner.forward_ragged(caches, feeds)
        best = min(best, time.perf_counter() - started)
        for cache, length in zip(caches, lengths):
            cache.truncate(length)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2-135m-instruct,qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--feed", type=int, default=1, help="positions per row (1: decode steps; γ+1: verifications)")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(cpu_summary(), f"· {torch.get_num_threads()} threads · {args.feed} positions a row after {args.context}", flush=True)
    for name in args.models.split(","):
        runner = load_model(name, "kquant").runner
        caches = [runner.placeholder_cache(args.context, args.context + args.feed + 1) for _ in range(max(map(int, args.rows.split(","))))]
        one = None
        for k in map(int, args.rows.split(",")):
            compiled = pass_seconds(runner, caches[:k], args.feed, args.repeats)
            with mock.patch.object(Transformer, "_compiled_layers", lambda self: None):
                python = pass_seconds(runner, caches[:k], args.feed, args.repeats)
            one = one or compiled
            print(f"{name} · {k} rows: compiled {compiled * 1e3:.1f} ms ({compiled / one:.2f}× one row, "
                  f"{compiled / one / k:.2f} of k passes) · Python loop {python * 1e3:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
