"""Does plain decoding on verispec's gguf backend give llama.cpp's own tokens, and at what speed?

For each prompt (the chat template applied), greedy decoding of the same GGUF by verispec
(`Engine(target, None)`, precision gguf) and by llama-cpp-python's own loop (`verispec bench`'s llama-cpp-fresh:
`Llama.generate` from an empty cache per prompt, flash attention as llama.cpp's CPU default), interleaved: identical tokens or the
first position where they differ, then tok/s of both and their ratio. With --profile: each loop's time
outside `llama_decode` per token (the C call timed where each loop makes it, 3 alternating rounds), one
verispec generation under cProfile, and what one greedy argmax over a vocabulary row costs in torch and in
numpy (`sampling.samplers.argmax` takes numpy's).

    .venv/bin/python benchmarks/probes/llama_cpp_parity.py [--target NAME] [--max-new-tokens 64] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np
import torch

from verispec import Engine, GenerationConfig
from verispec.models.loading import load_model
from verispec.models.registry import DEFAULT_TARGET
from verispec.paths import cpu_summary
from verispec.tools.bench.compare import LLAMA_CPP_FRESH, LlamaCppMethod

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Translate to French: The weather is lovely today and we are going to the beach.",
    "Summarize in one sentence: The Industrial Revolution began in Britain in the late 18th century and spread to "
    "Europe and North America, transforming economies from agrarian to industrial.",
    "What is the capital of Australia, and why was it chosen?",
    "If a train travels 120 km in 1.5 hours, what is its average speed? Explain step by step.",
    "Context: The Eiffel Tower was completed in 1889 for the World's Fair. Question: When was the Eiffel Tower completed?",
]


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


class DecodeTimer:
    """Seconds spent inside `module.llama_decode` while installed (the C call each loop makes)."""

    def __init__(self, module):
        self.module, self.decode, self.seconds = module, module.llama_decode, 0.0

    def __enter__(self):
        def timed_decode(ctx, batch):
            start = time.perf_counter()
            status = self.decode(ctx, batch)
            self.seconds += time.perf_counter() - start
            return status
        self.module.llama_decode = timed_decode
        return self

    def __exit__(self, *exc):
        self.module.llama_decode = self.decode


def outside_decode(engine: Engine, own_loop: LlamaCppMethod, ids: list[int], max_new: int, rounds: int = 3) -> None:
    """ms per token each loop spends outside llama_decode on the same prompt, rounds alternating."""
    from llama_cpp import _internals

    ours, theirs = [], []
    for _ in range(rounds):
        with DecodeTimer(engine.target.runner.llama_cpp) as timer:
            (out, seconds) = timed(lambda: engine.generate(ids, GenerationConfig(max_new_tokens=max_new)).token_ids)
        ours.append((seconds - timer.seconds) / len(out) * 1000)
        with DecodeTimer(_internals.llama_cpp) as timer:
            (out, seconds) = timed(lambda: own_loop.generate(ids, max_new, seed=0).token_ids)
        theirs.append((seconds - timer.seconds) / len(out) * 1000)
    print(f"outside llama_decode, ms a token (best of {rounds}): verispec {min(ours):.2f}, llama-cpp-python {min(theirs):.2f}")


def profile(engine: Engine, ids: list[int], max_new: int) -> None:
    """Seconds inside llama_decode against the rest of one generation, the rest under cProfile."""
    profiler = cProfile.Profile()
    with DecodeTimer(engine.target.runner.llama_cpp) as timer:
        profiler.enable()
        result, seconds = timed(lambda: engine.generate(ids, GenerationConfig(max_new_tokens=max_new)))
        profiler.disable()
    n, rest = len(result.token_ids), seconds - timer.seconds
    print(f"{n} tokens in {seconds:.2f} s: llama_decode {timer.seconds:.2f} s, the rest {rest:.3f} s "
          f"= {rest / n * 1000:.2f} ms per token (under cProfile)")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(10)


def argmax_costs(vocab: int, repeats: int = 2000) -> None:
    """µs of one argmax over a float32 row [1, vocab]: torch's and numpy's."""
    row = torch.randn(1, vocab)
    for name, argmax in (("torch", lambda: row.argmax(-1)), ("numpy", lambda: np.argmax(row.numpy(), axis=-1))):
        argmax()
        start = time.perf_counter()
        for _ in range(repeats):
            argmax()
        print(f"argmax over {vocab} logits, {name}: {(time.perf_counter() - start) / repeats * 1e6:.0f} µs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1, help="times through the prompts")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    print(cpu_summary())
    target = load_model(args.target, "gguf")
    engine = Engine(target, None)
    own_loop = LlamaCppMethod.load(LLAMA_CPP_FRESH, target.runner.path, target.eos_ids, 0.0)  # an empty cache per prompt
    same, ours_rate, theirs_rate = 0, [], []
    for i, prompt in enumerate(PROMPTS * args.rounds):
        ids = engine.prompt_ids(prompt)
        run_ours = lambda: timed(lambda: engine.generate(ids, GenerationConfig(max_new_tokens=args.max_new_tokens)).token_ids)
        run_theirs = lambda: timed(lambda: own_loop.generate(ids, args.max_new_tokens, seed=0).token_ids)
        if i % 2:  # each goes first on every other prompt
            (theirs, theirs_s), (ours, ours_s) = run_theirs(), run_ours()
        else:
            (ours, ours_s), (theirs, theirs_s) = run_ours(), run_theirs()
        differ = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        same += list(ours) == theirs
        ours_rate.append(len(ours) / ours_s)
        theirs_rate.append(len(theirs) / theirs_s)
        print(f"{'same' if list(ours) == theirs else f'differs at {differ}'}: {len(ours)}/{len(theirs)} tokens, "
              f"{ours_rate[-1]:.2f} / {theirs_rate[-1]:.2f} tok/s · {prompt[:40]!r}")
    print(f"{same}/{len(PROMPTS) * args.rounds} identical; verispec {sum(ours_rate) / len(ours_rate):.2f} tok/s, llama.cpp "
          f"{sum(theirs_rate) / len(theirs_rate):.2f} tok/s (× {sum(ours_rate) / sum(theirs_rate):.3f})")
    if args.profile:
        outside_decode(engine, own_loop, engine.prompt_ids(PROMPTS[3]), 128)
        profile(engine, engine.prompt_ids(PROMPTS[0]), 128)
        argmax_costs(target.vocab_size)


if __name__ == "__main__":
    main()
