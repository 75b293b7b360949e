"""Benchmark records → summary metrics → Markdown tables and a JSON document.

A record is one timed generation (see `verispec.tools.bench.compare.measure`), or a (prompt, method)
that produced none: a record with an `error` (and `skipped`: true when the prompt did not fit the
method's context, false when the method raised). Those are listed in the report, not measured. Per
method, overall and per category:
  tokens_per_second        mean over prompts (median alongside);
  speedup                  mean tokens/s over the prompts the baseline also ran, divided by the
                           baseline's mean over them (Spec-Bench's definition); speedup_median_ratio:
                           median per prompt. The baseline is hf-plain when it ran, else llama-cpp,
                           else llama-cpp-fresh (`baseline_of`);
  identical_to_baseline    share of outputs token-for-token equal to the baseline's (None when sampled:
                           two correct samplers need not agree);
  identical_to_plain       for a speculative verispec method: share of outputs equal to plain decoding's on
                           the backend that ran it (a record's `backend`; the plain records are those
                           of a method without a drafter, `plain`), which exactness promises (100 %);
                           None when sampled or when no plain method ran on that backend;
  mean_accepted_length τ, acceptance_rate α, per_position_acceptance, mean_gamma γ̄: of the verispec
                           generations' acceptance counts merged (`AcceptanceStats`), as if one long
                           generation; cost_ratio c: mean over the generations;
  predicted_speedup        the theory's E[tokens](α, γ̄)/(γ̄·c + 1) from the run's own α, γ̄ and c: the
                           speedup over the target decoding alone, verification and prefill taken as free;
  cost_model_speedup       what the γ policy's measured costs predict for the steps the generations took
                           (`CostModel.speedup_of_steps`: T(n)/T(1) at each step's context, c per draft token),
                           their tokens over their predicted costs summed; prefill not counted (None: no costs);
  weights_mib, peak_extra_mib, memory_mib: see `verispec.tools.bench.memory`.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path

from verispec.control.theory import expected_speedup
from verispec.types import AcceptanceStats

__all__ = ["BASELINE", "baseline_of", "measured", "unmeasured", "summarize", "group_metrics", "markdown_report",
           "write_json"]

BASELINE = "hf-plain"
LLAMA_CPP_BASELINES = ("llama-cpp", "llama-cpp-fresh")


def baseline_of(method_names: Sequence[str]) -> str | None:
    """What speedups are measured against: hf-plain, else llama.cpp's plain decoding (llama-cpp, else
    llama-cpp-fresh; None: none of them ran)."""
    return next((name for name in (BASELINE, *LLAMA_CPP_BASELINES) if name in method_names), None)


def measured(records: list[dict]) -> list[dict]:
    """The records of generations that ran."""
    return [r for r in records if "error" not in r]


def unmeasured(records: list[dict]) -> list[dict]:
    """The records of (prompt, method) pairs that produced no generation: failed or skipped."""
    return [r for r in records if "error" in r]


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _mean_per_position(rows: list[list[float]]) -> list[float]:
    """Elementwise mean of ragged lists (position i over the rows that reach it)."""
    longest = max((len(r) for r in rows), default=0)
    return [statistics.fmean(r[i] for r in rows if len(r) > i) for i in range(longest)]


def _acceptance_metrics(stats: list[dict]) -> dict:
    """τ, α, acceptance per position and γ̄ of the generations' counts merged, as one long generation
    (`AcceptanceStats.from_dict`); records without the counts (written before they were recorded) by the
    mean of their rates."""
    if all("judged_tokens" in s for s in stats):
        merged = AcceptanceStats()
        for s in stats:
            merged.merge(AcceptanceStats.from_dict(s))
        return {"mean_accepted_length": merged.tau, "acceptance_rate": merged.alpha, "per_position_acceptance": merged.per_position,
                "mean_gamma": merged.proposed / merged.steps if merged.steps else None}
    return {
        "mean_accepted_length": _mean([s["mean_accepted_length"] for s in stats]),
        "acceptance_rate": _mean([s["acceptance_rate"] for s in stats]),
        "per_position_acceptance": _mean_per_position([s["per_position_acceptance"] for s in stats]),
        "mean_gamma": _mean([s["proposed_tokens"] / s["steps"] for s in stats if s.get("steps") and "proposed_tokens" in s]),
    }


def _draft_metrics(stats: list[dict]) -> dict:
    """τ, α, acceptance per position, c, γ̄ and the predicted speedup over verispec generations' stats."""
    metrics = _acceptance_metrics(stats) | {"cost_ratio": _mean([s["cost_ratio"] for s in stats])}
    alpha, gamma, c = metrics["acceptance_rate"], metrics["mean_gamma"], metrics["cost_ratio"]
    predicted = [(s["new_tokens"], s["cost_model_speedup"]) for s in stats if s.get("cost_model_speedup")]
    by_costs = sum(n for n, _ in predicted) / sum(n / speedup for n, speedup in predicted) if predicted else None
    return metrics | {"predicted_speedup": expected_speedup(min(alpha, 1.0), gamma, c) if gamma is not None else None,
                      "cost_model_speedup": by_costs}


