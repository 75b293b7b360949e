"""Statistical helpers for distribution tests: a chi-square goodness-of-fit with pooled rare cells."""

from __future__ import annotations

from collections import Counter

from scipy.stats import chisquare

SIGNIFICANCE = 1e-3  # reject "same distribution" below this p-value


def chi_square_pvalue(samples: list, expected: dict, min_expected: float = 5.0) -> float:
    """p-value of `samples` against the probabilities `expected` (outcome -> prob).

    Outcomes with expected count < min_expected are pooled into one cell; an observed outcome with
    zero expected probability makes the p-value 0.
    """
    n = len(samples)
    counts = Counter(samples)
    if any(outcome not in expected or expected[outcome] == 0 for outcome in counts):
        return 0.0
    observed, wanted, pooled_obs, pooled_exp = [], [], 0, 0.0
    for outcome, prob in expected.items():
        if prob * n >= min_expected:
            observed.append(counts.get(outcome, 0))
            wanted.append(prob * n)
        else:
            pooled_obs += counts.get(outcome, 0)
            pooled_exp += prob * n
    if pooled_exp > 0:
        observed.append(pooled_obs)
        wanted.append(pooled_exp)
    total = sum(wanted)
    wanted = [w * n / total for w in wanted]
    if len(observed) < 2:
        return 1.0
    return float(chisquare(observed, wanted).pvalue)
