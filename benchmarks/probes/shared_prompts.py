"""How long a server takes to answer requests that share their prompt's beginning, on the shipped target in kquant
with prompt lookup, the server in this process: one chat request for `n` sampled choices (each a request of its own
in the continuous batch: `--mode choices`), or `n` chat requests at once over one document, each with its own
question (`--mode document`).

Each round uses a new document (a nonce first, so neither the in-memory nor the disk prompt cache holds it) and
prints the seconds until every answer is in, the prompt and completion tokens, the prefill turns the scheduler
spent and the prompt tokens it fed. To compare two versions of the code, run it once with each on PYTHONPATH:

    .venv/bin/python benchmarks/probes/shared_prompts.py [--mode choices|document] [--n 4] [--max-tokens 16] [--rounds 3]
    PYTHONPATH=<other checkout>/src .venv/bin/python benchmarks/probes/shared_prompts.py --mode document
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # LocalServer: uvicorn on a free port in a thread

from server_helpers import LocalServer  # noqa: E402

from verispec import load  # noqa: E402
from verispec.paths import cpu_summary  # noqa: E402
from verispec.serving.http import create_app  # noqa: E402

TEXTS = {"choices": (ROOT / "src/verispec/models/prefixes.py").read_text()[:1200],  # ~300 tokens to summarize
         "document": (ROOT / "src/verispec/models/prefixes.py").read_text()[:2400]}  # ~600 tokens to ask about
QUESTIONS = ["Summarize it in one sentence.", "Which constant bounds the bytes kept on disk?",
             "What does MIN_REUSE mean here?", "Why is the output the same with and without the store?",
             "Name every class it defines.", "What does save() write?", "When is nothing stored?", "What is a stamp?"]


def bodies(mode: str, n: int, round_: int) -> list[dict]:
    """The round's requests: one with n choices, or n over one document."""
    document = f"({time.time_ns()})\n{TEXTS[mode]}"
    common = {"model": "q", "temperature": 0.8, "seed": round_}
    if mode == "choices":
        return [{**common, "messages": [{"role": "user", "content": f"Summarize this:\n{document}"}], "n": n}]
    return [{**common, "messages": [{"role": "user", "content": f"{document}\n\n{QUESTIONS[i % len(QUESTIONS)]}"}]}
            for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["choices", "document"], default="choices")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(cpu_summary())
    engine = load("qwen2.5-coder-1.5b-instruct", draft="ngram", dtype="kquant")
    app = create_app(engine, model_name="q", max_batch=max(8, args.n))
    seconds = []
    with LocalServer(app) as server, ThreadPoolExecutor(args.n) as pool:
        def ask(body: dict) -> dict:
            reply = httpx.post(server.url + "/v1/chat/completions", json={**body, "max_tokens": args.max_tokens}, timeout=3600)
            return reply.raise_for_status().json()["usage"]

        for round_ in range(args.rounds):
            turns = len(app.state.scheduler.turns)
            began = time.perf_counter()
            usages = list(pool.map(ask, bodies(args.mode, args.n, round_)))
            seconds.append(time.perf_counter() - began)
            prefills = [turn.prefilled for turn in list(app.state.scheduler.turns)[turns:] if turn.prefilled]
            print(f"round {round_}: {seconds[-1]:.2f} s, prompts {[u['prompt_tokens'] for u in usages]} tokens, "
                  f"{sum(u['completion_tokens'] for u in usages)} new tokens, {len(prefills)} prefill turns feeding "
                  f"{sum(sum(p.values()) for p in prefills)} prompt tokens", flush=True)
    print(f"median {statistics.median(seconds):.2f} s over {args.rounds} rounds ({args.mode}, n = {args.n})")


if __name__ == "__main__":
    main()
