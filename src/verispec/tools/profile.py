"""`verispec analyze --profile`: where each millisecond of a decoding step goes, per drafter, on one backend.

    verispec analyze --profile --target qwen2.5-coder-1.5b-instruct --dtype gguf --methods none,ngram,model
    verispec analyze --profile --dtype int8 --methods none,model --questions humaneval,mt_bench.jsonl --per-category 2

Each method (a drafter spec over the chosen target and backend) decodes the prompts greedily,
interleaved (every method on a prompt before the next prompt, the order rotating, so a drift in the
machine's speed reaches every method alike), and each step's time is split into the phases the engine records
(`GenerationStats.PHASES`: the draft, the target's forward, verification with its processors, the
cache and drafter commit, statistics and the γ policy, detokenization with stop strings) and what is
left (the loop around them). The table gives milliseconds per step, then per token, τ, and the
speedup over the plain row: measured, and predicted by the cost model from the measured α, c, T(n) (measured
after the steps' mean context: verifying n positions attends n times the context, so a curve taken after 64
tokens understates long prompts) and a draft model's T_d(2)/T_d(1) (its catching-up forward:
`theory.draft_step_cost`), with and without the per-step work outside the forwards. A line above it
sets the target's forwards as the steps met them (median seconds per width) beside that curve: where
measured and predicted part, it says whether the costs or the acceptance model are off.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field

from verispec.types import GenerationStats

__all__ = ["MethodProfile", "profile_method", "format_profile", "format_loop_curve", "run_profile"]


@dataclass
class MethodProfile:
    """One method's decoding time over the prompts, phase by phase (prefill excluded)."""

    method: str
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0  # wall time of the steps
    phases: dict[str, float] = field(default_factory=dict)
    proposed: int = 0
    accepted: int = 0
    judged: int = 0
    widths: list[int] = field(default_factory=list)  # draft tokens proposed at each step
    free: list[bool] = field(default_factory=list)  # at each step: proposed by no draft model's forward (prompt lookup)
    contexts: list[int] = field(default_factory=list)  # tokens before each step (the verification's context)
    forwards: dict[int, list[float]] = field(default_factory=dict)  # positions n a step verified -> its target seconds

    def add(self, stats: GenerationStats, seconds: float, before: dict[str, float]) -> None:
        """A request's steps: its statistics, their wall time and the phases recorded before the steps
        (the first token's, made by the prefill)."""
        self.steps += stats.steps - 1  # the first token came from the prefill, recorded as a step of its own
        self.tokens += stats.new_tokens - 1
        self.seconds += seconds
        for phase in GenerationStats.PHASES:
            self.phases[phase] = self.phases.get(phase, 0.0) + stats.phases.get(phase, 0.0) - before.get(phase, 0.0)
        self.proposed += stats.proposed_tokens
        self.accepted += stats.accepted_tokens
        self.judged += stats.judged_tokens
        self.widths += [record.proposed for record in stats.records[1:]]  # records[0]: the prefill's first token
        self.free += [record.free for record in stats.records[1:]]
        context = stats.prompt_tokens + 1  # each step's context: the prompt, the prefill's token, then each step's
        for record in stats.records[1:]:
            self.contexts.append(context)
            context += record.accepted + 1
            positions = 1 + (record.proposed if record.width is None else record.width)
            self.forwards.setdefault(positions, []).append(record.target_seconds)

    @property
    def other(self) -> float:
        """Seconds of the steps outside every recorded phase."""
        return self.seconds - sum(self.phases.values())

    @property
    def overhead(self) -> float:
        """Seconds per step outside the target's forward and the draft: what the classic cost model omits."""
        return (self.seconds - self.phases.get("target", 0.0) - self.phases.get("draft", 0.0)) / max(self.steps, 1)

    @property
    def alpha(self) -> float:
        return self.accepted / self.judged if self.judged else 0.0

    @property
    def tau(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0


def profile_method(engine, method: str, prompts: list[list[int]], max_new_tokens: int,
                   into: MethodProfile | None = None) -> MethodProfile:
    """Decode each prompt greedily with `engine` and account for every step's time (added to `into`
    when given)."""
    from verispec.engine import GenerationConfig

    profile = into or MethodProfile(method)
    for ids in prompts:
        generation = engine.start(ids, GenerationConfig(max_new_tokens=max_new_tokens, chat=False))
        before = dict(generation.stats.phases)
        start = time.perf_counter()
        while not generation.done:
            generation.step()
        profile.add(generation.stats, time.perf_counter() - start, before)
    return profile


def format_profile(rows: list[MethodProfile], curve: list[float], draft_seconds: dict[str, float],
                   catch_ups: dict[str, float] | None = None) -> str:
    """A Markdown table: ms per step for each phase, ms per token, τ, α, measured and predicted speedup
    over the first row (plain decoding), from the target's curve T(n) and each method's draft cost
    (seconds per token, and its draft model's T_d(2)/T_d(1) in `catch_ups`: `theory.draft_step_cost`; a step proposed
    by prompt lookup, `hybrid`'s, drafts for nothing): with the tokens and widths the steps took (what the costs
    alone predict), then with E[tokens] from α at each step's γ (what the plan predicts), then with the per-step
    work outside the forwards."""
    from verispec.control.theory import curve_verify_cost, draft_step_cost, expected_tokens

    verify = curve_verify_cost(curve)
    plain = rows[0]
    plain_token = plain.seconds / max(plain.tokens, 1)
    plain_overhead = plain.overhead / curve[0]  # per-step work of plain decoding, in T(1)
    headers = ["method", "steps", *GenerationStats.PHASES, "other", "ms/step", "ms/token", "τ", "α",
               "speedup", "predicted (steps as taken)", "predicted (forwards only)", "predicted (+ per-step work)"]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        per_step = [1e3 * row.phases.get(phase, 0.0) / max(row.steps, 1) for phase in GenerationStats.PHASES]
        c, catch_up = draft_seconds.get(row.method, 0.0) / curve[0], (catch_ups or {}).get(row.method, 1.0)
        widths = row.widths or [0]  # each step's draft length: the model's terms averaged over the steps taken
        drafting = [draft_step_cost(row.alpha, g, 0.0 if free else c, catch_up)
                    for g, free in zip(widths, row.free or [True])]
        step_cost = (sum(drafting) + sum(map(verify, widths))) / len(widths)  # in T(1)
        tokens = sum(expected_tokens(row.alpha, g) for g in widths) / len(widths)
        forwards = tokens / step_cost
        taken = sum(drafting) + sum(len(seconds) * verify(n - 1) for n, seconds in row.forwards.items())  # as verified
        as_taken = row.tokens / taken if taken else 1.0
        honest = tokens * (1 + plain_overhead) / (step_cost + row.overhead / curve[0])
        cells = [row.method, str(row.steps), *(f"{ms:.2f}" for ms in per_step),
                 f"{1e3 * row.other / max(row.steps, 1):.2f}", f"{1e3 * row.seconds / max(row.steps, 1):.2f}",
                 f"{1e3 * row.seconds / max(row.tokens, 1):.2f}", f"{row.tau:.2f}", f"{row.alpha:.2f}",
                 f"{plain_token / (row.seconds / max(row.tokens, 1)):.3f}×", f"{as_taken:.3f}×", f"{forwards:.3f}×",
                 f"{honest:.3f}×"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_loop_curve(rows: list[MethodProfile], curve: list[float], least_steps: int = 5) -> str:
    """The target's forwards as the steps met them: for each width n that `least_steps` or more steps
    verified, the median seconds of their target phase over plain decoding's median (n = 1), next to the
    measured curve's T(n)/T(1) in parentheses. Where the two part, the cost model mispredicts."""
    loop: dict[int, list[float]] = {}
    for row in rows:
        for positions, seconds in row.forwards.items():
            loop.setdefault(positions, []).extend(seconds)
    if 1 not in loop:
        return "the steps' target forwards: no plain step to compare with"
    one = statistics.median(loop[1])
    cells = [f"{n}: {statistics.median(loop[n]) / one:.2f} ({curve[n - 1] / curve[0]:.2f})"
             for n in sorted(loop) if len(loop[n]) >= least_steps and n <= len(curve)]
    return (f"the steps' target forwards, median T(n)/T(1) in the loop (T(1) {1e3 * one:.1f} ms) and (the curve's): "
            + ", ".join(cells))


def run_profile(args: argparse.Namespace) -> int:
    """`analyze --profile`: load the target once, profile each method in `--methods`, print the table."""
    from verispec.control.costs import CostModel, measure_verify_curve
    from verispec.drafters.specs import split_specs
    from verispec.engine.build import EngineBuilder, auto_precision
    from verispec.engine.spec import AUTO
    from verispec.errors import InvalidParameterError
    from verispec.models.registry import DEFAULT_TARGET
    from verispec.paths import cpu_summary
    from verispec.tools.bench.questions import encoded_prompts

    methods = split_specs(args.methods)
    if not methods or methods[0] != "none":
        methods = ["none", *[m for m in methods if m != "none"]]  # plain decoding: the row the others compare with
    if args.max_new_tokens < 1:
        raise InvalidParameterError("--max-new-tokens must be ≥ 1")
    target_spec = args.target or DEFAULT_TARGET
    precision = auto_precision(target_spec, args.device) if args.dtype == AUTO else args.dtype
    builder = EngineBuilder(target_spec, precision, default_draft=args.draft, device=args.device)
    target = builder.target()
    prompts = encoded_prompts(target, args.questions, args.per_category)
    where = cpu_summary() if target.device.type == "cpu" else f"{target.device} (phases are host time: a GPU runs behind it)"
    print(f"{where} · {target.name} · {target.precision} · {len(prompts)} prompts · {args.max_new_tokens} new tokens, greedy")
    engines, draft_seconds, catch_ups, curve = {}, {}, {}, None
    for method in methods:
        engine = engines[method] = builder.engine(method, args.gamma, args.gamma_policy)
        costs = engine.costs_for(engine.drafter, "analytic") if engine.drafter is not None else CostModel()
        if costs.target_seconds:
            curve = curve or costs.target_seconds
            draft_seconds[method], catch_ups[method] = costs.draft_token_seconds or 0.0, costs.draft_catch_up
        profile_method(engine, method, prompts[:1], min(8, args.max_new_tokens))  # warm-up: first-call costs stay out
    rows = [MethodProfile(method) for method in methods]
    for index, prompt in enumerate(prompts):
        for k in range(len(rows)):  # every method on this prompt, the order rotating from prompt to prompt
            row = rows[(index + k) % len(rows)]
            profile_method(engines[row.method], row.method, [prompt], args.max_new_tokens, into=row)
    for row in rows:
        print(f"  {row.method}: {row.tokens} tokens in {row.seconds:.2f} s", flush=True)
    if curve is None:  # plain decoding only: the curve is still what the prediction needs
        curve = CostModel.calibrated(target, builder.engine("none").max_gamma + 1).target_seconds
    print(f"target T(n)/T(1), n = 1…{len(curve)}, as the plan measured it after 64 tokens: "
          + " ".join(f"{t / curve[0]:.2f}" for t in curve) + f" (T(1) {1e3 * curve[0]:.1f} ms)")
    # verifying n positions attends n times the context: the prediction takes the curve at the steps' mean context
    contexts = [n for row in rows for n in row.contexts]
    context = round(sum(contexts) / len(contexts)) if contexts else 64
    cached, curve = curve, measure_verify_curve(target.runner, len(curve), context=context, repeats=5)
    draft_seconds = {method: seconds * curve[0] / cached[0] for method, seconds in draft_seconds.items()}  # c as cached
    print(f"… and now after {context} tokens (the steps' mean context; the predictions use it): "
          + " ".join(f"{t / curve[0]:.2f}" for t in curve) + f" (T(1) {1e3 * curve[0]:.1f} ms)")
    drafts = ", ".join(f"{method} {catch_up:.2f}" for method, catch_up in catch_ups.items() if draft_seconds[method])
    if drafts:
        print(f"draft models' T_d(2)/T_d(1) (the catching-up forward): {drafts}")
    print(format_loop_curve(rows, curve))
    print("milliseconds per step (phases of `GenerationStats.phases`; other: the loop around them):\n")
    print(format_profile(rows, curve, draft_seconds, catch_ups))
    return 0
