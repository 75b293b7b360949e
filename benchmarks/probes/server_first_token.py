"""Seconds to a lone request's first token through the server's scheduler, with each prefill-chunk setting, against
the time the measured prefill speed predicts.

One engine (the plan's, as `verispec serve` loads it), one `Scheduler` per setting of `--chunks` (`auto`: what a
server measures, `prefill_chunks`; a number: that many tokens a turn, as `--prefill-chunk N`), each prompt of
--questions / --categories sent alone to each in turns (a nonce of its own in front keeps the prompt cache from
carrying a prompt from one setting to the next; the chat template's head is cached alike for all). Predicted: the prompt's
tokens times the target's measured prefill seconds per token in chunks of the size that setting feeds while nothing
decodes (`control.costs.prefill_seconds_per_token`, from the cache the plan filled).

    python benchmarks/probes/server_first_token.py --questions question.jsonl --categories summarization,rag \
        --per-category 3 --chunks auto,32 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import time

from verispec import GenerationConfig, load
from verispec.control.costs import prefill_seconds_per_token
from verispec.paths import cpu_summary
from verispec.serving.http.scheduler import Scheduler
from verispec.tools.bench.questions import load_sources, select


async def first_token_seconds(scheduler: Scheduler, ids: list[int]) -> float:
    """A request of `ids` alone on `scheduler`: seconds from its submission to the end of its one new token."""
    began = time.perf_counter()
    job = scheduler.submit(ids, GenerationConfig(max_new_tokens=1))
    while (await job.next()).kind not in ("finished", "failed"):
        pass
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", default="own")
    parser.add_argument("--categories", default=None, help="comma list (default all)")
    parser.add_argument("--per-category", type=int, default=3)
    parser.add_argument("--chunks", default="auto,32", help="comma list: auto or a number of tokens")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    categories = args.categories.split(",") if args.categories else None
    prompts = [p.text for p in select(load_sources(args.questions), categories, args.per_category)]
    engine = load()
    engine.prepare()
    settings = [None if chunk == "auto" else int(chunk) for chunk in args.chunks.split(",")]
    schedulers = [Scheduler(engine, prefill_chunk=chunk) for chunk in settings]
    print(f"{cpu_summary()} · {engine.target.name} on {engine.target.precision} · {len(prompts)} prompts alone, "
          f"{args.rounds} rounds · to the first token, mean s (measured / predicted)")

    async def run() -> dict[int, list[tuple[float, float]]]:
        for scheduler in schedulers:
            scheduler.start()
        try:
            times: dict[int, list[tuple[float, float]]] = {i: [] for i in range(len(schedulers))}
            for nonce, (_, prompt) in enumerate(itertools.product(range(args.rounds), prompts)):
                for i, scheduler in enumerate(schedulers):  # in turns: the machine's drift touches each alike
                    ids = engine.prompt_ids(f"Note {nonce}-{i}. {prompt}")  # no setting reuses another's prompt
                    chunk = scheduler.idle_prefill_chunk or 512  # a size the server measured (0: whole prompts)
                    predicted = len(ids) * prefill_seconds_per_token(engine.target, chunk)
                    times[i].append((await first_token_seconds(scheduler, ids), predicted))
            return times
        finally:
            for scheduler in schedulers:
                scheduler.stop()

    for i, pairs in asyncio.run(run()).items():
        scheduler = schedulers[i]
        measured, predicted = (statistics.mean(column) for column in zip(*pairs))
        print(f"  chunk {args.chunks.split(',')[i]} ({scheduler.prefill_chunk} decoding, {scheduler.idle_prefill_chunk} "
              f"quiet): {measured:.2f} / {predicted:.2f} (×{measured / predicted:.2f})")


if __name__ == "__main__":
    main()
