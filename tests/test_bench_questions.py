"""Prompt sources for the benchmark: question files, MT-bench grouping, HumanEval, selection."""

import json

import pytest

from verispec.tools.bench.prompts import CATEGORIES, PROMPTS
from verispec.tools.bench.questions import HUMANEVAL_INSTRUCTION, load_humaneval, load_questions, load_sources, select
from verispec.errors import InvalidParameterError


def _write(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["Write a haiku about rain.", "Now make it sadder."]},
    {"question_id": 101, "category": "reasoning", "turns": ["Who is taller?"]},
    {"question_id": 131, "category": "extraction", "turns": ["List the names."]},
    {"question_id": 200, "category": "translation", "turns": ["Translate: bonjour"]},
    {"question_id": 300, "category": "rag", "turns": ["Context: … Question: …"]},
]


def test_load_questions_first_turn_and_mt_bench_group(tmp_path):
    prompts = load_questions(_write(tmp_path / "q.jsonl", QUESTIONS + [""]))  # a trailing blank line is fine
    assert [p.category for p in prompts] == ["mt_bench", "mt_bench", "mt_bench", "translation", "rag"]
    assert prompts[0].text == "Write a haiku about rain."
    assert prompts[0].name == "writing-81"


@pytest.mark.parametrize("bad, message", [
    ("{not json", "line 2: not valid JSON"),
    ('{"question_id": 5, "turns": ["x"]}', "line 2: missing category"),
    ('{"question_id": 5, "category": "qa", "turns": []}', "line 2: `turns`"),
    ("[1, 2]", "line 2: expected a JSON object"),
])
def test_malformed_line_names_the_line(tmp_path, bad, message):
    file = _write(tmp_path / "bad.jsonl", [QUESTIONS[0], bad])
    with pytest.raises(InvalidParameterError, match=message) as err:
        load_questions(file)
    assert str(file) in str(err.value)


def test_missing_or_empty_file(tmp_path):
    with pytest.raises(InvalidParameterError, match="does not exist"):
        load_questions(tmp_path / "nope.jsonl")
    with pytest.raises(InvalidParameterError, match="no questions"):
        load_questions(_write(tmp_path / "empty.jsonl", [""]))


def test_humaneval_from_the_installed_package():
    prompts = load_humaneval()
    assert len(prompts) == 164
    assert {p.category for p in prompts} == {"humaneval"}
    assert prompts[0].name == "HumanEval/0"
    assert prompts[0].text.startswith(HUMANEVAL_INSTRUCTION + "from typing import List")


def test_own_set_has_three_per_category_except_code():
    for category in CATEGORIES:
        assert len([p for p in PROMPTS if p.category == category]) >= (2 if category == "code" else 3)


def test_per_category_counts_mt_bench_as_one_group(tmp_path):
    file = _write(tmp_path / "q.jsonl", QUESTIONS)
    chosen = select(load_sources(f"own,humaneval,{file}"), None, 2)
    counts = {c: sum(p.category == c for p in chosen) for c in dict.fromkeys(p.category for p in chosen)}
    assert counts == {c: 2 for c in CATEGORIES} | {"humaneval": 2, "mt_bench": 2, "translation": 2, "rag": 1}
    assert [p.name for p in select(chosen, ["mt_bench"], None)] == ["writing-81", "reasoning-101"]


def test_sources_errors(tmp_path):
    with pytest.raises(InvalidParameterError, match="repeat"):
        load_sources("own,own")
    with pytest.raises(InvalidParameterError, match="no prompt source"):
        load_sources(" , ")
    with pytest.raises(InvalidParameterError, match="unknown categories"):
        select(PROMPTS, ["poetry"])
    with pytest.raises(InvalidParameterError, match="per_category"):
        select(PROMPTS, None, 0)
