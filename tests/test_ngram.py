"""Prompt lookup: which earlier occurrence a match continues from, and an index that stays right
while a cascade drafts after speculative tokens that are later rolled back."""

import random

import pytest

from verispec import SamplingParams
from verispec.drafters import NgramDrafter, make_drafter
from verispec.drafters.ngram import MATCH_PRIORS
from verispec.errors import InvalidParameterError
from verispec.types import Hint

#        0  1  2  3  4  5  6  7  8  9
TEXT = [1, 2, 7, 1, 2, 8, 3, 3, 1, 2]  # the suffix [1, 2] occurred at 0 (→ 7) and at 3 (→ 8)


def _draft(drafter: NgramDrafter, ids: list[int], gamma: int = 2) -> list[int]:
    return drafter.start(ids).propose(ids, gamma, SamplingParams(), None).tokens.tolist()


def test_the_latest_longest_match_wins_and_oldest_takes_the_first_as_hf_does():
    assert _draft(NgramDrafter(max_n=2), TEXT) == [8, 3]
    assert _draft(NgramDrafter(max_n=2, oldest=1), TEXT) == [7, 1]
    # a longer match beats a more recent shorter one: [4, 1, 2] at 0 (→ 5) over [2] at 5 (→ 6)
    longer = [4, 1, 2, 5, 9, 2, 6, 4, 1, 2]
    assert _draft(NgramDrafter(max_n=3), longer) == [5, 9]


def test_oldest_is_a_factory_option_and_checked(target):
    assert make_drafter("ngram:oldest=1", target).name == "ngram:max_n=3,oldest=1"
    with pytest.raises(InvalidParameterError, match="oldest"):
        make_drafter("ngram:oldest=2", target)


def test_a_step_is_hinted_by_the_length_of_the_suffix_it_matched(target):
    """The γ policy's class for a step: the matched suffix's length (capped at 3) with its prior, free (a lookup
    costs no forward); no match, or hints=0, gives no hint."""
    session = NgramDrafter(max_n=4).start(TEXT)
    assert session.hint([4, 1, 2, 5, 9, 4, 1, 2]) == Hint(3, MATCH_PRIORS[3], free=True)  # [4, 1, 2] seen before
    assert session.hint([4, 1, 2, 5, 9, 2]) == Hint(1, MATCH_PRIORS[1], free=True)  # only [2]
    assert session.hint([5, 6, 7]) is None and MATCH_PRIORS[1] < MATCH_PRIORS[2] < MATCH_PRIORS[3]
    assert NgramDrafter(hints=0).start(TEXT).hint(TEXT) is None
    assert make_drafter("ngram:hints=0", target).name == "ngram:max_n=3,hints=0"
    with pytest.raises(InvalidParameterError, match="hints"):
        make_drafter("ngram:hints=2", target)


@pytest.mark.parametrize("oldest", [0, 1])
def test_ngram_index_survives_rollbacks(oldest):
    """Drafting after speculative tokens and rolling them back leaves the index a fresh session would build."""
    rng = random.Random(0)
    drafter, params = NgramDrafter(max_n=3, oldest=oldest), SamplingParams()
    committed = [rng.randrange(6) for _ in range(5)]
    session = drafter.start(committed)
    for _ in range(60):
        speculative = committed + [rng.randrange(6) for _ in range(rng.randrange(1, 5))]
        session.propose(speculative, 3, params, None)
        committed = speculative[: rng.randrange(len(committed), len(speculative) + 1)] + [rng.randrange(6)]
        session.commit(committed)
        fresh = drafter.start(committed)
        assert session.propose(committed, 4, params, None).tokens.tolist() == fresh.propose(committed, 4, params, None).tokens.tolist()
        assert session.index == fresh.index


def test_the_lookup_benchmark_times_both_methods_at_every_length():
    from verispec.tools.bench.lookup import time_lookups

    rows = time_lookups([5, 6, 7, 8, 9] * 40, [100, 150], steps=5, gamma=4)
    assert [(r["length"], r["method"].split()[0]) for r in rows] == [(100, "verispec"), (100, "HF"), (150, "verispec"), (150, "HF")]
    assert all(0 < r["median_us"] <= r["p99_us"] for r in rows)


def test_a_tree_holds_every_earlier_matchs_continuation_up_to_its_nodes(target):
    """nodes=N: the continuations of [1, 2] at 3 (→ 8 3) and at 0 (→ 7 1), latest first, then of [2] (the same
    ones: merged), as a tree of up to N nodes and γ deep; without a match, nothing."""
    def tree(nodes: int, gamma: int, ids=TEXT):
        draft = NgramDrafter(max_n=2, nodes=nodes).start(ids).propose(ids, gamma, SamplingParams(), None)
        return draft.tokens.tolist(), None if draft.parents is None else draft.parents.tolist()

    assert tree(8, 2) == ([8, 3, 7, 1], [-1, 0, -1, 2])
    assert tree(3, 2) == ([8, 3, 7], [-1, 0, -1])
    assert tree(8, 1) == ([8, 7], [-1, -1])
    assert tree(8, 2, [1, 2, 7, 1, 2]) == ([7, 1], [-1, 0])  # one continuation: a chain (the engine verifies it so)
    assert tree(8, 2, [5, 6]) == ([], None)
    assert make_drafter("ngram:nodes=16", target).name == "ngram:max_n=3,nodes=16"
    assert make_drafter("ngram:nodes=16", target).drafts_trees and not make_drafter("ngram", target).drafts_trees
    with pytest.raises(InvalidParameterError, match="nodes"):
        make_drafter("ngram:nodes=100000", target)
