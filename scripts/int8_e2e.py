"""End-to-end float32 vs int8 on the shipped pair, side by side in one process (issue #8).

1. load time of each precision (target and draft);
2. forward cost T(n) of the target over n = 1..8 new positions after a 128-token context, and the
   draft's cost per token, both precisions interleaved (median of --repeats);
3. greedy generation of one prompt, --tokens new tokens, four methods interleaved in rotating order
   for --rounds rounds: plain fp32, plain int8, speculative fp32 (0.5B fp32 draft) and speculative
   int8 (0.5B int8 draft), γ constant; medians of ms per token with prefill excluded
   (decode = wall − prefill) and included. Also checks that speculative int8 equals plain int8.

    python scripts/int8_e2e.py --threads 2 --tokens 64 --rounds 3 --gamma 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from verispec import Engine, GenerationConfig
from verispec.drafters import DraftModelDrafter
from verispec.models.loading import load_model
from verispec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET

PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring and two tests."


_CACHES = {}


def forward_seconds(runner, n: int, context: int = 128) -> float:
    """Seconds of one forward over n new positions after `context` cached tokens (prefilled once per runner)."""
    if id(runner) not in _CACHES:
        cache = runner.new_cache(context + 64)
        runner.forward(cache, torch.zeros(context, dtype=torch.long), logits="none")
        _CACHES[id(runner)] = cache
    cache = _CACHES[id(runner)]
    cache.truncate(context)
    start = time.perf_counter()
    runner.forward(cache, torch.full((n,), 13, dtype=torch.long), logits="all")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--prompt", default=PROMPT)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads")

    models = {}
    for precision in ("float32", "int8"):
        for role, spec in (("target", DEFAULT_TARGET), ("draft", DEFAULT_DRAFT)):
            start = time.perf_counter()
            models[role, precision] = load_model(spec, precision)
            print(f"load {role} {precision}: {time.perf_counter() - start:.1f} s")

    with torch.inference_mode():
        print("\nforward cost, median ms (int8 / fp32)")
        print("      n   target fp32   target int8   ratio")
        for n in (1, 2, 4, 8):
            times = {p: [] for p in ("float32", "int8")}
            for r in range(args.repeats):
                for p in (("float32", "int8") if r % 2 == 0 else ("int8", "float32")):
                    times[p].append(forward_seconds(models["target", p].runner, n))
            fp32, int8 = (statistics.median(times[p]) * 1e3 for p in ("float32", "int8"))
            print(f"  {n:5d}  {fp32:12.1f}  {int8:12.1f}   {int8 / fp32:5.2f}")
        int8 = models["target", "int8"].runner
        for n in (4, 8):  # the cost of attending one query at a time (row invariance) in a verification pass
            times = {True: [], False: []}
            for r in range(args.repeats):
                for flag in ((True, False) if r % 2 == 0 else (False, True)):
                    int8.row_invariant = flag
                    times[flag].append(forward_seconds(int8, n))
            int8.row_invariant = True
            on, off = (statistics.median(times[f]) * 1e3 for f in (True, False))
            print(f"int8 target, n={n}: row-invariant attention {on:.1f} ms, one batched SDPA call {off:.1f} ms")
        draft = {p: [] for p in ("float32", "int8")}
        for r in range(args.repeats):
            for p in (("float32", "int8") if r % 2 == 0 else ("int8", "float32")):
                draft[p].append(forward_seconds(models["draft", p].runner, 1))
        d32, d8 = (statistics.median(draft[p]) * 1e3 for p in ("float32", "int8"))
        print(f"draft 0.5B per token: fp32 {d32:.1f} ms, int8 {d8:.1f} ms ({d8 / d32:.2f})")

        ids = models["target", "float32"].encode_prompt(args.prompt)
        engines = {}
        for p in ("float32", "int8"):
            target = models["target", p]
            engines[f"plain {p}"] = Engine(target, None)
            engines[f"spec {p}"] = Engine(target, DraftModelDrafter(models["draft", p], target.vocab_size),
                                          gamma=args.gamma, gamma_policy="constant")
        config = GenerationConfig(max_new_tokens=args.tokens)
        results = {name: [] for name in engines}
        outputs = {}
        names = list(engines)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                result = engines[name].generate(ids, config)
                s = result.stats
                results[name].append((s.wall_seconds, s.prefill_seconds, s.new_tokens, s.mean_accepted_length))
                outputs[name] = result.token_ids
        print(f"\ngreedy, {len(ids)}-token prompt, {args.tokens} new tokens, γ={args.gamma} constant, "
              f"{args.rounds} interleaved rounds (medians)")
        print("  method          decode ms/token   with prefill ms/token   tok/s (decode)   τ")
        for name, rows in results.items():
            decode = statistics.median((w - p) / n for w, p, n, _ in rows) * 1e3
            full = statistics.median(w / n for w, _, n, _ in rows) * 1e3
            tau = statistics.median(t for *_, t in rows)
            print(f"  {name:14s}  {decode:15.1f}   {full:21.1f}   {1e3 / decode:14.2f}   {tau:.2f}")
        print(f"spec int8 == plain int8: {outputs['spec int8'] == outputs['plain int8']}; "
              f"spec fp32 == plain fp32: {outputs['spec float32'] == outputs['plain float32']}; "
              f"int8 == fp32 (plain): {outputs['plain int8'] == outputs['plain float32']}")


if __name__ == "__main__":
    main()
