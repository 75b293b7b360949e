"""A prompt's prefill on kquant with each tile kernel built here: seconds, and whether they agree to the bit.

On an AMX CPU the `amx` kernels take 16 rows and 64 weights per tile instruction from 9 rows on (a prefill,
wide verification); below that they run the AVX-512 code. The probe loads the shipped target as kquant, then
prefills random prompts of each --lengths size with every kernel in turns (`--rounds` rounds, best of each),
and checks that the next token's logits after each prefill are the same bits whichever kernel prefilled.
With --pieces it times instead the default kernels feeding a prompt in pieces of each size (`_prefill_piece`).

    python benchmarks/probes/kquant_prefill.py [--lengths 64,256,1024] [--rounds 3] [--pieces 256,128]
"""

from __future__ import annotations

import argparse
import time

import torch

from verispec.models.kquant import kquant_kernels
from verispec.models.loading import load_model
from verispec.models.transformer import Transformer
from verispec.models.registry import DEFAULT_TARGET
from verispec.paths import cpu_summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="64,256,1024", help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pieces", default=None, help="piece sizes to time with the default kernels, comma-separated")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    print(f"{cpu_summary()}, {torch.get_num_threads()} threads, best of {args.rounds} rounds")
    model = load_model(DEFAULT_TARGET, "kquant")
    kernels = kquant_kernels()
    default_piece = Transformer._prefill_piece
    if args.pieces:  # name -> what to run the prefill with
        variants = {f"pieces of {p}": lambda p=int(p): setattr(Transformer, "_prefill_piece", lambda self: p)
                    for p in args.pieces.split(",")}
    else:
        variants = {name: lambda name=name: kernels.use_kernels(name) for name in kernels.kernels_built() if name != "portable"}
    names = list(variants)
    prompt = torch.randint(100, 20_000, (max(lengths),), generator=torch.Generator().manual_seed(0)).tolist()
    try:
        for n in lengths:
            best, logits = dict.fromkeys(names, float("inf")), {}
            for _ in range(args.rounds):
                for name in names:
                    variants[name]()
                    began = time.perf_counter()
                    cache = model.runner.prefilled_cache(prompt[:n])
                    best[name] = min(best[name], time.perf_counter() - began)
                    logits[name] = model.runner.forward(cache, torch.tensor([5]))  # [1, vocab]
            same = all(torch.equal(logits[name], logits[names[0]]) for name in names)
            timings = ", ".join(f"{name} {best[name]:.3f} s ({best[name] / n * 1e3:.2f} ms a token, "
                                f"×{best[name] / best[names[0]]:.2f})" for name in names)
            print(f"{n:5d} tokens: {timings}; next logits the same bits: {same}", flush=True)
    finally:
        kernels.use_kernels(kernels.kernels_built()[0])
        Transformer._prefill_piece = default_piece


if __name__ == "__main__":
    main()
