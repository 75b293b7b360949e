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

import torch
from kernel_switch import arguments, decode_in_turns, layer_seconds, report_decoding, step_seconds, time_codes

from verispec import load
from verispec.models.kquant import kquant_kernels
from verispec.paths import cpu_summary


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    engine = load(draft="none", dtype="kquant")
    runner, kernels = engine.target.runner, kquant_kernels()
    switch = kernels.set_prefetch_few_rows
    default, kept = kernels.kernels_in_use(), kernels.prefetch_few_rows()
    print(f"{cpu_summary()} · {torch.get_num_threads()} threads · kept by settle_prefetch: {'on' if kept else 'off'}", flush=True)
    ratios = time_codes(runner, args.kernels, args.rounds, switch, "layers, on / off")
    if default not in ratios:
        return
    layers_off = sum(value for (_, on), value in layer_seconds(runner, 3, switch).items() if not on)
    step_off = step_seconds(runner, False, args.rounds, switch)
    share = min(layers_off / step_off, 1.0)
    predicted = 1.0 / (1.0 - share * (1.0 - ratios[default]))
    print(f"  a decode step ({default}, off): {step_off * 1e3:.2f} ms, its layers {share:.0%} of it: predicted ×{predicted:.3f} tok/s with it")
    rates, same, prompts, _ = decode_in_turns(engine, args, switch)
    switch(kept)
    report_decoding("plain decoding", rates, same, prompts, args, predicted)


if __name__ == "__main__":
    main()
