"""Load tests of a running verispec server: throughput per concurrency level, a soak, and how much a
long prompt holds up short requests.

    python -m verispec.tools.bench.loadtest --url http://127.0.0.1:8000 --clients 1,4,16 --requests 32 [--chat]
    python -m verispec.tools.bench.loadtest --mode soak --clients 16 --minutes 10 [--server-pid PID]
    python -m verispec.tools.bench.loadtest --mode interference --long-tokens 4000 --short-clients 4
    python -m verispec.tools.bench.loadtest --mode identity --rounds 20 --clients 8 [--seed 7 --temperature 1]

levels (default): for each client count, exactly `--requests` completions are sent (by that many
concurrent clients) and the run stops by itself. Reports requests/s, generated tokens/s, p50/p99
latency, τ, and (a verispec server's `/metrics`) the level's steps measured against what its cost model priced
them at: the shared target passes and the drafting (– where nothing was priced: plain decoding). Under greedy
decoding (the default) every response to one prompt must be the same text, batched or not: `garbled` counts the
responses that differ from the most common one of their prompt.
`--questions` sends public prompts (request i the i-th, cycling) instead of `--prompt`; any OpenAI-compatible
server can be measured this way (`benchmarks/probes/against_llama_server.py`: llama.cpp's own server).

soak: `--clients` clients send requests for `--minutes`, each cycling through a mix of short
completions, long ones (a prompt of about `--long-tokens` tokens), streams abandoned after a few
tokens and bad requests (an unbounded tree, a huge max_tokens, a lone surrogate, broken JSON, an
unknown field), then reports requests, answers by status, lost requests (no answer), garbled answers
(greedy texts that differ from the most common one of their kind), tokens/s, p50/p99 time per output
token of streamed requests and the server's peak RSS (`--server-pid`, same machine only).

interference: `--short-clients` clients stream short requests one token per step (per-request
drafter `--short-drafter`, default none) while nothing else runs, then while a prompt of about
`--long-tokens` tokens is admitted (`--long-repeats` times, one after the other); reports the short
requests' p50/p99 time per output token in both phases. Run it against `serve --prefill-chunk 0`
(whole prefill) and against the default chunk to compare.

identity: `--rounds` times, the request alone, then the same request while `--clients` others of
different lengths (one of them a prompt of about `--long-tokens` tokens) run; reports how many of the
answers under load equal the answer alone (greedy, or seeded sampling with `--seed`): batch
invariance, which must hold on every backend. Every mode prints the CPU flags first.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import re
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import httpx

__all__ = ["run_level", "run_soak", "run_interference", "run_identity", "main"]

LONG_SENTENCE = "The committee reviewed the quarterly report on river levels, rainfall and the state of the old bridges. "
BAD_REQUESTS = [  # (body bytes, path): answers must be 4xx, never 5xx
    (b'{"model": "%s", "prompt": "def f():", "max_tokens": 8, "drafter": "tree:k=1000,depth=1000"}', "/v1/completions"),
    (b'{"model": "%s", "prompt": "hi", "max_tokens": 1000000000}', "/v1/completions"),
    (b'{"model": "%s", "prompt": "abc\\ud800"}', "/v1/completions"),
    (b'{"model": "%s", "prompt": "t5', "/v1/completions"),
    (b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "max_token": 5}', "/v1/chat/completions"),
]


STEP_SECONDS = re.compile(r'^verispec_step_priced_seconds_total\{part="(\w+)",value="(\w+)"\} (\S+)$', re.M)


async def priced_seconds(http: httpx.AsyncClient) -> dict[tuple[str, str], float]:
    """{(part, "measured" | "priced"): seconds} of the steps a verispec server's cost model priced, from its `/metrics`
    ({} from another server)."""
    try:
        response = await http.get("/metrics")
    except httpx.HTTPError:
        return {}
    found = STEP_SECONDS.findall(response.text) if response.status_code == 200 else []
    return {(part, value): float(seconds) for part, value, seconds in found}


def measured_over_priced(before: dict, after: dict) -> dict[str, float]:
    """{part: measured ÷ priced seconds} of the steps between two `priced_seconds` readings (parts priced at 0 left out)."""
    spent = {key: after[key] - before.get(key, 0.0) for key in after}
    return {part: spent[(part, "measured")] / spent[(part, "priced")] for part, value in spent
            if value == "priced" and spent[(part, value)] > 0 and (part, "measured") in spent}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def run_level(url: str, model: str, clients: int, requests: int, body: dict, chat: bool = False,
                    prompts: Sequence[str] | None = None, seeded: bool = True) -> dict:
    """Send `requests` completions with `clients` concurrent workers; return the level's summary.

    chat: send each prompt as one user message to /v1/chat/completions (the model's chat template). prompts:
    request i sends prompts[i % len(prompts)] (default: body["prompt"] each time). seeded: request i carries seed i
    (False: no seed, as most chat clients send sampled requests). Any OpenAI-compatible server answers: τ
    (`usage.steps`, verispec's own) is None where the server reports no steps."""
    prompts = list(prompts) if prompts else [body["prompt"]]
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    body = {key: value for key, value in body.items() if key != "prompt"}
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    latencies, tokens, steps, failures, prompt_tokens = [], 0, 0, 0, 0
    texts: dict[int, list[str]] = {}  # per prompt, its answers' texts

    async def worker(http: httpx.AsyncClient) -> None:
        nonlocal tokens, steps, failures, prompt_tokens
        while not queue.empty():
            i = queue.get_nowait()
            prompt = prompts[i % len(prompts)]
            words = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
            started = time.perf_counter()
            response = await http.post(endpoint, json={**body, **words, "model": model, **({"seed": i} if seeded else {})})
            latencies.append(time.perf_counter() - started)
            if response.status_code != 200:
                failures += 1
                continue
            answer = response.json()
            choice = answer["choices"][0]
            texts.setdefault(i % len(prompts), []).append(choice["message"]["content"] if chat else choice["text"])
            usage = answer["usage"]
            tokens, prompt_tokens = tokens + usage["completion_tokens"], prompt_tokens + usage["prompt_tokens"]
            steps = None if steps is None or "steps" not in usage else steps + usage["steps"]

    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        before = await priced_seconds(http)
        started = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(clients)))
        seconds = time.perf_counter() - started
        priced = measured_over_priced(before, await priced_seconds(http))
    # greedy: each prompt's answers are one text, batched or not
    garbled = sum(len(group) - max(group.count(t) for t in set(group)) for group in texts.values()) if body.get("temperature", 0) == 0 else 0
    return {
        "clients": clients, "requests": requests, "failures": failures, "garbled": garbled, "seconds": round(seconds, 3),
        "requests_per_second": round(requests / seconds, 3), "tokens_per_second": round(tokens / seconds, 2),
        "p50_latency_s": round(percentile(latencies, 0.5), 3), "p99_latency_s": round(percentile(latencies, 0.99), 3),
        "mean_latency_s": round(statistics.mean(latencies), 3),
        "mean_accepted_length": round(tokens / steps, 3) if steps else None,
        "mean_prompt_tokens": round(prompt_tokens / (requests - failures), 1) if requests > failures else None,
        "measured_over_priced": {part: round(ratio, 3) for part, ratio in priced.items()},  # {} unpriced
    }


