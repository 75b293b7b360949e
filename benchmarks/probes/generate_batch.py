"""`Engine.generate_batch` against one `generate` after another: the same public prompts, the same engine (the plan's,
`load()`), in turns; tok/s of each and whether every result is the same tokens.

Throughput of a script with many prompts: k requests stepped together share the target's pass (and the draft's), so
they decode faster than one after the other; each result must still be what `generate` gives that prompt alone.

    .venv/bin/python benchmarks/probes/generate_batch.py --per-category 1 --max-batch 4,8
"""

from __future__ import annotations

import argparse
import json
import time

from verispec import GenerationConfig, load
from verispec.paths import cpu_summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", default="question.jsonl")
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-batch", default="4,8", help="comma list of requests stepped at once")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    engine = load()
    print(cpu_summary(), "·", engine.plan.summary() if engine.plan is not None else "", flush=True)
    questions = [json.loads(line) for line in open(args.questions)]
    prompts = []
    for category in dict.fromkeys(q["category"] for q in questions):
        prompts += [q["turns"][0] for q in questions if q["category"] == category][: args.per_category]
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    for round_ in range(args.rounds):
        started = time.perf_counter()
        alone = [engine.generate(prompt, config) for prompt in prompts]
        seconds = time.perf_counter() - started
        tokens = sum(len(r.token_ids) for r in alone)
        print(f"round {round_} · {len(prompts)} prompts one after another: {tokens / seconds:.1f} tok/s ({seconds:.1f} s)", flush=True)
        for k in map(int, args.max_batch.split(",")):
            started = time.perf_counter()
            together = engine.generate_batch(prompts, config, max_batch=k)
            seconds = time.perf_counter() - started
            same = sum(a.token_ids == b.token_ids for a, b in zip(alone, together))
            print(f"round {round_} · generate_batch(max_batch={k}): {sum(len(r.token_ids) for r in together) / seconds:.1f} tok/s "
                  f"({seconds:.1f} s), {same}/{len(prompts)} the same tokens as alone", flush=True)


if __name__ == "__main__":
    main()
