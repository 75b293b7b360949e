"""kquant's own attention (`kernels/attention.h`) against SDPA, and what it does to a step (issue #31).

In one process:
  layer       one layer's attention of the 1.5B's shape (12 query heads, 2 KV heads, d 128) over 64, 700 and
              1,500 cached slots for 1 and 5 new positions: the exact kernel against SDPA called once per
              position (what the runner did to keep each position's bits its own); then a prompt piece of
              256 positions after 0, 256, 512 and 768 cached ones against one batched SDPA call
  step        the shipped 1.5B in kquant: a decode step after 64, 700 and 1,500 cached tokens, and T(n)/T(1)
              for n = 2, 4, 6, 8 after 700 (median of --repeats)
  prefill     1,024 prompt tokens in kquant and on llama.cpp (`--dtype gguf`), best of 2

    python benchmarks/probes/kquant_attention.py [--repeats 9]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F

from verispec.models.kquant import kquant_kernels
from verispec.models.loading import load_model
from verispec.models.registry import DEFAULT_TARGET

HEADS, KV_HEADS, HEAD_DIM = 12, 2, 128


def median_seconds(run, repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def layer(repeats: int) -> None:
    attend, scale = kquant_kernels().attend, 1 / math.sqrt(HEAD_DIM)
    keys, values = torch.randn(KV_HEADS, 1600, HEAD_DIM), torch.randn(KV_HEADS, 1600, HEAD_DIM)  # one layer's cache

    def per_position(q, start):  # [heads, n, d]: SDPA once per position, as the runner did
        return torch.cat([F.scaled_dot_product_attention(q[None, :, i : i + 1], keys[None, :, : start + i + 1],
                                                         values[None, :, : start + i + 1], scale=scale, enable_gqa=True)[0]
                          for i in range(q.shape[1])], 1)

    for seen in (64, 700, 1500):
        line = []
        for n in (1, 5):
            q = torch.randn(HEADS, n, HEAD_DIM)
            exact = median_seconds(lambda: attend(q, keys, values, seen - n, None, scale), 10 * repeats)
            sdpa = median_seconds(lambda: per_position(q, seen - n), 10 * repeats)
            line.append(f"{n} new: exact {exact * 1e6:.0f} µs, SDPA per position {sdpa * 1e6:.0f} µs")
        print(f"  layer, {seen:5d} slots: " + "; ".join(line))
    for start in (0, 256, 512, 768):
        q, n = torch.randn(HEADS, 256, HEAD_DIM), 256
        mask = torch.cat([torch.ones(n, start, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()], 1)
        exact = median_seconds(lambda: attend(q, keys, values, start, None, scale), repeats)
        causal = dict(is_causal=True) if start == 0 else dict(attn_mask=mask)
        sdpa = median_seconds(lambda: F.scaled_dot_product_attention(q[None], keys[None, :, : start + n], values[None, :, : start + n],
                                                                     scale=scale, enable_gqa=True, **causal), repeats)
        print(f"  prompt piece of 256 after {start:3d}: exact {exact * 1e3:.1f} ms, SDPA batched {sdpa * 1e3:.1f} ms")


def step(repeats: int) -> None:
    runner = load_model(DEFAULT_TARGET, "kquant").runner
    cache = runner.new_cache(1600)

    def at(context: int, n: int) -> float:
        def run():
            cache.truncate(context)
            runner.forward(cache, torch.arange(7, 7 + n), logits="all")
        return median_seconds(run, repeats)

    for context in (64, 700, 1500):
        cache.truncate(0)
        runner.forward(cache, torch.arange(100, 100 + context), logits="none")
        line = f"  decode step after {context:5d} tokens: {at(context, 1) * 1e3:.1f} ms"
        if context == 700:
            one = at(context, 1)
            line += "; T(n)/T(1) " + ", ".join(f"n={n} {at(context, n) / one:.2f}" for n in (2, 4, 6, 8))
        print(line, flush=True)


def prefill() -> None:
    prompt = torch.arange(100, 1124)  # 1,024 tokens
    for precision in ("kquant", "gguf"):
        runner = load_model(DEFAULT_TARGET, precision).runner
        best = float("inf")
        for _ in range(2):
            cache = runner.new_cache(1100)
            began = time.perf_counter()
            runner.forward(cache, prompt, logits="last")
            best = min(best, time.perf_counter() - began)
            cache.release()
        print(f"  prefill of 1,024 tokens, {precision}: {best:.2f} s", flush=True)
        del runner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    from verispec.paths import cpu_summary

    print(f"{cpu_summary()}, {torch.get_num_threads()} threads")
    layer(args.repeats)
    step(args.repeats)
    prefill()


if __name__ == "__main__":
    main()