async def stream_completion(http: httpx.AsyncClient, body: dict, abandon_after: int | None = None) -> dict:
    """One streamed completion: status, text, arrival time of each token chunk, prompt tokens (from the
    final usage); `abandon_after`: close the stream after that many tokens (a client walking away)."""
    result = {"status": 0, "text": "", "times": [], "prompt_tokens": 0, "abandoned": False}
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                            "stream_options": {"include_usage": True}}) as response:
        result["status"] = response.status_code
        if response.status_code != 200:
            await response.aread()
            return result
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                result["status"] = int(chunk["error"].get("code") or 500)
                return result
            if chunk.get("usage") and not chunk["choices"]:
                result["prompt_tokens"] = chunk["usage"]["prompt_tokens"]
            for choice in chunk.get("choices", []):
                if choice.get("token_id") is not None:
                    result["times"].append(time.perf_counter())
                    result["text"] += choice.get("text", "")
            if abandon_after is not None and len(result["times"]) >= abandon_after:
                result["abandoned"] = True
                return result
    return result


def per_token_seconds(times: list[float]) -> float | None:
    """A stream's time per output token after its first: (last − first) / (tokens − 1)."""
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None


def token_gaps(times: list[float]) -> list[tuple[float, float]]:
    """(arrival time, seconds since the previous token) for every token of a stream after its first."""
    return [(b, b - a) for a, b in zip(times, times[1:])]


