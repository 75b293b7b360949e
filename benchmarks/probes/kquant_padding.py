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

import statistics

import torch
from kernel_switch import arguments, decode_in_turns, report_decoding, step_seconds, time_codes

from verispec import load
from verispec.models.kquant import kquant_kernels, read_padding_whole
from verispec.paths import cpu_summary


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    engine = load()
    if getattr(engine.drafter, "model", None) is None:
        raise SystemExit(f"the plan here drafts with {engine.drafter_spec!r}, no draft model: nothing padded to time")
    draft = engine.drafter.model.runner  # the plan's drafter's model (hybrid's SmolLM2)
    kernels, read_whole = kquant_kernels(), read_padding_whole  # the switch: on reads padded layers whole
    default, kept = kernels.kernels_in_use(), kernels.skip_padding()
    print(f"{cpu_summary()} · {torch.get_num_threads()} threads · plan {engine.drafter_spec} · kept by settle_padding: "
          f"{'skipping' if kept else 'reading whole'}", flush=True)
    time_codes(draft, args.kernels, args.rounds, read_whole, "draft layers, whole / skipping")
    steps = {on: [] for on in (False, True)}
    for round_ in range(args.rounds):
        for on in (False, True) if round_ % 2 == 0 else (True, False):
            steps[on].append(step_seconds(draft, on, 5, read_whole))
    step = {on: statistics.median(values) for on, values in steps.items()}
    step_ratio = step[True] / step[False]
    print(f"  the draft's decode step ({default}): whole / skipping {step[True] * 1e3:.2f} / {step[False] * 1e3:.2f} ms (×{step_ratio:.3f})")
    rates, same, prompts, skipping = decode_in_turns(engine, args, read_whole)
    read_whole(not kept)
    share = statistics.mean(r.stats.phases.get("draft", 0.0) / (r.stats.wall_seconds - r.stats.prefill_seconds) for r in skipping)
    predicted = 1.0 / (1.0 - share * (1.0 - step_ratio))
    report_decoding(f"decoding (the draft {share:.0%} of it)", rates, same, prompts, args, predicted)


if __name__ == "__main__":
    main()
