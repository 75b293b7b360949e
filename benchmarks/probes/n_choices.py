"""How long a server takes to answer one chat request for `n` sampled choices (each a request of its own in the
continuous batch), on the shipped target in kquant with prompt lookup, the server in this process.

Each round sends a new prompt (a nonce first, so neither the in-memory nor the disk prompt cache holds it) and
prints the seconds, the prompt and completion tokens and the prefill turns the scheduler spent. To compare two
versions of the code, run it once with each on PYTHONPATH:

    .venv/bin/python benchmarks/probes/n_choices.py [--n 4] [--max-tokens 16] [--rounds 3]
    PYTHONPATH=<other checkout>/src .venv/bin/python benchmarks/probes/n_choices.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # LocalServer: uvicorn on a free port in a thread

from server_helpers import LocalServer  # noqa: E402

from verispec import load  # noqa: E402
from verispec.paths import cpu_summary  # noqa: E402
from verispec.serving.http import create_app  # noqa: E402

TEXT = (ROOT / "src/verispec/engine/prefixes.py").read_text()[:1200]  # ~300 tokens to summarize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(cpu_summary())
    engine = load("qwen2.5-coder-1.5b-instruct", draft="ngram", dtype="kquant")
    app = create_app(engine, model_name="q", max_batch=max(8, args.n))
    seconds = []
    with LocalServer(app) as server:
        for round_ in range(args.rounds):
            turns = len(app.state.scheduler.turns)
            body = {"model": "q", "messages": [{"role": "user", "content": f"({time.time_ns()}) Summarize this:\n{TEXT}"}],
                    "n": args.n, "max_tokens": args.max_tokens, "temperature": 0.8, "seed": round_}
            began = time.perf_counter()
            usage = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=3600).json()["usage"]
            seconds.append(time.perf_counter() - began)
            prefill_turns = sum(1 for turn in list(app.state.scheduler.turns)[turns:] if turn.prefilled)
            print(f"round {round_}: {seconds[-1]:.2f} s, prompt {usage['prompt_tokens']} tokens, "
                  f"{usage['completion_tokens']} new tokens, {prefill_turns} prefill turns", flush=True)
    print(f"median {statistics.median(seconds):.2f} s over {args.rounds} rounds (n = {args.n})")


if __name__ == "__main__":
    main()
