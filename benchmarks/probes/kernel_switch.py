"""What the probes of a kquant kernel switch share (`kquant_prefetch.py`, `kquant_padding.py`): a switch is a
function `switch(on)` that sets it; each timing runs the switch on and off in turns, so a shared CPU's drift
touches both alike.

- `arguments`: the probes' command line;
- `layer_seconds`, `time_codes`: a runner's linear layers by kind, for each vector code built here;
- `step_seconds`: a runner's whole decode step;
- `decode_in_turns`, `report_decoding`: greedy decoding of public prompts (the first of each group of a question file),
  measured against predicted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from verispec import GenerationConfig
from verispec.models.kquant import kquant_kernels


def arguments(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--kernels", default="avx512,avx2", help="vector codes to time the layers with (those built here)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--questions", default="question.jsonl")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--generate-rounds", type=int, default=2)
    return parser.parse_args()


def layer_seconds(runner, rounds: int, switch) -> dict[tuple[str, bool], float]:
    """(kind, setting) -> median seconds of one row through every layer of the kind (`head`: the output head)."""
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


def time_codes(runner, codes: str, rounds: int, switch, label: str) -> dict[str, float]:
    """For each vector code in `codes` (comma-separated) built here: the layers by kind on / off, printed; returns
    code -> all layers' seconds on over off. The fastest code runs again after."""
    kernels = kquant_kernels()
    default, ratios = kernels.kernels_in_use(), {}
    for name in codes.split(","):
        if name not in kernels.kernels_built():
            print(f"  {name}: not built here")
            continue
        kernels.use_kernels(name)
        seconds = layer_seconds(runner, rounds, switch)
        totals = {on: sum(value for (_, o), value in seconds.items() if o == on) for on in (False, True)}
        ratios[name] = totals[True] / totals[False]
        kinds = dict.fromkeys(kind for kind, _ in seconds)
        per_kind = ", ".join(f"{kind} ×{seconds[kind, True] / seconds[kind, False]:.3f}" for kind in kinds)
        print(f"  {name} {label}: {totals[True] * 1e3:.2f} / {totals[False] * 1e3:.2f} ms (×{ratios[name]:.3f}; {per_kind})",
              flush=True)
    kernels.use_kernels(default)
    return ratios


def step_seconds(runner, on: bool, rounds: int, switch, context: int = 300) -> float:
    """The median whole decode step (one token after `context` cached ones, the head's logits) with the switch `on`."""
    switch(on)
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


def decode_in_turns(engine, args: argparse.Namespace, switch):
    """Greedy decoding of the first prompt of each group of `args.questions`, `args.generate_rounds` times, the switch
    on and off in turns: (setting -> tok/s after the prefill of each run, whether both settings gave the same tokens,
    the prompts, off-runs' results)."""
    questions = [json.loads(line) for line in open(args.questions)]
    prompts = [next(q["turns"][0] for q in questions if q["category"] == c) for c in dict.fromkeys(q["category"] for q in questions)]
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    rates: dict[bool, list[float]] = {False: [], True: []}
    tokens: dict[bool, list[list[int]]] = {False: [], True: []}
    off_results = []
    for round_ in range(args.generate_rounds):
        for i, prompt in enumerate(prompts):
            for on in (False, True) if (round_ + i) % 2 == 0 else (True, False):
                switch(on)
                result = engine.generate(prompt, config)
                rates[on].append(result.stats.new_tokens / (result.stats.wall_seconds - result.stats.prefill_seconds))
                tokens[on].append(result.token_ids)
                if not on:
                    off_results.append(result)
    return rates, tokens[True] == tokens[False], prompts, off_results


def report_decoding(label: str, rates: dict[bool, list[float]], same: bool, prompts: list[str], args: argparse.Namespace,
                    predicted: float) -> None:
    """One line: tok/s off → on, their ratio against `predicted`, and whether the tokens were the same."""
    off, on = statistics.mean(rates[False]), statistics.mean(rates[True])
    print(f"  {label}, {len(prompts)} prompts × {args.generate_rounds}: {off:.2f} → {on:.2f} tok/s after the prefill "
          f"(×{on / off:.3f} measured, ×{predicted:.3f} predicted), same tokens: {same}")