async def long_prompt(http: httpx.AsyncClient, model: str, tokens: int) -> tuple[str, int]:
    """A prompt of about `tokens` tokens for this server's tokenizer (measured with one 1-token request)."""
    probe = await http.post("/v1/completions", json={"model": model, "prompt": LONG_SENTENCE * 2, "max_tokens": 1})
    if probe.status_code != 200:
        raise RuntimeError(f"could not measure the prompt's tokens: {probe.status_code} {probe.text[:300]}")
    per_sentence = probe.json()["usage"]["prompt_tokens"] / 2
    prompt = LONG_SENTENCE * max(1, round(tokens / per_sentence))
    return prompt, round(len(prompt) / len(LONG_SENTENCE) * per_sentence)


class RssSampler:
    """Peak and last resident memory of a process on this machine (from /proc), sampled every second."""

    def __init__(self, pid: int | None):
        self.pid, self.peak, self.last = pid, 0, 0

    def sample(self) -> None:
        if self.pid is None:
            return
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                self.last = int(line.split()[1]) * 1024
                self.peak = max(self.peak, self.last)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.sample()
            await asyncio.sleep(1.0)


def _summary(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    return {"n": len(values), "p50": round(percentile(values, 0.5), 4), "p99": round(percentile(values, 0.99), 4),
            "max": round(max(values), 4)}


async def run_soak(url: str, model: str, clients: int, seconds: float, short_body: dict, long_tokens: int,
                   server_pid: int | None = None) -> dict:
    """`clients` clients cycling through short, long, abandoned and bad requests for `seconds`."""
    statuses: Counter[str] = Counter()
    texts: dict[str, list[str]] = {"short": [], "long": []}
    per_token, lost, tokens = [], 0, 0
    mix = ["short", "short", "short", "abandon", "short", "bad", "short", "long"]
    bad = itertools.cycle(BAD_REQUESTS)
    rss, stop = RssSampler(server_pid), asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=900) as http:
        long_text, long_count = await long_prompt(http, model, long_tokens)
        deadline = time.perf_counter() + seconds

        async def client(index: int) -> None:
            nonlocal lost, tokens
            for turn in itertools.count(index):
                if time.perf_counter() > deadline:
                    return
                kind = mix[turn % len(mix)]
                try:
                    if kind == "bad":
                        content, path = next(bad)
                        response = await http.post(path, content=content.replace(b"%s", model.encode()),
                                                   headers={"content-type": "application/json"})
                        statuses[str(response.status_code)] += 1
                        continue
                    body = {**short_body, "model": model} if kind != "long" else {**short_body, "model": model, "prompt": long_text}
                    result = await stream_completion(http, body, abandon_after=3 if kind == "abandon" else None)
                except httpx.HTTPError:
                    lost += 1
                    continue
                statuses[str(result["status"])] += 1
                tokens += len(result["times"])
                if result["status"] == 200 and not result["abandoned"]:
                    texts[kind].append(result["text"])
                    if (seconds_per_token := per_token_seconds(result["times"])) is not None:
                        per_token.append(seconds_per_token)

        sampler = asyncio.create_task(rss.run(stop))
        started = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(clients)))
        elapsed = time.perf_counter() - started
        stop.set()
        await sampler
    greedy = short_body.get("temperature", 0) == 0
    garbled = sum(len(t) - max(Counter(t).values()) for t in texts.values() if t) if greedy else 0
    return {
        "clients": clients, "seconds": round(elapsed, 1), "requests": sum(statuses.values()) + lost,
        "statuses": dict(sorted(statuses.items())), "server_errors": sum(n for s, n in statuses.items() if s.startswith("5")),
        "lost": lost, "garbled": garbled, "long_prompt_tokens": long_count, "tokens_per_second": round(tokens / elapsed, 2),
        "seconds_per_output_token": _summary(per_token),
        "server_rss_peak_mib": round(rss.peak / 2**20, 1) if server_pid else None,
        "server_rss_last_mib": round(rss.last / 2**20, 1) if server_pid else None,
    }


