"""Vectorised logits processing equals a per-row reference; the penalties count each position's own prefix
(the output only for presence and frequency); bad parameters raise clear errors; every processor gives a
distribution (finite, summing to 1, the top token kept) at extreme values."""

import math
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verispec.errors import InvalidParameterError
from verispec.sampling.processors import (
    MIN_REPETITION_PENALTY, MIN_TEMPERATURE, Penalties, SamplingParams, adjusted, apply_repetition_penalty, greedy_tokens,
    penalties, to_probs, token_counts,
)
from verispec.tokentree import ancestor_mask
from verispec.sampling.samplers import multinomial


def _reference_row(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row, written as plainly as possible, with Python loops over sorted tokens."""
    scores = (logits / p.temperature).tolist()
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    keep = set(order[: p.top_k]) if p.top_k else set(order)
    z = [math.exp(scores[i] - scores[order[0]]) if i in keep else 0.0 for i in range(len(scores))]
    probs = [v / sum(z) for v in z]
    if p.top_p < 1:
        mass, kept = 0.0, set()
        for i in order:
            if mass >= p.top_p:
                break
            kept.add(i)
            mass += probs[i]
        probs = [v if i in kept else 0.0 for i, v in enumerate(probs)]
    if p.min_p:
        top = max(probs)
        probs = [v if v >= p.min_p * top else 0.0 for v in probs]
    for cutoff in ("epsilon", "eta"):
        value = getattr(p, cutoff)
        if not value:
            continue
        total = sum(probs)
        probs = [v / total for v in probs]
        threshold = value
        if cutoff == "eta":
            entropy = -sum(v * math.log(v) for v in probs if v > 0)
            threshold = min(value, math.sqrt(value) * math.exp(-entropy))
        best = max(range(len(probs)), key=lambda i: probs[i])
        probs = [v if (v >= threshold or i == best) else 0.0 for i, v in enumerate(probs)]
    total = sum(probs)
    return torch.tensor([v / total for v in probs])


CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.6),
    SamplingParams(temperature=1.3, min_p=0.1),
    SamplingParams(temperature=1.0, eta=0.02),
    SamplingParams(temperature=1.0, epsilon=0.03),
    SamplingParams(temperature=0.9, top_k=10, top_p=0.9, min_p=0.02),
]


@pytest.mark.parametrize("params", CASES, ids=str)
def test_vectorised_equals_per_row_reference(params):
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(1)) * 3  # [positions, vocab]
    got = to_probs(logits, params)
    for row in range(logits.shape[0]):
        torch.testing.assert_close(got[row], _reference_row(logits[row], params), atol=1e-5, rtol=1e-4)


def test_repetition_penalty_uses_each_positions_own_prefix():
    seen = token_counts(10, [1, 2], torch.tensor([5, 7])) > 0  # [3, 10]
    assert seen[0].nonzero().flatten().tolist() == [1, 2]
    assert seen[1].nonzero().flatten().tolist() == [1, 2, 5]
    assert seen[2].nonzero().flatten().tolist() == [1, 2, 5, 7]
    logits = torch.tensor([[2.0, -2.0, 2.0]])
    penalized = apply_repetition_penalty(logits, torch.tensor([[True, True, False]]), 2.0)
    assert penalized.tolist() == [[1.0, -4.0, 2.0]]


def test_token_counts_follow_each_rows_own_prefix_in_a_chain_and_a_tree():
    chain = token_counts(6, [1, 1, 2], torch.tensor([1, 3]))  # [3, 6]
    assert chain.tolist() == [[0, 2, 1, 0, 0, 0], [0, 3, 1, 0, 0, 0], [0, 3, 1, 1, 0, 0]]
    parents = torch.tensor([-1, -1, 0])  # two children of the root (tokens 4 and 5), node 2 (token 4) under node 0
    tree = token_counts(6, [4], torch.tensor([4, 5, 4]), ancestor_mask(parents))  # [4, 6]
    assert tree.tolist() == [[0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 2, 0], [0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 3, 0]]


def test_presence_and_frequency_penalties_count_the_output_only():
    """OpenAI's rule, one row at a time: logit − frequency × count − presence × (count > 0), the counts over
    the output (the prompt's tokens are not penalised), −inf kept."""
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    prompt, output, block = [3, 3, 3], [1, 1, 2], torch.tensor([2, 0])
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0, -math.inf]]).repeat(3, 1)  # [3, 5]
    got = adjusted(logits, params, penalties(params, 5, prompt + output, block, output_start=len(prompt)))
    for row, prefix in enumerate([output, output + [2], output + [2, 0]]):
        want = [value - 0.25 * prefix.count(token) - 0.5 * (token in prefix) for token, value in enumerate(logits[row].tolist())]
        assert got[row].tolist() == pytest.approx(want), row
    assert penalties(SamplingParams(), 5, prompt, output_start=0) is None  # nothing to penalise: nothing built


