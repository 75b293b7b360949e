"""Where a kquant decode step's milliseconds go, against what this CPU can read (issue #31).

A one-token step streams every weight once, so its floor is the weight bytes over the read bandwidth.
This probe measures, in one process:

  bandwidth   the CPU's read bandwidth with torch's threads (`cpu_floor.read_bandwidth`: a 1 GiB sum)
  streaming   each k-quant layer shape of Qwen2.5-Coder-1.5B (Q4_K gate+up, Q4_K and Q6_K down, the Q6_K
              head) with random blocks, enough copies to stream from memory rather than cache, at 1, 2, 4
              and 8 rows: GB/s of packed weights read (best of --rounds)
  step        the shipped 1.5B in `--dtype kquant`, one decode step after --context tokens through the
              Python layer loop with each `KQuantLinear` call timed: the linear layers' milliseconds by
              part and the rest (norms, RoPE, attention, small operations); best of --rounds

    python benchmarks/probes/kquant_streaming.py [--rounds 5] [--context 300]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from cpu_floor import read_bandwidth

from verispec.models.kquant import KQUANT_TYPES, KQuantLinear, KQuantWeight
from verispec.models.loading import load_model
from verispec.models.registry import DEFAULT_TARGET
from verispec.models.transformer import Transformer

BLOCK_BYTES = {KQUANT_TYPES["Q4_K"]: 144, KQUANT_TYPES["Q6_K"]: 210}
SHAPES = [("Q4_K gate+up", "Q4_K", 17920, 1536, 12), ("Q4_K down", "Q4_K", 1536, 8960, 20),
          ("Q6_K down", "Q6_K", 1536, 8960, 14), ("Q6_K head", "Q6_K", 151936, 1536, 2)]  # name, type, out, in, copies


def streaming(rounds: int) -> None:
    rng = np.random.default_rng(0)
    for name, kind_name, out_features, in_features, copies in SHAPES:
        kind = KQUANT_TYPES[kind_name]
        layers = []
        for _ in range(copies):
            blocks = rng.integers(0, 256, (out_features, in_features // 256 * BLOCK_BYTES[kind]), dtype=np.uint8)
            layers.append(KQuantLinear(KQuantWeight(kind, torch.from_numpy(blocks), in_features)))
        nbytes = sum(layer.nbytes for layer in layers)
        line = []
        for rows in (1, 2, 4, 8):
            x = torch.randn(rows, in_features)
            best = float("inf")
            for _ in range(rounds):
                began = time.perf_counter()
                for layer in layers:
                    layer(x)
                best = min(best, time.perf_counter() - began)
            line.append(f"{rows} rows {nbytes / best / 1e9:5.1f} GB/s")
        print(f"  {name:13s} ({nbytes / 1e6:4.0f} MB): " + ", ".join(line))


def step(rounds: int, context: int) -> None:
    runner = load_model(DEFAULT_TARGET, "kquant").runner
    cache = runner.new_cache(context + 8)
    runner.forward(cache, torch.arange(100, 100 + context), logits="none")
    parts: dict[str, float] = {}
    call = KQuantLinear.__call__

    def timed(layer, x):
        began = time.perf_counter()
        y = call(layer, x)
        key = "head" if layer.out_features > 100_000 else "+".join(sorted({k for k in ("Q4_K", "Q6_K") if KQUANT_TYPES[k] in layer.kinds}))
        parts[key] = parts.get(key, 0.0) + time.perf_counter() - began
        return y

    best, best_parts = float("inf"), {}
    compiled = Transformer._compiled_layers
    KQuantLinear.__call__, Transformer._compiled_layers = timed, lambda self: None  # the Python loop: every call seen
    try:
        for _ in range(rounds):
            parts.clear()
            cache.truncate(context)
            began = time.perf_counter()
            runner.forward(cache, torch.tensor([7]))
            if (seconds := time.perf_counter() - began) < best:
                best, best_parts = seconds, dict(parts)
    finally:
        KQuantLinear.__call__, Transformer._compiled_layers = call, compiled
    linear = sum(best_parts.values())
    by_part = ", ".join(f"{name} {seconds * 1e3:.1f}" for name, seconds in sorted(best_parts.items()))
    print(f"  step {best * 1e3:.1f} ms (Python layer loop): linear layers {linear * 1e3:.1f} ms ({by_part}), "
          f"the rest {(best - linear) * 1e3:.1f} ms; weights {runner.linear_bytes / 1e9:.2f} GB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--context", type=int, default=300, help="cached tokens before the timed step")
    args = parser.parse_args()
    from verispec.paths import cpu_summary

    print(f"{cpu_summary()}, {torch.get_num_threads()} threads")
    print(f"  read bandwidth {read_bandwidth(args.rounds) / 1e9:.1f} GB/s")
    streaming(args.rounds)
    step(args.rounds, args.context)


if __name__ == "__main__":
    main()
