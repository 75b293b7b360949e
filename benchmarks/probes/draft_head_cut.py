"""The plan's `hybrid` draft with its head cut to ids < N (`hybrid:…,vocab=N`) against other cuts, in turns on the
same public prompts: tok/s, τ, α, what its head costs a draft token, and whether every variant gave the same tokens.

A draft model's head scores its whole vocabulary every draft token; SmolLM2's (49,152 × 576) is a third of the token.
Cutting it to the lower BPE ids (the earlier, more frequent merges) makes a draft token cheaper and misses the drafts
whose best id lies above the cut; the target verifies every token, so the output cannot change. Each variant is its
own engine (`load()`'s target, γ policy `auto`, its c timed now in turns with the target); each prompt runs every
variant, the order rotating.

    .venv/bin/python benchmarks/probes/draft_head_cut.py --vocab 0,16384,24576 --per-category 2
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from verispec import Engine, GenerationConfig, load
from verispec.control.costs import _context_cache, interleaved_token_seconds
from verispec.drafters import make_drafter
from verispec.engine.build import HYBRID_WINDOW
from verispec.paths import cpu_summary


def head_share(runner, context: int = 256, repeats: int = 30) -> tuple[float, float]:
    """(seconds of one draft token with its logits, without them) after `context` cached positions, best of `repeats`."""
    cache = _context_cache(runner, context, 2)
    best = {}
    for mode in ("all", "none"):
        best[mode] = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            runner.forward(cache, torch.tensor([5]), logits=mode)
            best[mode] = min(best[mode], time.perf_counter() - start)
            cache.truncate(context)
    cache.release()
    return best["all"], best["none"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", default="question.jsonl")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--vocab", default="0,24576", help="comma list of head cuts (0: the whole head)")
    parser.add_argument("--draft", default="smollm2-135m-instruct")
    args = parser.parse_args()
    planned = load()
    target = planned.target
    engines = {}
    for vocab in map(int, args.vocab.split(",")):
        spec = f"hybrid:draft={args.draft},window={HYBRID_WINDOW}" + (f",vocab={vocab}" if vocab else "")
        engines[vocab] = Engine(target, make_drafter(spec, target), planned.gamma, "auto")
    print(cpu_summary(), "·", target.name, target.precision, flush=True)
    # c timed now, every draft in turns with the target: a cached c of another hour would size γ apart from the cut
    seconds = interleaved_token_seconds([target.runner] + [engine.drafter.model.runner for engine in engines.values()])
    for (vocab, engine), draft_seconds in zip(engines.items(), seconds[1:]):
        cached = engine.costs.draft_cost_ratio()
        engine.costs.draft_token_seconds = draft_seconds / seconds[0] * engine.costs.target_seconds[0]
        with_logits, without = head_share(engine.drafter.model.runner)
        print(f"vocab={vocab or 'all'}: a draft token {with_logits * 1e3:.2f} ms, {without * 1e3:.2f} without its logits,"
              f" c {engine.costs.draft_cost_ratio():.3f} timed now (cached {cached:.3f})", flush=True)
    questions = [json.loads(line) for line in open(args.questions)]
    prompts = []
    for category in dict.fromkeys(q["category"] for q in questions):
        prompts += [q["turns"][0] for q in questions if q["category"] == category][: args.per_category]
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    for engine in engines.values():  # untimed warm-up
        engine.generate("Say hello.", GenerationConfig(max_new_tokens=8))
    totals = {vocab: {"tokens": 0, "seconds": 0.0, "proposed": 0, "accepted": 0, "steps": 0, "priced": 0.0} for vocab in engines}
    same = 0
    for i, prompt in enumerate(prompts):
        order = list(engines)[i % len(engines):] + list(engines)[: i % len(engines)]
        outputs = set()
        for vocab in order:
            start = time.perf_counter()
            result = engines[vocab].generate(prompt, config)
            total = totals[vocab]
            total["seconds"] += time.perf_counter() - start
            total["tokens"] += len(result.token_ids)
            total["proposed"] += result.stats.acceptance.proposed
            total["accepted"] += result.stats.acceptance.accepted
            total["steps"] += result.stats.steps
            # the cost model's price of the steps as taken (in T(1)): tokens / its predicted speedup over plain
            total["priced"] += len(result.token_ids) / engines[vocab].costs.speedup_of_steps(result.stats.records,
                                                                                              result.stats.prompt_tokens)
            outputs.add(tuple(result.token_ids))
        same += len(outputs) == 1
    first = totals[next(iter(engines))]
    for vocab, total in totals.items():
        rate = total["tokens"] / total["seconds"]
        measured = rate / (first["tokens"] / first["seconds"])
        predicted = (total["tokens"] / total["priced"]) / (first["tokens"] / first["priced"])
        print(f"vocab={vocab or 'all'}: {rate:.2f} tok/s ({measured:.3f}× the first; predicted from its steps and c"
              f" {predicted:.3f}×, measured / predicted {measured / predicted:.3f}), τ {total['tokens'] / total['steps']:.2f},"
              f" α {total['accepted'] / max(total['proposed'], 1):.3f} ({total['accepted']} of {total['proposed']})", flush=True)
    print(f"{same}/{len(prompts)} prompts: every variant the same tokens", flush=True)


if __name__ == "__main__":
    main()
