"""`verispec design`: which draft to build for a target — measure candidate drafts, rank by predicted speedup.

Decoding Speculative Decoding (Yan et al., 2024) found that a draft's latency matters more than its
accuracy: a draft twice as fast that is accepted a little less often wins. So for each candidate
draft (a drafter spec naming one draft model: the shipped 0.5B, the target's first L layers, the
0.5B with its head cut to the first N token ids, int8, fewer layers — see `verispec.drafters.derived`)
this measures, on the target's own greedy continuations of the prompts:

- α: greedy agreement (temperature 0) or probability overlap at the temperature
  (`verispec.tools.measure.position_acceptance`),
- the seconds of one single-token draft forward, and c = that / the target's T(1),

then ranks the candidates by `control.theory.expected_speedup` at `control.theory.optimal_gamma`, with the
target's measured verification cost curve T(n)/T(1) (`control.costs.measure_verify_curve`).

    verispec design --questions own --per-category 1 --max-new-tokens 64
    verispec design --candidate model --candidate self:layers=8 --candidate model:vocab=32768
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from verispec.control.theory import curve_verify_cost, expected_speedup, expected_tokens, optimal_gamma
from verispec.control.costs import measure_verify_curve
from verispec.drafters import DraftModelDrafter, make_drafter
from verispec.engine import Engine, EngineSpec, GenerationConfig
from verispec.errors import InvalidParameterError
from verispec.models.loading import ModelCache
from verispec.models.runner import LoadedModel
from verispec.tools.measure import position_acceptance
from verispec.progress import status

__all__ = ["DEFAULT_CANDIDATES", "CandidateResult", "design", "format_ranking", "add_arguments", "run"]

DEFAULT_CANDIDATES = ("model:int8=0", "model:int8=1", "model:vocab=32768,int8=0", "model:vocab=32768,int8=1",
                      "model:layers=12,int8=1", "self:layers=4", "self:layers=8", "self:layers=14")


@dataclass
class CandidateResult:
    spec: str
    alpha: float  # the α the ranking uses: greedy agreement, or overlap at the temperature
    draft_seconds: float  # one single-token draft forward
    c: float
    gamma: int  # the optimal γ for this α and c with the measured verification cost
    expected_tokens: float  # τ predicted at that γ
    speedup: float  # predicted, over plain decoding of the target


def _draft_model(spec: str, target: LoadedModel, models: ModelCache) -> LoadedModel:
    drafter = make_drafter(spec, target, load=models)
    if not isinstance(drafter, DraftModelDrafter):
        raise InvalidParameterError(f"candidate {spec!r} is not a single draft model: use model[:…] or self[:…] specs")
    return drafter.model


def design(target: LoadedModel, specs: Sequence[str], prompts_ids: Sequence[list[int]], max_new_tokens: int = 64,
           temperature: float = 0.0, max_gamma: int = 8) -> list[CandidateResult]:
    """Measure every candidate on the target's greedy continuations of `prompts_ids`; best predicted speedup first."""
    if not specs:
        raise InvalidParameterError("give at least one candidate draft spec")
    if not prompts_ids:
        raise InvalidParameterError("measuring α needs at least one prompt")
    if temperature < 0 or max_new_tokens < 1 or max_gamma < 1:
        raise InvalidParameterError("need temperature ≥ 0, max_new_tokens ≥ 1 and max_gamma ≥ 1")
    plain = Engine(target, None)
    with status("the target's continuations and verification costs"):
        continuations = [plain.generate(ids, GenerationConfig(max_new_tokens=max_new_tokens)).token_ids for ids in prompts_ids]
        target_curve = measure_verify_curve(target.runner, max_gamma + 1)  # T(n) seconds, n = 1 … γmax+1
    verify_cost = curve_verify_cost(target_curve)
    models = ModelCache(target)  # candidates over the same draft model load it once per precision
    results = []
    for spec in specs:
        with status(f"measuring candidate {spec}"):
            draft = _draft_model(spec, target, models)
            alphas = []
            for ids, continuation in zip(prompts_ids, continuations):
                overlap, matches = position_acceptance(target, draft, list(ids), list(continuation), max(temperature, 1e-6))
                alphas += matches if temperature == 0 else overlap
            draft_seconds = measure_verify_curve(draft.runner, 1)[0]
        alpha, c = statistics.fmean(alphas) if alphas else 0.0, draft_seconds / target_curve[0]
        gamma = optimal_gamma(alpha, c, max_gamma, verify_cost)
        results.append(CandidateResult(spec, alpha, draft_seconds, c, gamma, expected_tokens(alpha, gamma),
                                       expected_speedup(alpha, gamma, c, verify_cost)))
    return sorted(results, key=lambda r: r.speedup, reverse=True)


def format_ranking(results: Sequence[CandidateResult]) -> str:
    """A Markdown table, best predicted speedup first."""
    lines = ["| rank | candidate | α | draft ms/token | c | γ* | E[tokens] | predicted speedup |", "|" + "---|" * 8]
    for rank, r in enumerate(results, 1):
        lines.append(f"| {rank} | `{r.spec}` | {r.alpha:.3f} | {r.draft_seconds * 1e3:.1f} | {r.c:.3f} | {r.gamma} "
                     f"| {r.expected_tokens:.2f} | {r.speedup:.2f}× |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EngineSpec.add_arguments(parser, EngineSpec(dtype="float32"), names=("target", "dtype"))
    parser.add_argument("--candidate", action="append", default=None, metavar="SPEC",
                        help=f"a draft spec to measure (repeatable; default: {' '.join(DEFAULT_CANDIDATES)})")
    parser.add_argument("--questions", "--prompts", dest="questions", default="own",
                        help="prompt sources as for `verispec bench`: own, humaneval, JSONL files (default own)")
    parser.add_argument("--per-category", type=int, default=1, help="prompts per category (default 1)")
    parser.add_argument("--max-prompts", type=int, default=3, help="measure on at most this many prompts (default 3)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-gamma", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy agreement as α; > 0: overlap at T")
    parser.add_argument("--json", action="store_true", help="print the ranking as JSON")


def run(args: argparse.Namespace) -> int:
    import json

    from verispec.tools.bench.questions import load_sources, select
    from verispec.models.loading import load_model

    prompts = select(load_sources(args.questions), None, args.per_category)[: args.max_prompts]
    target = load_model(args.target, args.dtype)
    prompts_ids = [target.encode_prompt(p.text, chat=True) for p in prompts]
    results = design(target, args.candidate or DEFAULT_CANDIDATES, prompts_ids, args.max_new_tokens,
                     args.temperature, args.max_gamma)
    print(json.dumps([asdict(r) for r in results], indent=1) if args.json else format_ranking(results))
    return 0
