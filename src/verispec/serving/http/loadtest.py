"""A bounded load test of a running verispec server: throughput and latency per concurrency level.

    python -m verispec.serving.http.loadtest --url http://127.0.0.1:8000 --clients 1,4,16 --requests 32 [--chat]

For each client count, exactly `--requests` completions are sent (by that many concurrent clients)
and the run stops by itself. Reports requests/s, generated tokens/s, p50/p99 latency, and τ. Under
greedy decoding (the default) every response to the one prompt must be the same text, batched or not:
`garbled` counts the responses that differ from the most common one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

__all__ = ["run_level", "main"]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def run_level(url: str, model: str, clients: int, requests: int, body: dict, chat: bool = False) -> dict:
    """Send `requests` completions with `clients` concurrent workers; return the level's summary.

    chat: send body["prompt"] as one user message to /v1/chat/completions (the model's chat template)."""
    if chat:
        body = {key: value for key, value in body.items() if key != "prompt"} | {"messages": [{"role": "user", "content": body["prompt"]}]}
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    latencies, tokens, steps, failures, texts = [], 0, 0, 0, []

    async def worker(http: httpx.AsyncClient) -> None:
        nonlocal tokens, steps, failures
        while not queue.empty():
            i = queue.get_nowait()
            started = time.perf_counter()
            response = await http.post(endpoint, json={**body, "model": model, "seed": i})
            latencies.append(time.perf_counter() - started)
            if response.status_code != 200:
                failures += 1
                continue
            answer = response.json()
            choice = answer["choices"][0]
            texts.append(choice["message"]["content"] if chat else choice["text"])
            usage = answer["usage"]
            tokens += usage["completion_tokens"]
            steps += usage["steps"]

    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        await asyncio.gather(*(worker(http) for _ in range(clients)))
    seconds = time.perf_counter() - started
    garbled = len(texts) - max(texts.count(t) for t in set(texts)) if texts and body.get("temperature", 0) == 0 else 0
    return {
        "clients": clients, "requests": requests, "failures": failures, "garbled": garbled, "seconds": round(seconds, 3),
        "requests_per_second": round(requests / seconds, 3), "tokens_per_second": round(tokens / seconds, 2),
        "p50_latency_s": round(percentile(latencies, 0.5), 3), "p99_latency_s": round(percentile(latencies, 0.99), 3),
        "mean_latency_s": round(statistics.mean(latencies), 3),
        "mean_accepted_length": round(tokens / steps, 3) if steps else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verispec.serving.http.loadtest", description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--clients", default="1,4,16", help="comma-separated concurrency levels")
    parser.add_argument("--requests", type=int, default=32, help="requests per level (the run is bounded)")
    parser.add_argument("--prompt", default="Write a short story about a robot who learns to paint.")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--chat", action="store_true", help="send the prompt as a user message to /v1/chat/completions")
    parser.add_argument("--json", action="store_true", help="one JSON object per level instead of a table")
    args = parser.parse_args(argv)
    model = httpx.get(args.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"prompt": args.prompt, "max_tokens": args.max_tokens, "temperature": args.temperature}
    if not args.json:
        print(f"{'clients':>7} {'req/s':>8} {'tok/s':>8} {'p50 s':>8} {'p99 s':>8} {'τ':>6} {'failed':>6} {'garbled':>7}")
    for clients in (int(c) for c in args.clients.split(",")):
        row = asyncio.run(run_level(args.url, model, clients, args.requests, body, args.chat))
        if args.json:
            print(json.dumps(row))
        else:
            print(f"{row['clients']:>7} {row['requests_per_second']:>8.2f} {row['tokens_per_second']:>8.1f} "
                  f"{row['p50_latency_s']:>8.3f} {row['p99_latency_s']:>8.3f} {row['mean_accepted_length']:>6.2f} {row['failures']:>6} {row['garbled']:>7}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
