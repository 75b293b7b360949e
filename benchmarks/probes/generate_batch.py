"""`Engine.generate_batch` against one `generate` after another: the same public prompts, the same engine (the plan's,
`load()`), in turns; tok/s of each and whether every result is the same tokens.

Throughput of a script with many prompts: k requests stepped together share the target's pass (and the draft's), so
they decode faster than one after the other; each result must still be what `generate` gives that prompt alone.
`--variants` adds other settings to each batch size, in turns: `unsized` (each request at its own γ, as alone: no
`control/batch.size_together`), `none` (plain decoding), `gamma=G` (a constant γ of G).

    .venv/bin/python benchmarks/probes/generate_batch.py --per-category 1 --max-batch 4,8
    .venv/bin/python benchmarks/probes/generate_batch.py --max-batch 8 --rounds 3 --no-alone --variants plan,unsized,none,gamma=1
"""

from __future__ import annotations

import argparse
import json
import time
from unittest import mock

import verispec.engine.together as together
from verispec import GenerationConfig, load
from verispec.paths import cpu_summary


def variant(name: str, max_new_tokens: int):
    """(config, what stands in for `size_together`) of a `--variants` entry."""
    if name == "unsized":
        return GenerationConfig(max_new_tokens=max_new_tokens), lambda outlooks, pass_cost: [o.gamma for o in outlooks]
    settings = {"plan": {}, "none": {"drafter": "none"}}.get(name)
    if settings is None and name.startswith("gamma="):
        settings = {"gamma": int(name.removeprefix("gamma=")), "gamma_policy": "constant"}
    if settings is None:
        raise SystemExit(f"unknown variant {name!r}: plan, unsized, none or gamma=G")
    return GenerationConfig(max_new_tokens=max_new_tokens, **settings), together.size_together


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", default="question.jsonl")
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-batch", default="4,8", help="comma list of requests stepped at once")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--variants", default="plan", help="comma list: plan, unsized, none, gamma=G")
    parser.add_argument("--no-alone", action="store_true", help="skip one `generate` after another (and the comparison)")
    args = parser.parse_args()
    variants = {name: variant(name, args.max_new_tokens) for name in args.variants.split(",")}
    engine = load()
    print(cpu_summary(), "·", engine.plan.summary() if engine.plan is not None else "", flush=True)
    questions = [json.loads(line) for line in open(args.questions)]
    prompts = []
    for category in dict.fromkeys(q["category"] for q in questions):
        prompts += [q["turns"][0] for q in questions if q["category"] == category][: args.per_category]
    # a warm-up batch (it also measures the batch's pass costs the first time: `CostModel.pass_cost`), not timed
    engine.generate_batch(prompts[:2], GenerationConfig(max_new_tokens=16), max_batch=2)
    for round_ in range(args.rounds):
        alone = None
        if not args.no_alone:
            started = time.perf_counter()
            alone = [engine.generate(prompt, variants[next(iter(variants))][0]) for prompt in prompts]
            seconds = time.perf_counter() - started
            tokens = sum(len(r.token_ids) for r in alone)
            print(f"round {round_} · {len(prompts)} prompts one after another: {tokens / seconds:.1f} tok/s ({seconds:.1f} s)", flush=True)
        for k in map(int, args.max_batch.split(",")):
            for name, (config, sizing) in variants.items():
                with mock.patch.object(together, "size_together", sizing):
                    started = time.perf_counter()
                    results = engine.generate_batch(prompts, config, max_batch=k)
                    seconds = time.perf_counter() - started
                drafted = sum(r.stats.acceptance.proposed for r in results)
                kept = sum(r.stats.acceptance.accepted for r in results)
                line = (f"round {round_} · generate_batch(max_batch={k}) {name}: {sum(len(r.token_ids) for r in results) / seconds:.1f}"
                        f" tok/s ({seconds:.1f} s), {drafted} drafted, {kept} accepted")
                if alone is not None and name == next(iter(variants)):
                    line += f", {sum(a.token_ids == b.token_ids for a, b in zip(alone, results))}/{len(prompts)} the same tokens as alone"
                print(line, flush=True)


if __name__ == "__main__":
    main()
