"""Could llama.cpp itself be verispec's verifier on this CPU? Cost and exactness of a multi-token pass.

After a prompt, one `llama_decode` over M draft positions (logits for all of them, as verification
needs) is timed for M = 1..16, interleaved and rolled back each time; then the logits of 8
positions from one 8-token pass are compared with those of decoding the same 8 tokens one at a time.
A verifier must be near-flat in M to pay and must give the same logits either way to stay lossless.

    scripts/setup.sh   # builds llama-cpp-python for this CPU
    python benchmarks/probes/llama_cpp_verify_probe.py [--model qwen2.5-coder-1.5b-instruct] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from verispec.models.registry import DEFAULT_TARGET, gguf_path, shipped_model

PROMPT = b"Write a Python function that parses a CSV file and returns a list of dictionaries, one per row. " * 4
DRAFT = b" def parse_csv(path):\n    import csv\n    with open(path) as f:\n        return list(csv.DictReader(f))\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(gguf_path(shipped_model(args.model))), n_ctx=2048, n_threads=args.threads,
                          n_threads_batch=args.threads, logits_all=True, verbose=False)
    prompt, draft = llm.tokenize(PROMPT), llm.tokenize(DRAFT, add_bos=False)
    llm.eval(prompt)
    start = llm.n_tokens

    def verify(tokens: list[int]) -> float:
        llm.n_tokens = start  # roll back: eval() drops the cache past n_tokens
        began = time.perf_counter()
        llm.eval(tokens)
        return time.perf_counter() - began

    sizes = [1, 2, 3, 4, 6, 8, 12, 16]
    times: dict[int, list[float]] = {m: [] for m in sizes}
    for _ in range(args.repeats):
        for m in sizes:
            times[m].append(verify(draft[:m]))
    one = statistics.median(times[1])
    for m in sizes:
        print(f"{m:>2} positions: {statistics.median(times[m]) * 1e3:7.1f} ms  ({statistics.median(times[m]) / one:.2f}× one)")
    verify(draft[:8])
    together = np.array(llm.scores[start : start + 8])  # [8, vocab]
    alone = []
    for i in range(8):
        llm.n_tokens = start + i
        llm.eval(draft[i : i + 1])
        alone.append(np.array(llm.scores[start + i]))
    difference = np.abs(together - np.stack(alone)).max(axis=1)
    print("max |logit difference| per position, one 8-token pass vs one token at a time:",
          " ".join(f"{d:.3g}" for d in difference))


if __name__ == "__main__":
    main()
