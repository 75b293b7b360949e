"""A busy server's prompt chunk riding in the decoding requests' pass (`Turn.mixed`) against a pass of its own.

Two parts, on the plan's engine (as `verispec serve` loads it):
1. The pass: k decoding rows of one position after `--context` cached ones and a prompt chunk, each alone and in ONE
   `forward_ragged` pass (best of `--repeats`, in turns), at the chunk a pass of its own fits in the busy budget and at
   each riding chunk: what a pass of the chunk alone costs, and what the chunk adds to the rows' pass it rides in.
2. Serving: `--clients` closed-loop clients through the real `Scheduler` (each sends the next of `--requests` public
   prompts, cycled, greedy, `--max-tokens` new tokens, when its last answer ends), apart and riding (at each of
   `--chunks`) in turns for `--rounds` rounds: tok/s, mean seconds to a first token; predicted for each riding run:
   the apart run's time less, for each of its turns that fed a chunk beside a step, that chunk's own pass, plus what
   its tokens add riding at the riding run's chunk (part 1, at the mean rows such a turn stepped). The prediction
   counts passes only: a prompt in sooner also decodes beside the others sooner. Each run's prompts carry a note of
   their own in front, so that no run takes another's prompts from the prompt cache (the answers differ by it:
   identity under load is `loadtest --mode identity`'s and the tests' to check).

    python benchmarks/probes/prompt_riding.py --questions question.jsonl,humaneval --clients 4,8 --chunks apart,auto
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from verispec import GenerationConfig, load
from verispec.engine.together import mixes_prompts
from verispec.paths import cpu_summary
from verispec.serving.http.scheduler import PREFILL_BUDGET_SECONDS, Scheduler, auto_prefill_chunk
from verispec.tools.bench.questions import load_sources, select


def pass_seconds(runner, rows: int, chunk: int, context: int, repeats: int) -> tuple[float, float, float]:
    """(seconds of `rows` one-position rows alone, of a `chunk`-token prompt alone, of both in ONE pass): best of
    `repeats` each, in turns, every cache rolled back after each."""
    caches = [runner.placeholder_cache(context, context + chunk + 1) for _ in range(rows + 1)]
    feeds = [torch.zeros(1, dtype=torch.long) for _ in range(rows)]
    prompt = torch.zeros(chunk, dtype=torch.long)
    ways = [lambda: runner.forward_ragged(caches[:rows], feeds),
            lambda: runner.forward(caches[rows], prompt, logits="none"),
            lambda: runner.forward_ragged(caches, feeds + [prompt], logits=["all"] * rows + ["none"])]
    best = [float("inf")] * len(ways)
    for _ in range(repeats):
        for i, way in enumerate(ways):
            started = time.perf_counter()
            way()
            best[i] = min(best[i], time.perf_counter() - started)
            for cache in caches:
                cache.truncate(context)
    return best[0], best[1], best[2]


async def serve(engine, prompts: list[list[int]], clients: int, max_tokens: int, mixes: bool, chunk: int) -> dict:
    """`clients` closed-loop clients over `prompts` (each prompt once) through a fresh Scheduler riding or not, feeding
    `chunk` prompt tokens a turn while requests decode."""
    scheduler = Scheduler(engine, max_batch=max(clients, 1))
    scheduler.mixes_prompts, scheduler.prefill_chunk = mixes, chunk
    queue = list(prompts)
    firsts, tokens = [], 0

    async def client():
        nonlocal tokens
        while queue:
            ids = queue.pop(0)
            began, first = time.perf_counter(), None
            job = scheduler.submit(ids, GenerationConfig(max_new_tokens=max_tokens))
            while (update := await job.next()).kind != "finished":
                if update.kind == "tokens" and update.events:
                    first = first or time.perf_counter() - began
                    tokens += len(update.events)
            firsts.append(first or time.perf_counter() - began)

    scheduler.start()
    try:
        began = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        seconds = time.perf_counter() - began
    finally:
        scheduler.stop()
    beside = [turn for turn in scheduler.turns if turn.stepped and any(turn.prefilled.values())]
    return {"seconds": seconds, "tok/s": tokens / seconds, "first": statistics.mean(firsts),
            "beside": len(beside), "rows": statistics.mean(len(turn.stepped) for turn in beside) if beside else 0,
            "mixed": sum(turn.mixed for turn in scheduler.turns)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", default="question.jsonl,humaneval")
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--clients", default="4,8")
    parser.add_argument("--requests", type=int, default=16, help="per run, the prompts cycled")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--chunks", default="apart",
                        help="comma list of the riding runs' chunks: apart (the size a pass of its own fits in the budget), "
                             "auto (what riding fits: `auto_prefill_chunk(riding=True)`) or a number")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    engine = load()
    engine.prepare()
    runner = engine.target.runner
    apart_chunk, riding_chunk = auto_prefill_chunk(engine), auto_prefill_chunk(engine, riding=True)
    chunks = [{"apart": apart_chunk, "auto": riding_chunk}.get(c) or int(c) for c in args.chunks.split(",")]
    print(f"{cpu_summary()} · {torch.get_num_threads()} threads · {engine.target.name} on {engine.target.precision} · "
          f"the target mixes prompts: {mixes_prompts(runner)} · busy chunk {apart_chunk} tokens in a pass of its own, "
          f"{riding_chunk} riding (budget {PREFILL_BUDGET_SECONDS} s)", flush=True)
    # per k rows: a pass of the apart chunk alone; per (k, c): what a c-token chunk adds to the rows' pass it rides in
    alone, adds = {}, {}
    for k in sorted({1, *map(int, args.clients.split(","))}):
        for chunk in sorted({apart_chunk, *chunks}):
            rows, prompt, both = pass_seconds(runner, k, chunk, args.context, args.repeats)
            if chunk == apart_chunk:
                alone[k] = prompt
            adds[k, chunk] = both - rows
            print(f"pass · {k} rows + {chunk} prompt tokens: apart {(rows + prompt) * 1e3:.1f} ms, one pass "
                  f"{both * 1e3:.1f} ms (×{both / (rows + prompt):.3f})", flush=True)
    texts = [p.text for p in select(load_sources(args.questions), None, args.per_category)]
    variants = [("apart", False, apart_chunk)] + [(f"riding {c}", True, c) for c in chunks]

    async def run():
        for clients in map(int, args.clients.split(",")):
            for rounds in range(args.rounds):
                runs = {}
                for name, mixes, chunk in variants if rounds % 2 == 0 else variants[::-1]:  # in turns, order alternating
                    ids = [engine.prompt_ids(f"Note {clients}-{rounds}-{name}-{j}. {texts[j % len(texts)]}")
                           for j in range(args.requests)]
                    runs[name] = await serve(engine, ids, clients, args.max_tokens, mixes, chunk)
                off = runs["apart"]
                k = min(alone, key=lambda rows: abs(rows - off["rows"]))  # the rows such a turn stepped, measured nearest
                print(f"{clients} clients, round {rounds}: apart {off['tok/s']:.1f} tok/s (first token {off['first']:.2f} s, "
                      f"{off['beside']} chunks beside a step of {off['rows']:.1f} rows)", flush=True)
                for name, _, chunk in variants[1:]:
                    on = runs[name]
                    # each apart chunk's own pass gone, its tokens fed riding at `chunk` a turn
                    saved = off["beside"] * (alone[k] - apart_chunk / chunk * adds[k, chunk])
                    predicted = off["seconds"] / (off["seconds"] - saved)
                    print(f"    {name}: {on['tok/s']:.1f} tok/s (first token {on['first']:.2f} s, {on['mixed']} turns mixed) · "
                          f"×{on['tok/s'] / off['tok/s']:.3f} measured / ×{predicted:.3f} predicted", flush=True)

    asyncio.run(run())


if __name__ == "__main__":
    main()
