"""kquant's prefetching of the weight stream for one and two rows (`set_prefetch_few_rows`), on and off in turns.

`models/kquant.settle_prefetch` keeps the setting its own quick timing finds faster on this CPU; this probe times it
more fully, in one process: for each vector code built here (`--kernels`), a decode step's linear layers of the shipped
target by kind (one row through every layer of a kind), `--rounds` rounds with the setting alternating; then plain
greedy decoding of public prompts (the first of each group of `--questions`) with the default kernels, prefetching on
and off in turns: tok/s after the prefill, whether the tokens are the same, and the speedup the layers' ratio predicts
from their share of a whole decode step (timed here too).

    python benchmarks/probes/kquant_prefetch.py [--kernels avx512,avx2] [--rounds 12] [--generate-rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from verispec import GenerationConfig, load
from verispec.models.kquant import kquant_kernels
from verispec.paths import cpu_summary


def layer_seconds(runner, rounds: int, switch=None) -> dict[tuple[str, bool], float]:
    """(kind, setting) -> median seconds of one row through every layer of the kind (`head`: the output head), the
    kernel switch (`switch(on)`; default prefetching for few rows) on and off in turns."""
    switch = switch or kquant_kernels().set_prefetch_few_rows
    kinds = {name: [getattr(layer, name) for layer in runner.layers] for name in ("qkv", "o", "gate_up", "down")}
    kinds["head"] = [runner.lm_head]
    seconds: dict[tuple[str, bool], list[float]] = {}
    for round_ in range(rounds):
        for on in (False, True) if round_ % 2 == 0 else (True, False):
            switch(on)
            for kind, layers in kinds.items():
                x = torch.randn(1, layers[0].in_features)  # [1, in]
                began = time.perf_counter()
                for layer in layers:
                    layer(x)
                seconds.setdefault((kind, on), []).append(time.perf_counter() - began)
    return {key: statistics.median(values) for key, values in seconds.items()}


def step_seconds(runner, on: bool, rounds: int, context: int = 300, switch=None) -> float:
    """The median whole decode step (one token after `context` cached ones, the head's logits) with the switch (default
    prefetching for few rows) `on`."""
    (switch or kquant_kernels().set_prefetch_few_rows)(on)
    cache = runner.new_cache(context + 2)
    runner.forward(cache, torch.arange(100, 100 + context), logits="none")
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        runner.forward(cache, torch.tensor([7]), logits="last")
        times.append(time.perf_counter() - began)
        cache.truncate(context)
    cache.release()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", default="avx512,avx2", help="vector codes to time the layers with (those built here)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--questions", default="question.jsonl")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--generate-rounds", type=int, default=2)
    args = parser.parse_args()
    engine = load(draft="none", dtype="kquant")
    runner, kernels = engine.target.runner, kquant_kernels()
    default, kept = kernels.kernels_in_use(), kernels.prefetch_few_rows()
    print(f"{cpu_summary()} · {torch.get_num_threads()} threads · kept by settle_prefetch: {'on' if kept else 'off'}", flush=True)
    ratios = {}
    for name in args.kernels.split(","):
        if name not in kernels.kernels_built():
            print(f"  {name}: not built here")
            continue
        kernels.use_kernels(name)
        seconds = layer_seconds(runner, args.rounds)
        totals = {on: sum(value for (_, o), value in seconds.items() if o == on) for on in (False, True)}
        ratios[name] = totals[True] / totals[False]
        kinds = dict.fromkeys(kind for kind, _ in seconds)
        per_kind = ", ".join(f"{kind} ×{seconds[kind, True] / seconds[kind, False]:.3f}" for kind in kinds)
        print(f"  {name} layers, on / off: {totals[True] * 1e3:.2f} / {totals[False] * 1e3:.2f} ms (×{ratios[name]:.3f}; {per_kind})")
    kernels.use_kernels(default)
    if default not in ratios:
        return
    layers_off = sum(value for (_, on), value in layer_seconds(runner, 3).items() if not on)
    step_off = step_seconds(runner, False, args.rounds)
    share = min(layers_off / step_off, 1.0)
    predicted = 1.0 / (1.0 - share * (1.0 - ratios[default]))
    print(f"  a decode step ({default}, off): {step_off * 1e3:.2f} ms, its layers {share:.0%} of it: predicted ×{predicted:.3f} tok/s with it")
    questions = [json.loads(line) for line in open(args.questions)]
    prompts = [next(q["turns"][0] for q in questions if q["category"] == c) for c in dict.fromkeys(q["category"] for q in questions)]
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    rates: dict[bool, list[float]] = {False: [], True: []}
    tokens: dict[bool, list[list[int]]] = {False: [], True: []}
    for round_ in range(args.generate_rounds):
        for i, prompt in enumerate(prompts):
            for on in (False, True) if (round_ + i) % 2 == 0 else (True, False):
                kernels.set_prefetch_few_rows(on)
                result = engine.generate(prompt, config)
                rates[on].append(result.stats.new_tokens / (result.stats.wall_seconds - result.stats.prefill_seconds))
                tokens[on].append(result.token_ids)
    kernels.set_prefetch_few_rows(kept)
    ratio = statistics.mean(rates[True]) / statistics.mean(rates[False])
    print(f"  plain decoding, {len(prompts)} prompts × {args.generate_rounds}: {statistics.mean(rates[False]):.2f} → "
          f"{statistics.mean(rates[True]):.2f} tok/s after the prefill (×{ratio:.3f} measured, ×{predicted:.3f} predicted), "
          f"same tokens: {tokens[True] == tokens[False]}")


if __name__ == "__main__":
    main()
