"""`verispec serve` against llama.cpp's own server under load: the same GGUF, public prompts, greedy chat completions at
each concurrency level, the two servers in turns (one at a time on the CPU); tok/s, latency and identical answers.

`llama-server` (llama.cpp's: parallel slots, continuous batching) is what a CPU user serving a GGUF runs, and what
`verispec serve` must beat under load, not only one request at a time. Each server is started here, waited for,
warmed with one request, measured at every level (`tools/bench/loadtest.run_level`: request i sends the i-th prompt,
cycling, so each prompt is answered several times among different company), then stopped; the order alternates by
round. `garbled` counts answers that differ from their prompt's most common answer: greedy output that depends on
the batch it ran in. llama-server is not part of llama-cpp-python's wheel: build it once from the llama.cpp that
the wheel vendors, with scripts/setup.sh's flags (native, without AMX):

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-0.3.36.tar.gz
    cd llama_cpp_python-0.3.36/vendor/llama.cpp && F="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" && CFLAGS=$F \\
        CXXFLAGS=$F cmake -S . -B build -G Ninja -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \\
        && cmake --build build --target llama-server

    .venv/bin/python benchmarks/probes/against_llama_server.py --llama-server PATH/build/bin/llama-server \\
        --questions question.jsonl,humaneval --clients 1,4,8 --requests 16 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from verispec.models.registry import gguf_file
from verispec.paths import cpu_summary
from verispec.tools.bench.loadtest import run_level
from verispec.tools.bench.questions import load_sources, select

SLOT_CONTEXT = 2048  # positions each of llama-server's slots holds (its -c is split among -np slots)


def commands(args, port: int) -> dict[str, list[str]]:
    """Each server's command line, both on the same GGUF with as many requests at once as the highest level."""
    parallel = max(map(int, args.clients.split(",")))
    gguf = str(gguf_file(args.target))
    verispec = [str(Path(sys.executable).parent / "verispec"), "serve", "--port", str(port), "--target", args.target,
                "--max-batch", str(parallel)]
    llama = [args.llama_server, "-m", gguf, "--port", str(port), "-t", str(os.cpu_count()), "-np", str(parallel),
             "-c", str(parallel * SLOT_CONTEXT), "--jinja", "--alias", args.target]
    return {"verispec": verispec, "llama-server": llama}


@contextlib.contextmanager
def running(command: list[str], port: int, log: Path):
    """The server started, /health answering 200 (up to 10 minutes: a first run measures and plans), then stopped."""
    with open(log, "w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                  env={**os.environ, "COLUMNS": "400"})  # the plan's line unwrapped in the log
    try:
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None:
                raise SystemExit(f"{command[0]} exited with {server.returncode}: {log.read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"{command[0]} did not answer /health in 10 minutes: {log}")
            time.sleep(1)
        yield server
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", required=True, help="path of llama.cpp's llama-server binary")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="a shipped model or a .gguf path")
    parser.add_argument("--questions", default="question.jsonl,humaneval")
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--clients", default="1,4,8", help="comma list of concurrency levels")
    parser.add_argument("--requests", type=int, default=16, help="requests per level")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=8131)
    args = parser.parse_args()
    prompts = [p.text for p in select(load_sources(args.questions), None, args.per_category)]
    body = {"max_tokens": args.max_tokens, "temperature": 0}
    print(f"{cpu_summary()} · {len(prompts)} prompts, {args.requests} requests a level, {args.max_tokens} new tokens at most",
          flush=True)
    logs = Path(tempfile.mkdtemp(prefix="against-llama-server-"))
    servers = commands(args, args.port)
    rows: dict[tuple[str, int], list[dict]] = {}
    for round_ in range(args.rounds):
        for name in (servers if round_ % 2 == 0 else reversed(servers)):
            log = logs / f"{name}-{round_}.log"
            with running(servers[name], args.port, log):
                url = f"http://127.0.0.1:{args.port}"
                asyncio.run(run_level(url, args.target, 1, 1, body, chat=True, prompts=prompts))  # warm-up, not timed
                for clients in map(int, args.clients.split(",")):
                    row = asyncio.run(run_level(url, args.target, clients, args.requests, body, chat=True, prompts=prompts))
                    rows.setdefault((name, clients), []).append(row)
                    tau = f", τ {row['mean_accepted_length']:.2f}" if row["mean_accepted_length"] else ""
                    print(f"round {round_} · {name} · {clients} at once: {row['tokens_per_second']:.1f} tok/s, p50 / p99"
                          f" {row['p50_latency_s']:.1f} / {row['p99_latency_s']:.1f} s{tau}, prompts {row['mean_prompt_tokens']} tokens, failed {row['failures']},"
                          f" garbled {row['garbled']}", flush=True)
            plan = [line.strip() for line in log.read_text().splitlines() if "plan:" in line]
            if plan:
                print(f"    {plan[0]}", flush=True)
    print("\nclients · verispec tok/s · llama-server tok/s · ratio (mean of rounds; per round)")
    for clients in map(int, args.clients.split(",")):
        ours, theirs = ([r["tokens_per_second"] for r in rows[(name, clients)]] for name in servers)
        ratios = " ".join(f"{a / b:.2f}" for a, b in zip(ours, theirs))
        print(f"{clients:>7} · {sum(ours) / len(ours):.1f} · {sum(theirs) / len(theirs):.1f} ·"
              f" {sum(ours) / sum(theirs):.2f}× ({ratios})")
    print(f"server logs: {logs}")


if __name__ == "__main__":
    main()
