"""A decode step's time and T(n)/T(1) after several context lengths, for shipped models on kquant.

Each position of a verification attends the whole context, so T(n)/T(1) grows with it (the γ policy reads it at a
request's context: `control/costs.py`). Measured as the γ policy's costs are (`measure_verify_curve`: the fastest of
rounds over every width), after each `--contexts` length; prints T(1) in ms and T(n)/T(1) for each of `--widths`.
To time a kernel change, run it on the build before (`git checkout REV -- src/verispec/models/kernels`) and after,
alternately.

    python benchmarks/probes/step_costs.py --models qwen2.5-coder-1.5b-instruct --contexts 64,700,1400 --widths 2,3,5,9
"""

from __future__ import annotations

import argparse

from verispec.control.costs import measure_verify_curve
from verispec.models.loading import load_model
from verispec.paths import cpu_summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--contexts", default="64,700,1400")
    parser.add_argument("--widths", default="2,3,5,9")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    widths = [int(n) for n in args.widths.split(",")]
    print(cpu_summary())
    for name in args.models.split(","):
        runner = load_model(name, "kquant").runner
        for context in map(int, args.contexts.split(",")):
            times = measure_verify_curve(runner, max(widths), context, repeats=args.rounds)  # seconds, n = 1 … max
            ratios = " ".join(f"{n}: {times[n - 1] / times[0]:.2f}" for n in widths)
            print(f"{name} after {context} tokens: T(1) {times[0] * 1e3:.1f} ms; T(n)/T(1) {ratios}", flush=True)


if __name__ == "__main__":
    main()
