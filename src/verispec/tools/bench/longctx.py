"""Long-context tasks and a measurement of TriForce against plain and single-level speculation.

Documents are generated deterministically (no downloads): paragraphs of a made-up field report,
composed from fixed word lists by a seeded RNG, with numbered facts ("the access code of vault 7
is 4821") inserted at spread-out places; each document gets a summary prompt and a question about
one fact. `python -m verispec.tools.bench.longctx --lengths 1024,2048 --max-new-tokens 32` decodes each
task with plain decoding, the draft model with a full cache, and the TriForce drafter, and prints
decode tokens/s, speedups, α and peak memory per context length; `--out DIR` keeps the rows
(rows.json) and plots them (longctx-<task>.png).
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

from verispec.tools.bench.memory import PeakMeter
from verispec.engine import Engine, EngineBuilder, GenerationConfig
from verispec.models.runner import LoadedModel
from verispec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET
from verispec.paths import cpu_summary

__all__ = ["LongTask", "make_document", "make_tasks", "measure", "main"]

SUBJECTS = ["The survey team", "The harbour office", "Our night crew", "The archive committee", "A visiting engineer"]
VERBS = ["inspected", "recorded", "repaired", "catalogued", "measured", "questioned"]
OBJECTS = ["the northern pumps", "the salt ledgers", "the signal towers", "the tide gauges", "the grain silos"]
DETAILS = [
    "after a long delay caused by the storm", "with help from the river pilots", "before the winter market opened",
    "while the old bridge was closed", "using the borrowed instruments", "despite a shortage of lamp oil",
]
FACT = "Note for the record: the access code of vault {n} is {code}."


@dataclass(frozen=True)
class LongTask:
    kind: str  # "summary" or "question"
    prompt: str
    answer: str | None  # the fact asked for, for question tasks


def _paragraph(rng: random.Random) -> str:
    sentences = [f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(DETAILS)}." for _ in range(5)]
    return " ".join(sentences)


def make_document(tokens: int, tokenizer, seed: int = 0, facts: int = 8) -> tuple[str, dict[int, str]]:
    """A document of about `tokens` tokens (under the tokenizer) and its facts {vault: code}."""
    rng = random.Random(seed)
    codes = {n: f"{rng.randrange(1000, 10000)}" for n in range(1, facts + 1)}
    paragraphs: list[str] = []
    length = 0
    while length < tokens:
        paragraph = _paragraph(rng)
        paragraphs.append(paragraph)
        length += len(tokenizer(paragraph + "\n\n")["input_ids"])
    step = max(1, len(paragraphs) // facts)
    for i, (n, code) in enumerate(codes.items()):
        at = min(len(paragraphs) - 1, i * step + rng.randrange(step))
        paragraphs[at] += " " + FACT.format(n=n, code=code)
    return "\n\n".join(paragraphs), codes


def make_tasks(tokens: int, tokenizer, seed: int = 0) -> list[LongTask]:
    document, codes = make_document(tokens, tokenizer, seed)
    vault = sorted(codes)[len(codes) // 2]
    return [
        LongTask("summary", f"{document}\n\nSummarize the report above in three sentences.", None),
        LongTask("question", f"{document}\n\nWhat is the access code of vault {vault}? Answer with the number.", codes[vault]),
    ]


def measure(target: LoadedModel, drafters: dict, task: LongTask, max_new_tokens: int, gamma: int) -> dict[str, dict]:
    """Greedy decode of one task with each drafter (None = plain); one row of numbers per method."""
    rows = {}
    for name, drafter in drafters.items():
        engine = Engine(target, drafter, gamma=gamma, gamma_policy="constant")
        with PeakMeter() as meter:
            result = engine.generate(task.prompt, GenerationConfig(max_new_tokens=max_new_tokens))
        stats = result.stats
        decode_seconds = stats.wall_seconds - stats.prefill_seconds
        rows[name] = {
            "prompt_tokens": stats.prompt_tokens,
            "new_tokens": stats.new_tokens,
            "decode_tok_s": round(stats.new_tokens / decode_seconds, 3) if decode_seconds > 0 else 0.0,
            "prefill_s": round(stats.prefill_seconds, 2),
            "acceptance_rate": round(stats.acceptance_rate, 3),
            "tau": round(stats.mean_accepted_length, 3),
            "peak_extra_mib": None if meter.extra_mib is None else round(meter.extra_mib, 1),
            "token_ids": result.token_ids,
        }
    return rows


def _speedups(rows: dict[str, dict]) -> None:
    for row in rows.values():
        for base in ("plain", "model"):
            if base in rows and rows[base]["decode_tok_s"]:
                row[f"speedup_vs_{base}"] = round(row["decode_tok_s"] / rows[base]["decode_tok_s"], 3)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,2048,4096", help="document lengths in tokens, comma-separated")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    parser.add_argument("--triforce", default="triforce:budget=256,chunk=16,window=128", help="triforce drafter spec")
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--tasks", default="question", help="summary, question or both (comma-separated)")
    parser.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    parser.add_argument("--out", type=Path, default=Path("bench-results/longctx"), help="where rows.json and longctx-<task>.png go")
    args = parser.parse_args(argv)

    builder = EngineBuilder(args.target, default_draft=args.draft)  # the draft model is loaded once, for both drafters
    target = builder.target()
    drafters = {"plain": None, "model": builder.drafter(f"model:{args.draft}"), "triforce": builder.drafter(args.triforce)}
    kinds = set(args.tasks.split(","))
    records = []
    print(f"on {cpu_summary()}")
    print(f"{'len':>6} {'task':9} {'method':9} {'tok/s':>7} {'×plain':>7} {'×model':>7} {'α':>6} {'τ':>5} {'prefill s':>9} {'peak MiB':>9} same")
    for length in (int(x) for x in args.lengths.split(",")):
        for task in make_tasks(length, target.tokenizer):
            if task.kind not in kinds:
                continue
            rows = measure(target, drafters, task, args.max_new_tokens, args.gamma)
            _speedups(rows)
            reference = rows["plain"]["token_ids"]
            for name, row in rows.items():
                row["same_as_plain"] = row.pop("token_ids") == reference
                records.append({"length": length, "task": task.kind, "method": name, **row})
                if args.json:
                    print(json.dumps(records[-1]))
                else:
                    print(f"{row['prompt_tokens']:>6} {task.kind:9} {name:9} {row['decode_tok_s']:>7.2f} "
                          f"{row.get('speedup_vs_plain', 1.0):>7.2f} {row.get('speedup_vs_model', 0.0):>7.2f} "
                          f"{row['acceptance_rate']:>6.2f} {row['tau']:>5.2f} {row['prefill_s']:>9.1f} "
                          f"{row['peak_extra_mib'] if row['peak_extra_mib'] is not None else '-':>9} {row['same_as_plain']}", flush=True)
    _save(records, vars(args), args.out)


def _save(records: list[dict], args: dict, folder: Path) -> None:
    from verispec.tools.bench.plots import long_context_plot

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "rows.json").write_text(json.dumps({"args": {k: str(v) for k, v in args.items()}, "rows": records}, indent=1))
    if records:
        for kind in dict.fromkeys(r["task"] for r in records):
            long_context_plot([r for r in records if r["task"] == kind], folder / f"longctx-{kind}.png")
    print(f"rows and plots in {folder}")


if __name__ == "__main__":
    main()
