"""How much of a server's batched step goes to drafting when several requests decode at once.

The scheduler (`serving/http/scheduler.py`, `_step`) verifies every running request in one target pass
(`forward_ragged`) after the requests drafted side by side (`Generation.plan` through `draft_together`: prompt lookup
costs nothing, a draft model's forwards are batched across requests; `--alone`: one request after the other, as
before). Here `--n` public prompts (Spec-Bench's first of each category) decode together exactly as the scheduler
steps them, on the shipped target in kquant; prints, per round, the batched steps, the tokens, the seconds spent
drafting and in the target pass, and the tokens a second of both.

    .venv/bin/python benchmarks/probes/batched_drafting.py --draft ngram --draft hybrid:draft=smollm2-135m-instruct,window=256 \\
        --n 4 --alone      # each draft in turns, together and alone (BENCHMARKS.md, "AMX")
"""

from __future__ import annotations

import argparse
import json
import time

from verispec import Engine, GenerationConfig
from verispec.drafters import make_drafter
from verispec.drafters.batching import draft_together
from verispec.models.loading import load_model
from verispec.paths import cpu_summary

CATEGORIES = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", action="append", help="a drafter spec (repeat to compare several, in turns; default ngram)")
    parser.add_argument("--n", type=int, default=4, choices=range(1, len(CATEGORIES) + 1))
    parser.add_argument("--questions", default="question.jsonl")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--alone", action="store_true", help="also draft request by request (no shared draft passes)")
    args = parser.parse_args()
    drafts = args.draft or ["ngram"]
    print(cpu_summary(), "·", args.n, "requests", flush=True)
    target = load_model("qwen2.5-coder-1.5b-instruct", "kquant")
    engines = {spec: Engine(target, make_drafter(spec, target), gamma_policy="auto") for spec in drafts}
    questions = [json.loads(line) for line in open(args.questions)]
    prompts = [next(q for q in questions if q["category"] == category)["turns"][0] for category in CATEGORIES[: args.n]]
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    for round_ in range(args.rounds):
        for spec, alone in [(spec, alone) for spec in drafts for alone in ([False, True] if args.alone else [False])]:
            print(f"round {round_} · {spec}{' · drafting alone' if alone else ''}: {run(engines[spec], prompts, config, alone)}",
                  flush=True)


def run(engine: Engine, prompts: list[str], config: GenerationConfig, alone: bool) -> str:
    """The prompts decoded together as the scheduler steps them; what the steps cost."""
    generations = [engine.start(prompt, config) for prompt in prompts]
    for generation in generations:
        while not generation.prefill_step():
            pass
        generation.take_held()  # the first token, from the prefill: not counted below
    drafting = target = 0.0
    steps, before = 0, sum(len(g.output_ids) for g in generations)
    while live := [g for g in generations if not g.done]:
        started = time.perf_counter()
        plans = [g.plan() for g in live] if alone else draft_together([g.plan for g in live], [g.batches_drafts for g in live])
        drafted = time.perf_counter()
        rows = engine.target.runner.forward_ragged([g.cache for g in live], [p.feed for p in plans],
                                                   [p.positions for p in plans], [p.tree_mask for p in plans])
        verified = time.perf_counter()
        for generation, plan, logits in zip(live, plans, rows):
            generation.commit(plan, logits, verified - drafted)
        drafting, target, steps = drafting + drafted - started, target + verified - drafted, steps + 1
    tokens = sum(len(g.output_ids) for g in generations) - before
    return (f"{steps} batched steps, {tokens} tokens, drafting {drafting:.2f} s, target pass {target:.2f} s "
            f"(drafting {drafting / (drafting + target):.0%}), {tokens / (drafting + target):.1f} tok/s")


if __name__ == "__main__":
    main()
