"""What the plan's backend timing rests on (the shipped target, gguf and kquant both loaded):

1. kquant's T(n) after 1,024 placeholder slots (`Runner.placeholder_cache`) against after a real 1,024-token
   prefill, interleaved: the cost curves are timed after placeholders, so the two must agree within noise;
2. gguf/kquant T(1) timed in turns (`interleaved_token_seconds`) against one backend after the other, six pairs;
3. both backends' prefill seconds a prompt token in 64- and 256-token chunks (`measure_prefill`).

    .venv/bin/python benchmarks/probes/backend_timing.py      # from the repository root (BENCHMARKS.md, "AVX2: start-up")
"""

import time

import torch

from verispec.control.costs import interleaved_token_seconds, measure_prefill
from verispec.models.loading import load_model
from verispec.paths import cpu_summary

TARGET, CONTEXT = "qwen2.5-coder-1.5b-instruct", 1024


def best_forward(runner, cache, positions: int, repeats: int = 3) -> float:
    kept, best = cache.length, float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        runner.forward(cache, torch.zeros(positions, dtype=torch.long), logits="all")
        best = min(best, time.perf_counter() - start)
        cache.truncate(kept)
    return best


def main() -> None:
    print(cpu_summary(), f"· {torch.get_num_threads()} threads")
    gguf, kquant = (load_model(TARGET, dtype).runner for dtype in ("gguf", "kquant"))
    real = kquant.new_cache(CONTEXT + 16)
    kquant.forward(real, torch.randint(0, 1000, (CONTEXT,)), logits="none")
    placeholder = kquant.placeholder_cache(CONTEXT, CONTEXT + 16)
    for n in (1, 2, 4, 8, 13):
        measured = best_forward(kquant, real, n), best_forward(kquant, placeholder, n)
        print(f"kquant T({n}) after {CONTEXT}: real {measured[0] * 1e3:.1f} ms, placeholder {measured[1] * 1e3:.1f} ms, "
              f"ratio {measured[1] / measured[0]:.3f}", flush=True)
    for _ in range(6):
        turns = interleaved_token_seconds([gguf, kquant])
        apart = interleaved_token_seconds([gguf])[0], interleaved_token_seconds([kquant])[0]
        print(f"gguf/kquant T(1): in turns {turns[0] / turns[1]:.3f}, one after the other {apart[0] / apart[1]:.3f}", flush=True)
    for chunk in (64, 256):
        seconds = [measure_prefill(runner, chunk) / chunk for runner in (gguf, kquant)]
        print(f"prefill in {chunk}-token chunks: gguf {seconds[0] * 1e3:.2f}, kquant {seconds[1] * 1e3:.2f} ms a token, "
              f"gguf/kquant {seconds[0] / seconds[1]:.2f}", flush=True)


if __name__ == "__main__":
    main()
