"""The built-in benchmark prompt set and the compare tool's pure helpers (no model loading)."""

import pytest

from verispec.tools.bench.compare import cut_at_eos, parse_method, summarize
from verispec.tools.bench.prompts import CATEGORIES, PROMPTS, select_prompts
from verispec.errors import InvalidParameterError


def test_six_categories_with_non_empty_texts():
    assert set(CATEGORIES) == {"code", "summarization", "translation", "qa", "math", "chat"}
    for category in CATEGORIES:
        assert len([p for p in PROMPTS if p.category == category]) >= 2
    assert all(p.text.strip() and p.name for p in PROMPTS)
    assert len({p.name for p in PROMPTS}) == len(PROMPTS)


def test_select_prompts():
    assert [p.category for p in select_prompts(["math", "code"], 1)] == ["math", "code"]
    assert len(select_prompts()) == len(PROMPTS)
    with pytest.raises(InvalidParameterError):
        select_prompts(["poetry"])


def test_parse_method():
    assert parse_method("hf-plain").drafter is None
    spec = parse_method("vs:model@heuristic")
    assert (spec.drafter, spec.policy) == ("model", "heuristic")
    assert parse_method("vs:ngram:max_n=3").policy == "analytic"
    for bad in ("hf-magic", "vs:", "vs:model@fastest"):
        with pytest.raises(InvalidParameterError):
            parse_method(bad)


def test_cut_at_eos_keeps_the_eos():
    assert cut_at_eos([5, 7, 0, 9, 0], frozenset({0})) == [5, 7, 0]
    assert cut_at_eos([5, 7], frozenset({0})) == [5, 7]


def test_summarize_speedup_is_ratio_of_mean_rates():
    def rec(method, prompt, tps, ids):
        return {"method": method, "prompt": prompt, "category": "code", "tokens_per_second": tps,
                "token_ids": ids, "new_tokens": len(ids)}

    records = [rec("hf-plain", "a", 10.0, [1]), rec("hf-plain", "b", 30.0, [2]),
               rec("vs:x", "a", 30.0, [1]), rec("vs:x", "b", 30.0, [3])]
    summary = summarize(records, ["hf-plain", "vs:x"])
    assert summary["hf-plain"]["speedup"] == 1.0
    assert summary["vs:x"]["speedup"] == pytest.approx(60 / 40)
    assert summary["vs:x"]["speedup_median_ratio"] == pytest.approx(2.0)
    assert summary["vs:x"]["identical_to_baseline"] == 0.5
    assert summary["vs:x"]["per_category"]["code"]["n"] == 2
