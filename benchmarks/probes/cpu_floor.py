"""How fast can a decode step be on this CPU? The memory-bandwidth floor behind issue #8, measured.

A single-token decode step reads every weight it multiplies once; on a CPU that is the floor of its
time. This script measures, in one process:

  bandwidth   the CPU's read bandwidth with --threads threads (a 1 GiB float32 sum, best of --rounds)
  bytes       the weight bytes one decode token reads: verispec's int8 linears (target and draft)
              against the tensors llama.cpp multiplies in the shipped GGUF files (Q4_K_M mix)
  steps       one decode step after --context cached tokens, medians of --rounds, interleaved:
              verispec int8 (the compiled stack) at 1..5 positions, llama.cpp at one token

and prints each step's floor (bytes / bandwidth) next to its measured time, the speedup speculation
must bring for the int8 target to tie llama.cpp's plain decode, and the best speedup the theory
(`verispec.control.theory`, with the measured verification curve) gives a draft model with this cost at
the --alphas acceptance rates (an n-gram table's c is ≈ 0), with the measured verification curve
and, as an upper bound, with verification as cheap as one position.

    scripts/setup.sh   # builds llama-cpp-python for this CPU
    python benchmarks/probes/cpu_floor.py [--rounds 10] [--context 199] [--threads 2] [--alphas 0.6,0.7,0.8,0.9]
"""

from __future__ import annotations

import argparse
import statistics
import time

import gguf
import torch

from verispec.control.theory import curve_verify_cost, expected_speedup, optimal_gamma
from verispec.tools.bench.memory import runner_linear_bytes
from verispec.models.loading import load_model
from verispec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET, gguf_path, shipped_model

GB = 1e9


def read_bandwidth(rounds: int) -> float:
    """Bytes per second of a float32 sum over 1 GiB (best of `rounds`)."""
    data = torch.ones(1 << 28)  # [2^28] float32: 1 GiB
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best


def gguf_decode_bytes(path) -> int:
    """Bytes of the GGUF tensors a decode token multiplies: every matrix but the token embedding, which
    only has one row read, unless the output head is tied to it (no `output.weight`)."""
    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}
    tied = "output.weight" not in tensors
    return sum(size for name, size in tensors.items() if name != "token_embd.weight" or tied)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--context", type=int, default=199)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--alphas", default="0.6,0.7,0.8,0.9", help="acceptance rates to evaluate the theory at")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import llama_cpp

    bandwidth = read_bandwidth(args.rounds)
    print(f"read bandwidth, {args.threads} threads: {bandwidth / GB:.1f} GB/s")

    names = (DEFAULT_TARGET, DEFAULT_DRAFT)
    runners = {name: load_model(name, "int8").runner for name in names}
    caches = {}
    for name, runner in runners.items():
        caches[name] = runner.new_cache(args.context + 8)
        runner.forward(caches[name], torch.arange(1000, 1000 + args.context), logits="none")
    llms = {name: llama_cpp.Llama(model_path=str(gguf_path(shipped_model(name))), n_ctx=args.context + 8,
                                  n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
            for name in names}
    for llm in llms.values():
        llm.eval(list(range(1000, 1000 + args.context)))

    positions = (1, 2, 3, 4, 5)
    times: dict[tuple[str, str, int], list[float]] = {}
    for _ in range(args.rounds):
        for name in names:
            for n in positions:
                start = time.perf_counter()
                runners[name].forward(caches[name], torch.arange(2000, 2000 + n))
                times.setdefault((name, "int8", n), []).append(time.perf_counter() - start)
                caches[name].truncate(args.context)
            start = time.perf_counter()
            llms[name].eval([2000])
            times.setdefault((name, "llama.cpp", 1), []).append(time.perf_counter() - start)
            llms[name].n_tokens = args.context  # roll back: the next eval drops the cache past it
    ms = {key: statistics.median(value) * 1e3 for key, value in times.items()}

    print(f"one decode token after {args.context} cached tokens (median of {args.rounds}):")
    for name in names:
        for path, nbytes in (("int8", runner_linear_bytes(runners[name])),
                             ("llama.cpp", gguf_decode_bytes(gguf_path(shipped_model(name))))):
            floor = nbytes / bandwidth * 1e3
            step = ms[(name, path, 1)]
            print(f"  {name} {path:>9}: {nbytes / GB:.2f} GB of weights, floor {floor:5.1f} ms, "
                  f"measured {step:5.1f} ms ({nbytes / step / 1e6:.1f} GB/s)")
    target, draft = names
    curve = [ms[(target, "int8", n)] for n in positions]
    print(f"  int8 target at 1..5 positions: {' / '.join(f'{t:.1f}' for t in curve)} ms "
          f"({' / '.join(f'{t / curve[0]:.2f}' for t in curve)}× one)")
    need = ms[(target, "int8", 1)] / ms[(target, "llama.cpp", 1)]
    print(f"speculation on the int8 target must bring {need:.2f}× to tie llama.cpp's plain decode step")
    verify = curve_verify_cost(curve)
    drafts = {"n-gram draft": 0.0, "int8 draft": ms[(draft, "int8", 1)] / curve[0],
              "llama.cpp draft": ms[(draft, "llama.cpp", 1)] / curve[0]}
    alphas = [float(a) for a in args.alphas.split(",")]
    for label, c in drafts.items():
        for curve_name, cost in (("measured verification", verify), ("free verification", None)):
            best = []
            for alpha in alphas:
                gamma = optimal_gamma(alpha, c, max_gamma=len(positions) - 1, verify_cost=cost)
                best.append(f"α {alpha}: {expected_speedup(alpha, gamma, c, cost):.2f}× (γ {gamma})")
            print(f"  {label} (c {c:.2f}), {curve_name}, best expected speedup: " + ", ".join(best))


if __name__ == "__main__":
    main()