def test_logit_bias_is_added_first_and_can_ban_or_force_a_token():
    logits = torch.tensor([[1.0, 5.0, 3.0, -math.inf]])
    assert greedy_tokens(logits, SamplingParams(logit_bias={1: -100})).tolist() == [2]
    assert greedy_tokens(logits, SamplingParams(logit_bias={0: 100})).tolist() == [0]
    banned = to_probs(logits, SamplingParams(temperature=1.0, logit_bias={1: -100, 3: 100}))
    assert banned[0, 1] < 1e-40 and banned[0, 3] == 0  # −inf (a grammar's ban) stays −inf under any bias
    assert torch.equal(adjusted(logits, SamplingParams(logit_bias={9: 1.0})), logits)  # ids past a draft's vocabulary: not its
    assert SamplingParams(logit_bias={2: 1, 0: -1.5}).logit_bias == ((0, -1.5), (2, 1.0))  # a mapping is taken, sorted
    assert SamplingParams(logit_bias={1: 3}).in_draft_vocabulary().logit_bias == ()


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1.0}, "min_p"),
        ({"eta": -0.1}, "eta"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"temperature": float("nan")}, "temperature"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"logit_bias": [(5, 1), (5, 2)]}, "logit_bias"),
        ({"logit_bias": {i: 1 for i in range(301)}}, "logit_bias"),
    ],
)
def test_invalid_sampling_parameters_raise_clear_errors(kwargs, words):
    with pytest.raises(InvalidParameterError, match=words):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("field, value", [("temperature", 1e-300), ("temperature", -0.5), ("repetition_penalty", 1e-172)])
def test_values_that_would_overflow_to_nan_are_refused(field, value):
    with pytest.raises(InvalidParameterError, match=field):
        SamplingParams(**{field: value})


# ---- every processor at extreme values (property-based) ---------------------------------------------

FINITE = st.floats(width=32, allow_nan=False, allow_infinity=False)
LOGIT = st.one_of(FINITE, st.just(-math.inf), st.sampled_from([0.0, 1.0, -1.0]))
TINY = [5e-324, 1e-300, 1e-45, 1e-30]  # below float32's resolution, or at its edge
NEAR_ONE = [1 - 1e-16, 1 - 1e-8, 0.999]


def _bounded(low: float, high: float, edges: list[float], exclude_min=False, exclude_max=False) -> st.SearchStrategy:
    """A value in [low, high], often one of `edges`."""
    return st.one_of(st.sampled_from(edges), st.floats(low, high, exclude_min=exclude_min, exclude_max=exclude_max))


@st.composite
def logit_rows(draw) -> torch.Tensor:
    """[rows, vocab] float32 logits: any finite values, −inf, or one value repeated; each row has a finite one."""
    vocab, rows = draw(st.integers(1, 12)), draw(st.integers(1, 3))
    out = []
    for _ in range(rows):
        row = [draw(FINITE)] * vocab if draw(st.booleans()) else draw(st.lists(LOGIT, min_size=vocab, max_size=vocab))
        row[draw(st.integers(0, vocab - 1))] = draw(FINITE)
        out.append(row)
    return torch.tensor(out, dtype=torch.float32)


PARAMS = st.builds(
    SamplingParams,
    temperature=_bounded(MIN_TEMPERATURE, sys.float_info.max, [MIN_TEMPERATURE, 1.0, 1e30, 1e300, sys.float_info.max]),
    top_k=st.integers(0, 14),
    top_p=_bounded(0, 1, [*TINY, 0.5, *NEAR_ONE, 1.0], exclude_min=True),
    min_p=_bounded(0, 1, [0.0, *TINY, *NEAR_ONE], exclude_max=True),
    eta=_bounded(0, 1, [0.0, *TINY, 0.0009, *NEAR_ONE], exclude_max=True),
    epsilon=_bounded(0, 1, [0.0, *TINY, *NEAR_ONE], exclude_max=True),
    repetition_penalty=_bounded(MIN_REPETITION_PENALTY, sys.float_info.max, [MIN_REPETITION_PENALTY, 1.0, 100.0, 1e300]),
    presence_penalty=_bounded(-2, 2, [-2.0, 0.0, 2.0]),
    frequency_penalty=_bounded(-2, 2, [-2.0, 0.0, 2.0]),
    logit_bias=st.dictionaries(st.integers(0, 13), _bounded(-100, 100, [-100.0, 100.0]), max_size=4),
)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(logits=logit_rows(), params=PARAMS, data=st.data())
def test_every_processor_gives_a_distribution_keeping_the_top_token(logits, params, data):
    vocab = logits.shape[1]
    seen = torch.tensor(data.draw(st.lists(st.booleans(), min_size=vocab, max_size=vocab)))[None]
    output = torch.tensor(data.draw(st.lists(st.integers(0, 32_768), min_size=vocab, max_size=vocab)), dtype=torch.float32)[None]
    seen = Penalties(seen, output)
    probs = to_probs(logits, params, seen)
    assert torch.isfinite(probs).all() and (probs >= 0).all(), probs
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(len(logits)), atol=1e-5, rtol=0)
    # untruncated: the same temperature and penalty; the most likely tokens there, one of which must stay
    untruncated = to_probs(logits, SamplingParams(params.temperature, repetition_penalty=params.repetition_penalty,
                                                  presence_penalty=params.presence_penalty,
                                                  frequency_penalty=params.frequency_penalty, logit_bias=params.logit_bias), seen)
    top = untruncated == untruncated.max(dim=-1, keepdim=True).values
    assert ((probs > 0) & top).any(dim=-1).all(), (probs, untruncated)
    assert top.gather(1, greedy_tokens(logits, params, seen)[:, None]).all()
    assert (probs.gather(1, multinomial(probs, torch.Generator().manual_seed(0))[:, None]) > 0).all()
