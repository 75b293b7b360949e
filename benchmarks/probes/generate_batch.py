"""`Engine.generate_batch` against one `generate` after another: the same public prompts, the same engine (the plan's,
`load()`), in turns; tok/s of each and whether every result is the same tokens.

Throughput of a script with many prompts: k requests stepped together share the target's pass (and the draft's), so
they decode faster than one after the other; each result must still be what `generate` gives that prompt alone.
`--variants` adds other settings to each batch size, in turns: `unsized` (each request at its own γ, as alone: no
`control/batch.size_together`), `none` (plain decoding), `gamma=G` (a constant γ of G), `drafter=SPEC` (another
drafter, its γ sized as the plan's). `--ledger` holds each batch's steps against the prices γ was sized by
(`StepAccount`): the shared passes' seconds against `CostModel.pass_cost` by width, the drafting against γ·c and the
draft model's catching up, and what neither holds (verification, commits, per-request work on the host).
`--temperature T` samples every request at T without a seed (a server's usual sampled traffic: sized for the batch
like greedy ones).

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
from verispec.engine.together import StepAccount
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
    """Each step taken together, in its parts and priced as `control/batch.py` prices it (`StepAccount`; a plain
    step, which no policy prices, on the plan's costs), and the requests' prefills (the target's, then the draft
    model's). Installed by patching `engine/together.py`'s `step_together` and `Generation.prefill_step`."""

    BUCKETS = (1, 9, 17, 25, 33, 49, 65)  # pass widths (positions) reported apart: a bucket from each to the next

    def __init__(self, costs):
        self.costs, self.steps = costs, []  # the plan's (where a step's policy prices none); per step its StepAccount
        self.prefill = {"target": 0.0, "draft": 0.0}  # seconds of the requests' prefills, outside the steps

    @contextlib.contextmanager
    def installed(self):
        step_together, prefill_step = together.step_together, Generation.prefill_step

        def accounted_step_together(generations, account=None):
            account = StepAccount()
            outcomes = step_together(generations, account)
            if account.rows:
                if account.priced_pass is None:  # plain decoding or a constant γ: priced on the plan's costs
                    drafted = account.positions - account.rows
                    account.priced_drafting = (self.costs.draft_cost_ratio() or 0.0) * drafted * self.costs.one_seconds()
                    account.priced_pass = account.pass_price(self.costs)
                self.steps.append(account)
            return outcomes

        def timed_prefill_step(generation, *args, **kwargs):
            part = "draft" if generation._session_opened else "target"  # the target's prompt first, then the draft's
            start = time.perf_counter()
            done = prefill_step(generation, *args, **kwargs)
            self.prefill[part] += time.perf_counter() - start
            return done

        with (mock.patch.object(Generation, "prefill_step", timed_prefill_step),
              mock.patch.object(together, "step_together", accounted_step_together)):
            yield self

    def report(self, one: float) -> str:
        """Measured against priced, the prices rescaled to `one`, the target's T(1) in seconds timed now after the
        steps' median context (what the machine's drift since the costs were measured leaves out): per bucket of pass
        widths the passes' seconds, then a step's parts."""
        context = int(statistics.median(s.context for s in self.steps))
        scale = one / self.costs.one_seconds(context)
        lines = [f"    T(1) after {context} tokens, timed now: {one * 1e3:.1f} ms (×{scale:.2f} the costs' own)"]
        for low, high in zip(self.BUCKETS, self.BUCKETS[1:] + (10**9,)):
            passes = [s for s in self.steps if low <= s.positions < high]
            if passes:
                measured, predicted = sum(s.target_pass for s in passes), sum(s.priced_pass for s in passes) * scale
                lines.append(f"    passes of {low}–{min(high - 1, max(s.positions for s in passes))} positions: {len(passes)},"
                             f" {sum(s.rows for s in passes) / len(passes):.1f} rows, measured {measured:.2f} s,"
                             f" predicted {predicted:.2f} s ({measured / predicted:.2f}×)")
        total = {part: sum(getattr(s, part) for s in self.steps)
                 for part in ("total", "drafting", "target_pass", "priced_drafting", "priced_pass")}
        rest = total["total"] - total["drafting"] - total["target_pass"]
        lines.append(f"    {len(self.steps)} steps {total['total']:.2f} s: drafting {total['drafting']:.2f} s (predicted"
                     f" {total['priced_drafting'] * scale:.2f}), pass {total['target_pass']:.2f} s (predicted"
                     f" {total['priced_pass'] * scale:.2f}), the rest {rest:.2f} s ({rest / len(self.steps) * 1e3:.1f} ms a step)")
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
                    context = int(statistics.median(s.context for s in ledger.steps))
                    print(ledger.report(interleaved_token_seconds([engine.target.runner], context=context)[0]), flush=True)


if __name__ == "__main__":
    main()
