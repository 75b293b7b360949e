"""One sampled token over a large vocabulary: `samplers.multinomial` (inverse transform, `inverse_cdf`) against
`torch.multinomial`, per call of 1 and 8 rows, in turns; a sampled step draws one per request (plain decoding) or
more (a draft's own tokens, a residual, a bonus).

    .venv/bin/python benchmarks/probes/sampler_speed.py --vocab 151936 --repeats 200
"""

from __future__ import annotations

import argparse
import time

import torch

from verispec.paths import cpu_summary
from verispec.sampling.samplers import multinomial


def mean_ms(draw, repeats: int) -> float:
    """The mean of `repeats` calls after one untimed, in ms."""
    draw()
    started = time.perf_counter()
    for _ in range(repeats):
        draw()
    return (time.perf_counter() - started) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151_936, help="Qwen2.5's vocabulary")
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    print(f"{cpu_summary()} · {torch.get_num_threads()} threads · vocabulary {args.vocab}")
    g = torch.Generator().manual_seed(0)
    for rows in map(int, args.rows.split(",")):
        probs = torch.softmax(torch.randn(rows, args.vocab, generator=g) * 3, -1)  # [rows, vocab]
        ours = torch_ms = 0.0
        for _ in range(2):  # in turns
            torch_ms = mean_ms(lambda: torch.multinomial(probs, 1, generator=g), args.repeats // rows)
            ours = mean_ms(lambda: multinomial(probs, g), args.repeats // rows)
        print(f"{rows} rows: torch.multinomial {torch_ms:.3f} ms, samplers.multinomial {ours:.3f} ms (×{ours / torch_ms:.3f})")


if __name__ == "__main__":
    main()
