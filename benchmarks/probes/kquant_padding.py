"""A padded draft's layers read whole or with their padding skipped (`set_skip_padding`), in turns.

A requantized draft (SmolLM2-135M: 576 inputs padded to 768; the Qwen 0.5B: 896 to 1,024) may skip the sub-blocks
past its input, fewer bytes but a hole in the weight stream at every tile, or read them too (`models/kquant.
settle_padding` keeps what its quick timing finds faster here). In one process, with the default plan's engine
(`load()`: kquant and hybrid with SmolLM2): the draft's linear layers by kind (one row through every layer of a kind)
for each vector code built here (`--kernels`), `--rounds` rounds, skipping and reading whole alternating; the draft's
whole decode step both ways; then greedy decoding with the plan's drafter of public prompts (the first of each group
of `--questions`), both ways in turns: tok/s after the prefill, whether the tokens are the same, and the speedup the
draft step's ratio predicts from the draft's share of a step's time (`GenerationStats.phases`).

    python benchmarks/probes/kquant_padding.py [--kernels avx512,avx2] [--rounds 12] [--generate-rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from kquant_prefetch import layer_seconds, step_seconds

from verispec import GenerationConfig, load
from verispec.models.kquant import kquant_kernels
from verispec.paths import cpu_summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", default="avx512,avx2", help="vector codes to time the layers with (those built here)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--questions", default="question.jsonl")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--generate-rounds", type=int, default=2)
    args = parser.parse_args()
    engine = load()
    draft = engine.drafter.model.runner  # the plan's hybrid drafter's model
    kernels = kquant_kernels()
    read_whole = lambda on: not kernels.set_skip_padding(not on)  # noqa: E731 - the switch: on reads padded layers whole
    default, kept = kernels.kernels_in_use(), kernels.skip_padding()
    print(f"{cpu_summary()} · {torch.get_num_threads()} threads · plan {engine.drafter_spec} · kept by settle_padding: "
          f"{'skipping' if kept else 'reading whole'}", flush=True)
    ratios = {}
    for name in args.kernels.split(","):
        if name not in kernels.kernels_built():
            print(f"  {name}: not built here")
            continue
        kernels.use_kernels(name)
        seconds = layer_seconds(draft, args.rounds, read_whole)
        totals = {on: sum(value for (_, o), value in seconds.items() if o == on) for on in (False, True)}
        ratios[name] = totals[True] / totals[False]
        kinds = dict.fromkeys(kind for kind, _ in seconds)
        per_kind = ", ".join(f"{kind} ×{seconds[kind, True] / seconds[kind, False]:.3f}" for kind in kinds)
        print(f"  {name} draft layers, whole / skipping: {totals[True] * 1e3:.2f} / {totals[False] * 1e3:.2f} ms "
              f"(×{ratios[name]:.3f}; {per_kind})")
    kernels.use_kernels(default)
    steps = {on: [] for on in (False, True)}
    for round_ in range(args.rounds):
        for on in (False, True) if round_ % 2 == 0 else (True, False):
            steps[on].append(step_seconds(draft, on, 5, switch=read_whole))
    step = {on: statistics.median(values) for on, values in steps.items()}
    step_ratio = step[True] / step[False]
    print(f"  the draft's decode step ({default}): whole / skipping {step[True] * 1e3:.2f} / {step[False] * 1e3:.2f} ms (×{step_ratio:.3f})")
    questions = [json.loads(line) for line in open(args.questions)]
    prompts = [next(q["turns"][0] for q in questions if q["category"] == c) for c in dict.fromkeys(q["category"] for q in questions)]
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    rates: dict[bool, list[float]] = {False: [], True: []}
    tokens: dict[bool, list[list[int]]] = {False: [], True: []}
    draft_share: list[float] = []  # the draft's share of the decoding time, skipping
    for round_ in range(args.generate_rounds):
        for i, prompt in enumerate(prompts):
            for on in (False, True) if (round_ + i) % 2 == 0 else (True, False):
                read_whole(on)
                result = engine.generate(prompt, config)
                decoding = result.stats.wall_seconds - result.stats.prefill_seconds
                rates[on].append(result.stats.new_tokens / decoding)
                tokens[on].append(result.token_ids)
                if not on:
                    draft_share.append(result.stats.phases.get("draft", 0.0) / decoding)
    read_whole(not kept)
    share = statistics.mean(draft_share)
    predicted = 1.0 / (1.0 - share * (1.0 - step_ratio))
    ratio = statistics.mean(rates[True]) / statistics.mean(rates[False])
    print(f"  decoding, {len(prompts)} prompts × {args.generate_rounds} (the draft {share:.0%} of it): "
          f"{statistics.mean(rates[False]):.2f} → {statistics.mean(rates[True]):.2f} tok/s after the prefill "
          f"(×{ratio:.3f} measured, ×{predicted:.3f} predicted), same tokens: {tokens[True] == tokens[False]}")


if __name__ == "__main__":
    main()