async def run_interference(url: str, model: str, short_clients: int, short_body: dict, long_tokens: int,
                           long_repeats: int, baseline_seconds: float) -> dict:
    """Short requests' time per output token alone, then while a long prompt is admitted."""
    async with httpx.AsyncClient(base_url=url, timeout=900) as http:
        long_text, long_count = await long_prompt(http, model, long_tokens)
        gaps: list[tuple[float, float]] = []
        stop = asyncio.Event()

        async def short_client() -> None:
            while not stop.is_set():
                result = await stream_completion(http, {**short_body, "model": model})
                gaps.extend(token_gaps(result["times"]))

        shorts = [asyncio.create_task(short_client()) for _ in range(short_clients)]
        await asyncio.sleep(baseline_seconds)
        baseline_end = time.perf_counter()
        windows, long_seconds = [], []
        for _ in range(long_repeats):
            begin = time.perf_counter()
            response = await http.post("/v1/completions", json={"model": model, "prompt": long_text, "max_tokens": 1})
            end = time.perf_counter()
            if response.status_code != 200:
                raise RuntimeError(f"the long request failed: {response.status_code} {response.text[:300]}")
            windows.append((begin, end))
            long_seconds.append(end - begin)
        stop.set()
        await asyncio.gather(*shorts)
    alone = [gap for at, gap in gaps if at <= baseline_end]
    during = [gap for at, gap in gaps if any(begin < at <= end for begin, end in windows)]
    return {"short_clients": short_clients, "long_prompt_tokens": long_count, "long_request_seconds": [round(s, 2) for s in long_seconds],
            "seconds_per_output_token_alone": _summary(alone), "seconds_per_output_token_during_long_prefill": _summary(during)}


