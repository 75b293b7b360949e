"""One kquant layer at several row counts with each tile kernel built here: ms a call, kernels in turns.

Answers where each kernel pays by rows (on an AMX CPU: from how many rows the `amx` tile multiplies beat the
AVX-512 code). Layers of the shipped 1.5B's shapes with random blocks and float16 scales of a sane size; one layer,
called again and again, so its weights sit in cache: the kernels' compute, not the memory stream (the whole-model
curve is `kquant_kernel_curves.py`). Best of --rounds calls.

    python benchmarks/probes/kquant_layer_rows.py [--rows 4,8,9,12,16,64,512] [--rounds 7]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from kquant_streaming import BLOCK_BYTES

from verispec.models.kquant import KQUANT_TYPES, KQuantLinear, KQuantWeight, kquant_kernels
from verispec.paths import cpu_summary

SHAPES = [("gate_up", "Q4_K", 17920, 1536), ("down", "Q4_K", 1536, 8960), ("down", "Q6_K", 1536, 8960)]  # name, type, out, in


def layer(kind: int, out_features: int, in_features: int, rng: np.random.Generator) -> KQuantLinear:
    blocks = rng.integers(0, 256, (out_features, in_features // 256, BLOCK_BYTES[kind]), dtype=np.uint8)
    scales, at = (2, 0) if kind == KQUANT_TYPES["Q4_K"] else (1, 208)  # Q4_K: d, dmin first; Q6_K: d last
    blocks[:, :, at : at + 2 * scales] = (rng.random((out_features, in_features // 256, scales)) * 2e-4).astype(np.float16).view(np.uint8)
    return KQuantLinear(KQuantWeight(kind, torch.from_numpy(blocks.reshape(out_features, -1)), in_features))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="4,8,9,12,16,64,512", help="row counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    rows = [int(n) for n in args.rows.split(",")]
    kernels = kquant_kernels()
    names = [name for name in kernels.kernels_built() if name != "portable"]
    print(f"{cpu_summary()}, {torch.get_num_threads()} threads, best of {args.rounds} calls, ms")
    rng = np.random.default_rng(0)
    try:
        for name, kind_name, out_features, in_features in SHAPES:
            linear = layer(KQUANT_TYPES[kind_name], out_features, in_features, rng)
            for kernel in names:
                kernels.use_kernels(kernel)
                times = []
                for n in rows:
                    x = torch.randn(n, in_features)  # [n, in]
                    best = float("inf")
                    for _ in range(args.rounds):
                        began = time.perf_counter()
                        linear(x)
                        best = min(best, time.perf_counter() - began)
                    times.append(f"{n}: {best * 1e3:.2f}")
                print(f"  {name} {kind_name} {out_features}×{in_features} {kernel:7s} " + "  ".join(times), flush=True)
    finally:
        kernels.use_kernels(kernels.kernels_built()[0])


if __name__ == "__main__":
    main()