def group_metrics(records: list[dict], baseline: dict[str, dict], sampled: bool = False,
                  plain: dict[tuple[str, str], dict] | None = None) -> dict:
    """Metrics over one method's `records`; `baseline` maps prompt name → the baseline's record, `plain`
    (prompt, backend) → a plain verispec record."""
    plain = plain or {}
    tps = [r["tokens_per_second"] for r in records]
    paired = [(r, baseline[r["prompt"]]) for r in records if r["prompt"] in baseline]
    with_plain = [(r, plain[r["prompt"], r["backend"]]) for r in records
                  if not r.get("plain") and (r["prompt"], r.get("backend")) in plain]
    base_mean = _mean([b["tokens_per_second"] for _, b in paired])
    extra = [r["peak_extra_mib"] for r in records if r.get("peak_extra_mib") is not None]
    metrics = {
        "n": len(records),
        "tokens_per_second": _mean(tps),
        "tokens_per_second_median": _median(tps),
        "speedup": _mean([r["tokens_per_second"] for r, _ in paired]) / base_mean if base_mean else None,
        "speedup_median_ratio": _median([r["tokens_per_second"] / b["tokens_per_second"]
                                         for r, b in paired if b["tokens_per_second"]]),
        "identical_to_baseline": None if sampled else _mean([float(r["token_ids"] == b["token_ids"]) for r, b in paired]),
        "identical_to_plain": None if sampled else _mean([float(r["token_ids"] == p["token_ids"]) for r, p in with_plain]),
        "new_tokens_mean": _mean([r["new_tokens"] for r in records]),
        "peak_extra_mib": max(extra) if extra else None,
    }
    stats = [r["stats"] for r in records if "stats" in r]
    if stats:
        metrics |= _draft_metrics(stats)
    return metrics


def summarize(records: list[dict], method_names: list[str], sampled: bool = False,
              weights_mib: dict[str, float] | None = None) -> dict[str, dict]:
    """Per method: overall metrics, memory, and `per_category`, for the methods that have measured records."""
    records = measured(records)
    baseline_name = baseline_of([name for name in method_names if any(r["method"] == name for r in records)])
    baseline = {r["prompt"]: r for r in records if r["method"] == baseline_name}
    plain = {(r["prompt"], r["backend"]): r for r in records if r.get("plain")}
    summary = {}
    for name in method_names:
        mine = [r for r in records if r["method"] == name]
        if not mine:
            continue
        categories = dict.fromkeys(r["category"] for r in mine)
        metrics = group_metrics(mine, baseline, sampled, plain)
        weights = (weights_mib or {}).get(name)
        metrics["weights_mib"] = weights
        metrics["memory_mib"] = weights + (metrics["peak_extra_mib"] or 0.0) if weights is not None else None
        metrics["per_category"] = {c: group_metrics([r for r in mine if r["category"] == c], baseline, sampled, plain)
                                   for c in categories}
        metrics["baseline"] = baseline_name
        summary[name] = metrics
    return summary


