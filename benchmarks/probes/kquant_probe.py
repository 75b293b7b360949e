"""Probe of a hand-written AVX2 kernel for llama.cpp's own 4/6-bit weights (issue #8), against int8.

The question: could verispec run the GGUF's Q4_K / Q6_K numbers themselves (the Q4_K_M file's
precision, ~0.6 of int8's bytes) with a kernel whose verification of a few positions stays near the
cost of one? `kquant_probe.cpp` computes y = x Wᵀ with W in the K-quant formats (activations int8
per group of 32, every row computed alone, so rows do not depend on each other) and is checked here
against a float reference. It is timed interleaved against verispec's int8 layer (`Int8Linear`,
fbgemm) and PyTorch's own 4-bit CPU kernel (`_weight_int4pack_mm_for_cpu`, bf16 activations,
groups of 32) for the 1.5B's shapes and 1–16 rows; random weights, since speed does not depend on
values.

    python benchmarks/probes/kquant_probe.py [--repeats 9] [--rows 1,2,4,8,16]

The kernel is not part of verispec (its measurement: docs/history.md, 2026-11-23), so it is built
here, from benchmarks/probes/, into the cache directory.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from verispec.models.int8 import Int8Linear
from verispec.paths import cache_dir

SHAPES = {"qkv": (2048, 1536), "gate_up": (17920, 1536), "down": (1536, 8960), "head": (151936, 1536)}


def build():
    source = Path(__file__).with_name("kquant_probe.cpp")
    folder = cache_dir() / "kernels" / "kquant_probe"
    folder.mkdir(parents=True, exist_ok=True)
    return load("verispec_kquant_probe", [str(source)], build_directory=str(folder),
                extra_cflags=["-O3", "-mavx2", "-mfma", "-ffp-contract=off"])


def random_q4k(n: int, k: int):
    """Q4_K numbers in the probe's layout: nibbles [n, k/2], 6-bit scales and mins [n, k/32], d, dmin [n, k/256]."""
    return (torch.randint(0, 256, (n, k // 2), dtype=torch.uint8), torch.randint(0, 64, (n, k // 32), dtype=torch.uint8),
            torch.randint(0, 64, (n, k // 32), dtype=torch.uint8), torch.rand(n, k // 256) * 1e-3, torch.rand(n, k // 256) * 1e-3)


def random_q6k(n: int, k: int):
    """Q6_K numbers: q [n, k] in [−32, 31], int8 scales [n, k/16], d [n, k/256]."""
    return (torch.randint(-32, 32, (n, k), dtype=torch.int8), torch.randint(-128, 128, (n, k // 16), dtype=torch.int8),
            torch.rand(n, k // 256) * 1e-3)


def dequantize_q4k(qs, sc, mn, d, dmin) -> torch.Tensor:
    n, half = qs.shape
    nibbles = torch.stack([qs & 15, qs >> 4], dim=1).view(n, 2, -1, 16).permute(0, 2, 1, 3).reshape(n, -1)  # [n, k]
    scale = (d.repeat_interleave(8, 1) * sc.float()).repeat_interleave(32, 1)
    low = (dmin.repeat_interleave(8, 1) * mn.float()).repeat_interleave(32, 1)
    return scale * nibbles.float() - low


def torch_int4(q4):
    """The same 4-bit numbers for `_weight_int4pack_mm_for_cpu`: packed nibbles and bf16 (scale, zero)
    per group of 32, with W = (q − 8)·scale + zero, i.e. zero = 8·scale − min."""
    qs, sc, mn, d, dmin = q4
    n = qs.shape[0]
    nibbles = torch.stack([qs & 15, qs >> 4], dim=1).view(n, 2, -1, 16).permute(0, 2, 1, 3).reshape(n, -1)  # [n, k]
    scale = d.repeat_interleave(8, 1) * sc.float()  # [n, k/32]
    zero = 8 * scale - dmin.repeat_interleave(8, 1) * mn.float()
    packed = torch._convert_weight_to_int4pack_for_cpu(nibbles.int(), 1)
    return packed, torch.stack([scale.T, zero.T], dim=-1).contiguous().bfloat16()  # [k/32, n, 2]


def dequantize_q6k(q, sc, d) -> torch.Tensor:
    return (d.repeat_interleave(16, 1) * sc.float()).repeat_interleave(16, 1) * q.float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel = build()
    rows = [int(r) for r in args.rows.split(",")]
    print(f"{'shape':8} {'rows':>4}  " + "  ".join(f"{name:>9}" for name in ("q4k ms", "q6k ms", "int8 ms", "int4pack", "q4k/int8")))
    for name, (n, k) in SHAPES.items():
        q4, q6 = random_q4k(n, k), random_q6k(n, k)
        layer = Int8Linear.from_float(dequantize_q4k(*q4))
        int4, scales_and_zeros = torch_int4(q4)
        candidates = {
            "q4k": lambda x: kernel.q4k_matmul(*kernel.quantize_rows(x), *q4),
            "q6k": lambda x: kernel.q6k_matmul(*kernel.quantize_rows(x), *q6),
            "int8": layer,
            "int4pack": lambda x: torch._weight_int4pack_mm_for_cpu(x.bfloat16(), int4, 32, scales_and_zeros),
        }
        x = torch.randn(3, k)
        for label, weight in (("q4k", dequantize_q4k(*q4)), ("q6k", dequantize_q6k(*q6))):
            got, want = candidates[label](x), x @ weight.T
            error = float((got - want).norm() / want.norm())
            assert error < 0.02, f"{label} kernel is wrong on {name}: relative error {error:.3g}"
            assert torch.equal(got[1:2], candidates[label](x[1:2])), f"{label} rows depend on each other"
        for m in rows:
            x = torch.randn(m, k)
            times: dict[str, list[float]] = {label: [] for label in candidates}
            for _ in range(args.repeats if n < 100_000 else max(3, args.repeats // 3)):
                for label, run in candidates.items():
                    start = time.perf_counter()
                    run(x)
                    times[label].append(time.perf_counter() - start)
            ms = {label: statistics.median(t) * 1e3 for label, t in times.items()}
            print(f"{name:8} {m:>4}  {ms['q4k']:9.2f}  {ms['q6k']:9.2f}  {ms['int8']:9.2f}  {ms['int4pack']:9.2f}"
                  f"  {ms['q4k'] / ms['int8']:9.2f}")


if __name__ == "__main__":
    main()
