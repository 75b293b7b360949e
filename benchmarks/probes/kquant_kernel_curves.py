"""The kquant verification curve with each tile kernel built here, against llama.cpp on the same file.

`kernels/kquant.cpp` has AMX (from 9 rows), AVX-512 VNNI, AVX2 and portable tile code giving the same bits; on
an AVX-512 CPU all but AMX are built, so the AVX2 code (what an AVX2-only CPU runs) can be timed here too. That is
an indication, not a measurement of an AVX2-only CPU: memory, caches and clocks differ. The probe loads
the shipped target as kquant and as llama.cpp's gguf, then times one forward over n = 1 … --widths new
positions after --context cached tokens, in rounds over every (backend, n) so a drift of the machine's
speed touches them alike, and prints the best of each: T(1) and T(n)/T(1).

    python benchmarks/probes/kquant_kernel_curves.py [--widths 9] [--context 128] [--rounds 5]
"""

from __future__ import annotations

import argparse
import time

import torch

from verispec.models.kquant import kquant_kernels
from verispec.models.loading import load_model
from verispec.models.registry import DEFAULT_TARGET
from verispec.paths import cpu_summary


def forward_seconds(runner, cache, context: int, n: int) -> float:
    """Seconds of one forward over n new positions after `context` cached tokens (rolled back after)."""
    cache.truncate(context)
    began = time.perf_counter()
    runner.forward(cache, torch.arange(200, 200 + n), logits="all")
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, default=9)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"{cpu_summary()}, {torch.get_num_threads()} threads, {args.context} cached tokens, best of {args.rounds} rounds")
    kernels = kquant_kernels()
    kquant, gguf = load_model(DEFAULT_TARGET, "kquant").runner, load_model(DEFAULT_TARGET, "gguf").runner
    backends = {f"kquant {name}": (kquant, name) for name in kernels.kernels_built() if name != "portable"}
    backends["llama.cpp (gguf)"] = (gguf, None)
    caches = {}
    for label, (runner, _) in backends.items():
        caches[label] = runner.new_cache(args.context + args.widths + 1)
        runner.forward(caches[label], torch.arange(100, 100 + args.context), logits="none")
    best = {label: [float("inf")] * args.widths for label in backends}
    try:
        for _ in range(args.rounds):
            for label, (runner, name) in backends.items():
                if name:
                    kernels.use_kernels(name)
                for n in range(1, args.widths + 1):
                    best[label][n - 1] = min(best[label][n - 1], forward_seconds(runner, caches[label], args.context, n))
    finally:
        kernels.use_kernels(kernels.kernels_built()[0])
    reference = best["llama.cpp (gguf)"][0]
    for label, times in best.items():
        curve = " ".join(f"{t / times[0]:.2f}" for t in times[1:])
        print(f"  {label:18s} T(1) {1000 * times[0]:6.1f} ms ({times[0] / reference:.2f}× llama.cpp)   T(n)/T(1), n = 2…{args.widths}: {curve}")


if __name__ == "__main__":
    main()
