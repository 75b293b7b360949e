"""A busy server's prompt chunk riding in the decoding requests' pass (`Turn.mixed`) against a pass of its own.

Two parts, on the plan's engine (as `verispec serve` loads it):
1. The pass: k decoding rows of one position after `--context` cached ones, and a prompt chunk of the size a pass of
   its own fits in the busy budget, in ONE `forward_ragged` pass against the k rows' pass followed by the chunk's own
   (best of `--repeats`, in turns): the seconds a ride saves per turn that carries a chunk.
2. Serving: `--clients` closed-loop clients through the real `Scheduler` (each sends the next of `--requests` public
   prompts, cycled, greedy, `--max-tokens` new tokens, when its last answer ends), apart and riding (at each of
   `--chunks`) in turns for `--rounds` rounds: tok/s, mean seconds to a first token; predicted for riding at the apart
   run's chunk: the apart run's time less its turns that fed a chunk beside a step times part 1's saving (at the mean
   rows such a turn stepped). Each run's prompts carry a note of their own in front, so that no run takes another's
   prompts from the prompt cache (the answers differ by it: identity under load is `loadtest --mode identity`'s and
   the tests' to check).

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


def pass_saving(runner, rows: int, chunk: int, context: int, repeats: int) -> tuple[float, float]:
    """(seconds of `rows` one-position rows then a `chunk`-token prompt in passes of their own, in one pass): best of
    `repeats`, in turns, every cache rolled back after each."""
    caches = [runner.placeholder_cache(context, context + chunk + 1) for _ in range(rows + 1)]
    feeds = [torch.zeros(1, dtype=torch.long) for _ in range(rows)]
    prompt = torch.zeros(chunk, dtype=torch.long)

    def apart():
        runner.forward_ragged(caches[:rows], feeds)
        runner.forward(caches[rows], prompt, logits="none")

    def together():
        runner.forward_ragged(caches, feeds + [prompt], logits=["all"] * rows + ["none"])

    best = {apart: float("inf"), together: float("inf")}
    for _ in range(repeats):
        for way in best:
            started = time.perf_counter()
            way()
            best[way] = min(best[way], time.perf_counter() - started)
            for cache in caches:
                cache.truncate(context)
    return best[apart], best[together]


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
    savings = {}
    for k in sorted({1, *map(int, args.clients.split(","))}):
        apart, together = pass_saving(runner, k, apart_chunk, args.context, args.repeats)
        savings[k] = apart - together
        print(f"pass · {k} rows + {apart_chunk} prompt tokens: apart {apart * 1e3:.1f} ms, one pass {together * 1e3:.1f} ms "
              f"(×{together / apart:.3f})", flush=True)
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
                saving = savings[min(savings, key=lambda k: abs(k - off["rows"]))]
                predicted = off["seconds"] / (off["seconds"] - off["beside"] * saving)
                print(f"{clients} clients, round {rounds}: apart {off['tok/s']:.1f} tok/s (first token {off['first']:.2f} s, "
                      f"{off['beside']} chunks beside a step of {off['rows']:.1f} rows)", flush=True)
                for name, _, chunk in variants[1:]:
                    on = runs[name]
                    guess = f" / ×{predicted:.3f} predicted" if chunk == apart_chunk else ""
                    print(f"    {name}: {on['tok/s']:.1f} tok/s (first token {on['first']:.2f} s, {on['mixed']} turns mixed) · "
                          f"×{on['tok/s'] / off['tok/s']:.3f} measured{guess}", flush=True)

    asyncio.run(run())


if __name__ == "__main__":
    main()
