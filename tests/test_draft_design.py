"""`verispec design` on tiny models: every candidate measured, ranked by predicted speedup, clear errors."""

import pytest

from verispec.tools.design import design, format_ranking
from verispec.errors import InvalidParameterError
from verispec.models.loading import load_model


@pytest.fixture(scope="module")
def target(tiny_target):
    return load_model(tiny_target)


def test_ranking_is_well_formed(target, tiny_draft):
    specs = ["self:layers=1", "self:layers=3", f"model:{tiny_draft}", f"model:{tiny_draft},vocab=24"]
    results = design(target, specs, [[5, 9, 2, 7], [11, 3, 3, 8]], max_new_tokens=6, max_gamma=4)
    assert sorted(r.spec for r in results) == sorted(specs)
    assert [r.speedup for r in results] == sorted((r.speedup for r in results), reverse=True)
    full = next(r for r in results if r.spec == "self:layers=3")  # the target itself: always agrees
    assert full.alpha == 1.0 and full.c > 0
    for r in results:
        assert 0 <= r.alpha <= 1 and r.draft_seconds > 0 and 1 <= r.gamma <= 4 and r.speedup > 0
    table = format_ranking(results).splitlines()
    assert len(table) == 2 + len(specs) and table[2].startswith("| 1 | `" + results[0].spec)


def test_candidates_must_be_draft_models(target):
    with pytest.raises(InvalidParameterError, match="not a single draft model"):
        design(target, ["ngram"], [[5, 9, 2]], max_new_tokens=2)
    with pytest.raises(InvalidParameterError, match="candidate"):
        design(target, [], [[5, 9, 2]])