# --- Markdown ---------------------------------------------------------------------------------------

COLUMNS = [  # (header, metric key, format)
    ("n", "n", "{:d}"),
    ("tok/s median", "tokens_per_second_median", "{:.2f}"),
    ("tok/s mean", "tokens_per_second", "{:.2f}"),
    ("speedup", "speedup", "{:.2f}×"),
    ("speedup (median ratio)", "speedup_median_ratio", "{:.2f}×"),
    ("predicted", "predicted_speedup", "{:.2f}×"),
    ("predicted (costs)", "cost_model_speedup", "{:.2f}×"),
    ("identical", "identical_to_baseline", "{:.0%}"),
    ("= plain", "identical_to_plain", "{:.0%}"),
    ("τ", "mean_accepted_length", "{:.2f}"),
    ("α", "acceptance_rate", "{:.2f}"),
    ("c", "cost_ratio", "{:.3f}"),
    ("γ̄", "mean_gamma", "{:.2f}"),
    ("memory MiB", "memory_mib", "{:.0f}"),
    ("per-position acceptance", "per_position_acceptance", None),
]


def _cell(value, fmt: str | None, missing: str = "–") -> str:
    if value is None:
        return missing
    if fmt is None:
        return " ".join(f"{x:.2f}" for x in value) or "–"
    return fmt.format(value)


def _table(rows: list[tuple[list[str], dict]], key_headers: list[str], sampled: bool) -> str:
    headers = key_headers + [h for h, _, _ in COLUMNS]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for keys, metrics in rows:
        cells = keys + [_cell(metrics.get(key), fmt, "n/a" if sampled and key.startswith("identical") else "–")
                        for _, key, fmt in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _unmeasured_table(records: Sequence[dict]) -> str:
    lines = ["| method | prompt | outcome | reason |", "|---|---|---|---|"]
    for r in records:
        reason = " ".join(r["error"].split()).replace("|", "\\|")  # one table row, whatever the message holds
        lines.append(f"| {r['method']} | {r['prompt']} | {'skipped' if r['skipped'] else 'failed'} | {reason} |")
    return "\n".join(lines)


def markdown_report(summary: dict[str, dict], config: dict, unmeasured_records: Sequence[dict] = ()) -> str:
    """The head line, the overall and per-category tables and, if any, the table of what was not measured."""
    temperature = config.get("temperature", 0.0)
    sampled = temperature > 0
    mode = f"sampled at temperature {temperature}" if sampled else "greedy"
    head = (f"target {config['target']}, draft {config['draft']}, --dtype {config['dtype']} (methods without their own), {mode}, "
            f"≤{config['max_new_tokens']} new tokens, {config['measured_prompts']} prompts")
    if config.get("process_peak_rss_mib") is not None:
        head += f", process peak RSS {config['process_peak_rss_mib']:.0f} MiB"
    if config.get("cpu"):
        head += f", on {config['cpu']}"
    baseline = next((m.get("baseline") for m in summary.values() if m.get("baseline")), None)
    if baseline:
        head += f"; speedup and identical are against {baseline}; = plain: against plain decoding on the same backend"
    if config.get("interrupted"):
        head += " — INTERRUPTED: partial results"
    overall = _table([([name], m) for name, m in summary.items()], ["method"], sampled)
    per_category = _table(
        [([name, cat], m) for name, s in summary.items() for cat, m in s["per_category"].items()],
        ["method", "category"], sampled,
    )
    report = f"{head}\n\n## Overall\n\n{overall}\n\n## Per category\n\n{per_category}\n"
    if unmeasured_records:
        report += f"\n## Not measured\n\n{_unmeasured_table(unmeasured_records)}\n"
    return report


def write_json(path: Path, config: dict, summary: dict[str, dict], records: list[dict]) -> None:
    """{"config": …, "methods": {name: metrics with per_category}, "runs": [every record]}, written whole
    or not at all (through a temporary file beside it), so a run killed while writing keeps the last copy."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({"config": config, "methods": summary, "runs": records}, indent=1, ensure_ascii=False))
    partial.replace(path)
