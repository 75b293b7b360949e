"""Vectorised logits processing equals a per-row reference; bad parameters raise clear errors."""

import math

import pytest
import torch

from verispec.errors import InvalidParameterError
from verispec.sampling.processors import SamplingParams, apply_repetition_penalty, seen_mask, to_probs


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
    seen = seen_mask(10, [1, 2], torch.tensor([5, 7]))  # [3, 10]
    assert seen[0].nonzero().flatten().tolist() == [1, 2]
    assert seen[1].nonzero().flatten().tolist() == [1, 2, 5]
    assert seen[2].nonzero().flatten().tolist() == [1, 2, 5, 7]
    logits = torch.tensor([[2.0, -2.0, 2.0]])
    penalized = apply_repetition_penalty(logits, torch.tensor([[True, True, False]]), 2.0)
    assert penalized.tolist() == [[1.0, -4.0, 2.0]]


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
    ],
)
def test_invalid_sampling_parameters_raise_clear_errors(kwargs, words):
    with pytest.raises(InvalidParameterError, match=words):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("field, value", [("temperature", 1e-300), ("temperature", -0.5), ("repetition_penalty", 1e-172)])
def test_values_that_would_overflow_to_nan_are_refused(field, value):
    with pytest.raises(InvalidParameterError, match=field):
        SamplingParams(**{field: value})
