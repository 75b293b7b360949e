"""`Engine.generate_batch` against one `generate` after another: the same public prompts, the same engine (the plan's,
`load()`), in turns; tok/s of each and whether every result is the same tokens.

Throughput of a script with many prompts: k requests stepped together share the target's pass (and the draft's), so
they decode faster than one after the other; each result must still be what `generate` gives that prompt alone.
`--variants` adds other settings to each batch size, in turns: `unsized` (each request at its own γ, as alone: no
`control/batch.size_together`), `none` (plain decoding), `gamma=G` (a constant γ of G), `drafter=SPEC` (another
drafter, its γ sized as the plan's). `--ledger` holds each batch's
steps against the prices γ was sized by: the shared passes' seconds against `CostModel.pass_cost` by width, the
drafting against γ·c, and what neither holds (verification, commits, per-request work on the host). `--temperature T`
samples every request at T without a seed (a server's usual sampled traffic: sized for the batch like greedy ones).

    .venv/bin/python benchmarks/probes/generate_batch.py --per-category 1 --max-batch 4,8
    .venv/bin/python benchmarks/probes/generate_batch.py --max-batch 8 --rounds 3 --no-alone --variants plan,unsized,none,gamma=1
    .venv/bin/python benchmarks/probes/generate_batch.py --max-batch 8 --no-alone --variants plan,none --ledger
    .venv/bin/python benchmarks/probes/generate_batch.py --temperature 0.8 --max-batch 4,8 --no-alone --variants plan,none --ledger
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import time
from unittest import mock

import verispec.engine.together as together
from verispec import GenerationConfig, SamplingParams, load
from verispec.control.costs import interleaved_token_seconds
from verispec.engine.loop import Generation
from verispec.paths import cpu_summary


def variant(name: str, max_new_tokens: int, temperature: float):
    """(config, what stands in for `size_together`) of a `--variants` entry; sampled at `temperature` (0: greedy),
    unseeded (each request's draws in distribution only, as a server's unseeded requests)."""
    base = {"max_new_tokens": max_new_tokens, "sampling": SamplingParams(temperature=temperature)}
    if name == "unsized":
        return GenerationConfig(**base), lambda outlooks, pass_cost: [o.gamma for o in outlooks]
    settings = {"plan": {}, "none": {"drafter": "none"}}.get(name)
    if settings is None and name.startswith("gamma="):
        settings = {"gamma": int(name.removeprefix("gamma=")), "gamma_policy": "constant"}
    if settings is None and name.startswith("drafter="):
        settings = {"drafter": name.removeprefix("drafter=")}
    if settings is None:
        raise SystemExit(f"unknown variant {name!r}: plan, unsized, none, gamma=G or drafter=SPEC")
    return GenerationConfig(**base, **settings), together.size_together


class Ledger:
    """Each step taken together, timed in its parts (drafting, the shared pass, the rest) and priced as
    `control/batch.py` prices it: the pass at `CostModel.pass_cost(positions, rows, context)`, a drafted token at c
    (0 where the step's class is free) and a drafting request's catching up (`Outlook.catch_up`), in T(1); and the
    requests' prefills (the target's, then the draft model's). Installed by patching `engine/together.py`'s step
    functions and sizing (the variant's, wrapped) and `Generation.prefill_step`."""

    BUCKETS = (1, 9, 17, 25, 33, 49, 65)  # pass widths (positions) reported apart: a bucket from each to the next

    def __init__(self, costs):
        self.costs, self.steps = costs, []  # the plan's (where a step's policy prices none); per step: sizes, prices, seconds
        self.prefill = {"target": 0.0, "draft": 0.0}  # seconds of the requests' prefills, outside the steps

    @contextlib.contextmanager
    def installed(self):
        draft_plans, verify_together, step_together = together.draft_plans, together.verify_together, together.step_together
        size_together = together.size_together  # the variant's
        step = {}

        def priced_size_together(outlooks, pass_cost):
            gammas = size_together(outlooks, pass_cost)
            step["catching up"] = sum(o.catch_up for o, gamma in zip(outlooks, gammas) if gamma)
            return gammas

        def timed_draft_plans(generations):
            start = time.perf_counter()
            plans = draft_plans(generations)
            step["draft"] = time.perf_counter() - start
            return plans

        def timed_verify_together(runner, generations, plans):
            start = time.perf_counter()
            rows = verify_together(runner, generations, plans)
            step["pass"] = time.perf_counter() - start
            step["positions"] = sum(len(p.feed) for p in plans)
            step["rows"], step["context"] = len(plans), sum(len(g.ids) for g in generations) // len(plans)
            costs = getattr(generations[0].policy, "costs", None)  # a `drafter=` variant's own c
            costs = costs if costs is not None and costs.target_seconds else self.costs  # plain decoding measures none
            step["predicted pass"] = costs.pass_cost(step["positions"], len(plans), step["context"])
            c = costs.draft_cost_ratio() or 0.0
            step["predicted draft"] = (sum((len(p.feed) - 1) * (0.0 if p.hint is not None and p.hint.free else c) for p in plans)
                                       + step.get("catching up", 0.0))
            return rows

        def timed_step_together(generations):
            step.clear()
            start = time.perf_counter()
            outcomes = step_together(generations)
            if "pass" in step:
                self.steps.append({**step, "step": time.perf_counter() - start})
            return outcomes

        prefill_step = Generation.prefill_step

        def timed_prefill_step(generation, *args, **kwargs):
            part = "draft" if generation._session_opened else "target"  # the target's prompt first, then the draft's
            start = time.perf_counter()
            done = prefill_step(generation, *args, **kwargs)
            self.prefill[part] += time.perf_counter() - start
            return done

        with (mock.patch.object(Generation, "prefill_step", timed_prefill_step),
              mock.patch.object(together, "draft_plans", timed_draft_plans),
              mock.patch.object(together, "size_together", priced_size_together),
              mock.patch.object(together, "verify_together", timed_verify_together),
              mock.patch.object(together, "step_together", timed_step_together)):
            yield self

    def report(self, one: float) -> str:
        """Measured against predicted, `one` the target's T(1) in seconds timed now: per bucket of pass widths the
        passes' seconds against their predicted T/T(1) × `one`; then a step's parts."""
        lines = []
        for low, high in zip(self.BUCKETS, self.BUCKETS[1:] + (10**9,)):
            passes = [s for s in self.steps if low <= s["positions"] < high]
            if passes:
                measured, predicted = sum(s["pass"] for s in passes), sum(s["predicted pass"] for s in passes) * one
                lines.append(f"    passes of {low}–{min(high - 1, max(s['positions'] for s in passes))} positions: {len(passes)},"
                             f" {sum(s['rows'] for s in passes) / len(passes):.1f} rows, measured {measured:.2f} s,"
                             f" predicted {predicted:.2f} s ({measured / predicted:.2f}×)")
        total = {part: sum(s[part] for s in self.steps) for part in ("step", "draft", "pass", "predicted pass", "predicted draft")}
        rest = total["step"] - total["draft"] - total["pass"]
        lines.append(f"    {len(self.steps)} steps {total['step']:.2f} s: drafting {total['draft']:.2f} s (predicted"
                     f" {total['predicted draft'] * one:.2f}), pass {total['pass']:.2f} s (predicted"
                     f" {total['predicted pass'] * one:.2f}), the rest {rest:.2f} s ({rest / len(self.steps) * 1e3:.1f} ms a step)")
        lines.append(f"    prefills outside the steps: the target's {self.prefill['target']:.2f} s, the draft's {self.prefill['draft']:.2f} s")
        return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", default="question.jsonl")
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-batch", default="4,8", help="comma list of requests stepped at once")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=0.0, help="sample unseeded at this temperature (0: greedy)")
    parser.add_argument("--variants", default="plan", help="comma list: plan, unsized, none, gamma=G, drafter=SPEC")
    parser.add_argument("--no-alone", action="store_true", help="skip one `generate` after another (and the comparison)")
    parser.add_argument("--ledger", action="store_true",
                        help="each batch's steps in parts, measured against `control/batch.py`'s prices")
    args = parser.parse_args()
    names = re.split(r",(?=plan\b|unsized\b|none\b|gamma=|drafter=)", args.variants)  # a drafter spec holds commas
    variants = {name: variant(name, args.max_new_tokens, args.temperature) for name in names}
    engine = load()
    print(cpu_summary(), "·", engine.plan.summary() if engine.plan is not None else "", flush=True)
    questions = [json.loads(line) for line in open(args.questions)]
    prompts = []
    for category in dict.fromkeys(q["category"] for q in questions):
        prompts += [q["turns"][0] for q in questions if q["category"] == category][: args.per_category]
    # a warm-up batch (it also measures the batch's pass costs the first time: `CostModel.pass_cost`), not timed, and
    # what sampled drafts need built, as a server builds it at start (`Drafter.prepare_sampling`)
    engine.generate_batch(prompts[:2], GenerationConfig(max_new_tokens=16), max_batch=2)
    if engine.drafter is not None:
        engine.drafter.prepare_sampling()
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
                ledger = Ledger(engine.costs)
                with mock.patch.object(together, "size_together", sizing), ledger.installed():
                    started = time.perf_counter()
                    results = engine.generate_batch(prompts, config, max_batch=k)
                    seconds = time.perf_counter() - started
                drafted = sum(r.stats.acceptance.proposed for r in results)
                kept = sum(r.stats.acceptance.accepted for r in results)
                line = (f"round {round_} · generate_batch(max_batch={k}) {name}: {sum(len(r.token_ids) for r in results) / seconds:.1f}"
                        f" tok/s ({seconds:.1f} s), {drafted} drafted, {kept} accepted")
                if alone is not None and name == next(iter(variants)) and not args.temperature:  # unseeded draws differ
                    line += f", {sum(a.token_ids == b.token_ids for a, b in zip(alone, results))}/{len(prompts)} the same tokens as alone"
                print(line, flush=True)
                if args.ledger and ledger.steps:
                    context = int(statistics.median(s["context"] for s in ledger.steps))
                    one = interleaved_token_seconds([engine.target.runner], context=context)[0]
                    print(f"    T(1) after {context} tokens, timed now: {one * 1e3:.1f} ms", flush=True)
                    print(ledger.report(one), flush=True)


if __name__ == "__main__":
    main()
