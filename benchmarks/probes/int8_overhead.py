"""Where an int8 decode step goes, and what the C++ kernels save (issue #8), side by side in one process.

For the shipped int8 target and draft, one forward over 1, 2 and 4 new positions after --context
cached tokens is timed in four ways, interleaved in rotating order (median of --rounds):

  compiled     the default: the decoder stack in one C++ call (`Int8Layers`, kernels/int8.cpp)
  python       the Python loop (`Transformer._layers`), int8 layers' elementwise work in C++
  torch        the Python loop with no extension at all (the plain torch code)
  no-matmul    the Python loop with fbgemm's matmuls replaced by a ready tensor: the rest of the step

The first three must give the same logits (checked). Then --prompt-tokens tokens of prefill, int8
against llama.cpp's plain decoding of the same GGUF when llama-cpp-python is installed.

    python benchmarks/probes/int8_overhead.py [--rounds 10] [--context 199] [--prompt-tokens 190]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from contextlib import contextmanager

import torch

from verispec.models import int8
from verispec.models.kernels import extension
from verispec.models.loading import load_model
from verispec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET, gguf_path, shipped_model
from verispec.models.transformer import Transformer


@contextmanager
def way(name: str):
    """Run the block as `name` (see the module docstring), then restore the default."""
    compiled, fused, matmul = Transformer._compiled_layers, int8.extension, int8.Int8Linear._integer_matmul
    if name != "compiled":
        Transformer._compiled_layers = lambda self: None
    if name == "torch":
        int8.extension = lambda name: None
    if name == "no-matmul":
        ready: dict[tuple[int, int], torch.Tensor] = {}
        int8.Int8Linear._integer_matmul = lambda self, q: ready.setdefault((q.shape[0], self.out_features),
                                                                          torch.zeros(q.shape[0], self.out_features))
    try:
        yield
    finally:
        Transformer._compiled_layers, int8.extension, int8.Int8Linear._integer_matmul = compiled, fused, matmul


def steps(runner: Transformer, context: int, rounds: int) -> None:
    cache = runner.new_cache(context + 8)
    runner.forward(cache, torch.arange(1000, 1000 + context), logits="none")
    ways = ["compiled", "python", "torch", "no-matmul"]
    for n in (1, 2, 4):
        feed = torch.arange(2000, 2000 + n)
        logits, times = {}, {name: [] for name in ways}
        for _ in range(rounds):
            for name in ways:
                with way(name):
                    start = time.perf_counter()
                    logits[name] = runner.forward(cache, feed)
                    times[name].append(time.perf_counter() - start)
                cache.truncate(context)
        same = all(torch.equal(logits["compiled"], logits[name]) for name in ("python", "torch"))
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(f"  {n} positions: " + "  ".join(f"{name} {ms[name]:6.1f} ms" for name in ways)
              + f"  | python/compiled {ms['python'] / ms['compiled']:.2f}×  torch/compiled {ms['torch'] / ms['compiled']:.2f}×"
              + f"  | same logits: {same}")


def prefill(runner: Transformer, tokens: int, rounds: int) -> None:
    ids = list(range(1000, 1000 + tokens))
    times: dict[str, list[float]] = {"verispec int8": []}
    llm = None
    if importlib.util.find_spec("llama_cpp"):
        import llama_cpp

        llm = llama_cpp.Llama(model_path=str(gguf_path(shipped_model(DEFAULT_TARGET))), n_ctx=tokens + 16,
                              n_threads=torch.get_num_threads(), n_threads_batch=torch.get_num_threads(), verbose=False)
        times["llama.cpp"] = []
    for _ in range(rounds):
        start = time.perf_counter()
        runner.prefilled_cache(ids + [0])
        times["verispec int8"].append(time.perf_counter() - start)
        if llm is not None:
            llm.reset()
            start = time.perf_counter()
            llm.eval(ids)
            times["llama.cpp"].append(time.perf_counter() - start)
    for name, t in times.items():
        print(f"  prefill of {tokens} tokens, {name}: {statistics.median(t):.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--context", type=int, default=199)
    parser.add_argument("--prompt-tokens", type=int, default=190)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if extension("int8") is None:
        raise SystemExit("the int8 extension did not build: nothing to compare")
    for name in (DEFAULT_TARGET, DEFAULT_DRAFT):
        print(f"{name} (int8), one forward after {args.context} cached tokens, median of {args.rounds}:")
        steps(load_model(name, "int8").runner, args.context, args.rounds)
    print(f"{DEFAULT_TARGET}, median of 3:")
    prefill(load_model(DEFAULT_TARGET, "int8").runner, args.prompt_tokens, 3)


if __name__ == "__main__":
    main()