async def run_identity(url: str, model: str, rounds: int, clients: int, body: dict, long_tokens: int) -> dict:
    """The request alone, then among `clients` others, `rounds` times: how many answers differ."""
    async with httpx.AsyncClient(base_url=url, timeout=3600) as http:
        async def text(request: dict) -> str:
            answer = await http.post("/v1/completions", json={"model": model, **request})
            if answer.status_code != 200:
                raise RuntimeError(f"{answer.status_code} {answer.text[:300]}")
            return answer.json()["choices"][0]["text"]

        long, _ = await long_prompt(http, model, long_tokens)
        others = [{**body, "prompt": long if i == 0 else f"{i + 1}. {body['prompt']}",
                   "max_tokens": 2 * body["max_tokens"] + 8 * i} for i in range(clients)]
        alone_texts, loaded_texts, started = [], [], time.perf_counter()
        for _ in range(rounds):
            alone_texts.append(await text(body))
            running = [asyncio.create_task(text(other)) for other in others]
            await asyncio.sleep(0.5)  # the others are admitted first
            loaded_texts.append(await text(body))
            await asyncio.gather(*running)
    reference = alone_texts[0]
    return {"rounds": rounds, "clients": clients, "seconds": round(time.perf_counter() - started, 1),
            "alone_equal_to_first": sum(t == reference for t in alone_texts),
            "loaded_equal_to_alone": sum(a == b for a, b in zip(alone_texts, loaded_texts)),
            "first_difference": next((f"round {i}: alone {a!r} / loaded {b!r}" for i, (a, b)
                                      in enumerate(zip(alone_texts, loaded_texts)) if a != b), None)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verispec.tools.bench.loadtest", description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--mode", choices=["levels", "soak", "interference", "identity"], default="levels")
    parser.add_argument("--clients", default="1,4,16", help="levels: comma-separated concurrency levels; soak: one number")
    parser.add_argument("--requests", type=int, default=32, help="levels: requests per level (the run is bounded)")
    parser.add_argument("--rounds", type=int, default=20, help="identity: alone/loaded pairs")
    parser.add_argument("--seed", type=int, default=None, help="identity: a seed for sampled requests")
    parser.add_argument("--minutes", type=float, default=10.0, help="soak: how long")
    parser.add_argument("--server-pid", type=int, default=None, help="soak: the server's process id, for its RSS (same machine)")
    parser.add_argument("--long-tokens", type=int, default=4000, help="soak, interference: about this many prompt tokens")
    parser.add_argument("--short-clients", type=int, default=4, help="interference: concurrent short streams")
    parser.add_argument("--short-drafter", default="none", help="interference: the short requests' drafter ('' = the server's)")
    parser.add_argument("--long-repeats", type=int, default=3, help="interference: long prompts admitted, one after the other")
    parser.add_argument("--baseline-seconds", type=float, default=20.0, help="interference: short requests alone first")
    parser.add_argument("--prompt", default="Write a short story about a robot who learns to paint.")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--chat", action="store_true", help="levels: send the prompt as a user message to /v1/chat/completions")
    parser.add_argument("--questions", default=None,
                        help="levels: public prompts instead of --prompt, request i the i-th (cycling): sources as for "
                             "`verispec bench` (own, humaneval, JSONL files)")
    parser.add_argument("--per-category", type=int, default=1, help="levels, with --questions: prompts per category")
    parser.add_argument("--unseeded", action="store_true",
                        help="levels: requests carry no seed (sampled ones then vary, and a server may size their γ "
                             "for the batch); default: request i seed i")
    parser.add_argument("--json", action="store_true", help="JSON objects instead of a table")
    args = parser.parse_args(argv)
    from verispec.paths import cpu_summary

    print(f"client on {cpu_summary()}")
    model = httpx.get(args.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"prompt": args.prompt, "max_tokens": args.max_tokens, "temperature": args.temperature,
            **({"seed": args.seed} if args.seed is not None else {})}
    if args.mode == "soak":
        row = asyncio.run(run_soak(args.url, model, int(args.clients.split(",")[-1]), args.minutes * 60, body, args.long_tokens,
                                   args.server_pid))
        print(json.dumps(row, indent=None if args.json else 1))
        return 0
    if args.mode == "identity":
        row = asyncio.run(run_identity(args.url, model, args.rounds, int(args.clients.split(",")[-1]), body, args.long_tokens))
        print(json.dumps(row, indent=None if args.json else 1))
        return 0 if row["loaded_equal_to_alone"] == row["rounds"] == row["alone_equal_to_first"] else 1
    if args.mode == "interference":
        short = {**body, **({"drafter": args.short_drafter} if args.short_drafter else {})}
        row = asyncio.run(run_interference(args.url, model, args.short_clients, short, args.long_tokens, args.long_repeats,
                                           args.baseline_seconds))
        print(json.dumps(row, indent=None if args.json else 1))
        return 0
    if not args.json:
        print(f"{'clients':>7} {'req/s':>8} {'tok/s':>8} {'p50 s':>8} {'p99 s':>8} {'τ':>6} {'failed':>6} {'garbled':>7}"
              f" {'pass ×priced':>12} {'draft ×priced':>13}")
    prompts = None
    if args.questions:
        from verispec.tools.bench.questions import load_sources, select
        prompts = [p.text for p in select(load_sources(args.questions), None, args.per_category)]
    for clients in (int(c) for c in args.clients.split(",")):
        row = asyncio.run(run_level(args.url, model, clients, args.requests, body, args.chat, prompts, not args.unseeded))
        tau = f"{row['mean_accepted_length']:.2f}" if row["mean_accepted_length"] else "–"  # another server reports no steps
        if args.json:
            print(json.dumps(row))
        else:
            priced = [f"{row['measured_over_priced'][part]:.2f}" if part in row["measured_over_priced"] else "–"
                      for part in ("target_pass", "drafting")]
            print(f"{row['clients']:>7} {row['requests_per_second']:>8.2f} {row['tokens_per_second']:>8.1f} "
                  f"{row['p50_latency_s']:>8.3f} {row['p99_latency_s']:>8.3f} {tau:>6} {row['failures']:>6} {row['garbled']:>7}"
                  f" {priced[0]:>12} {priced[1]:>13}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
