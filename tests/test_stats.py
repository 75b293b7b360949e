"""The distribution tests' statistics (tests/stats.py): a test that cannot reject is an error, and the
power each test states is what it has.

The power claim ("rejects any bias of total variation ≥ ε with ≥ 90 % power") rests on the
noncentral chi-square approximation; here it is checked by simulation: 400 tests of n multinomial
samples from a distribution at total variation ε = detectable_tv from the exact one, in the worst-case
shape (mass moved proportionally between two halves of equal probability), must reject at least 85 %
of the time (90 % less 3.3 standard errors), and 400 tests of the exact distribution almost never.
"""

from collections import Counter

import numpy as np
import pytest
import torch
from distribution import product_distribution, random_dists
from stats import SIGNIFICANCE, chi_square, chi_square_counts, chi_square_pvalue, detectable_tv, noncentrality_for_power


def test_a_test_that_could_never_reject_fails_instead_of_passing():
    with pytest.raises(AssertionError, match="could never reject"):
        chi_square([0] * 50, {0: 1.0})
    with pytest.raises(AssertionError, match="could never reject"):  # the rare outcome is merged into the only cell
        chi_square([0] * 50, {0: 0.99, 1: 0.01})
    with pytest.raises(AssertionError, match="no samples"):
        chi_square([], {0: 0.5, 1: 0.5})


def test_an_impossible_outcome_rejects_and_rare_outcomes_are_pooled():
    assert chi_square_pvalue([0] * 50 + [2], {0: 0.5, 1: 0.5}) == 0.0
    result = chi_square([0] * 200 + [1] * 192 + [2] * 8, {0: 0.49, 1: 0.49, 2: 0.01, 3: 0.01})
    assert result.cells == 3 and result.pooled_mass == pytest.approx(0.02) and result.pvalue > SIGNIFICANCE
    result = chi_square([0] * 50 + [1] * 48 + [2] * 2, {0: 0.49, 1: 0.49, 2: 0.01, 3: 0.01})  # pool below 5: merged
    assert result.cells == 2 and result.pooled_mass == pytest.approx(0.51)


def test_more_samples_detect_smaller_biases():
    assert noncentrality_for_power(10) < noncentrality_for_power(100)
    assert detectable_tv(4 * 1000, 20) == pytest.approx(detectable_tv(1000, 20) / 2)
    assert detectable_tv(1000, 20, pooled_mass=0.05) == pytest.approx(detectable_tv(1000, 20) + 0.05)


def _worst_case_bias(p: np.ndarray, kept: np.ndarray, eps: float) -> np.ndarray:
    """p with mass eps moved proportionally from one half of the kept cells to the other (equal masses)."""
    half_a, mass_a, mass_b = np.zeros_like(kept), 0.0, 0.0
    for i in np.argsort(-p):
        if not kept[i]:
            continue
        if mass_a <= mass_b:
            half_a[i], mass_a = True, mass_a + p[i]
        else:
            mass_b += p[i]
    half_b = kept & ~half_a
    return p + eps * (p * half_a / mass_a - p * half_b / mass_b)


def _exact(kind: str) -> dict:
    if kind == "chain-unit":  # the chain verifier's unit test: 6 tokens, length 3
        return product_distribution(random_dists(seed=7, positions=6, vocab=6)[0], 3)
    g = torch.Generator().manual_seed(1)  # a peaked 64-outcome distribution like the end-to-end tests'
    probs = torch.softmax(torch.randn(64, generator=g) * 2.0, -1).tolist()
    return dict(enumerate(probs))


@pytest.mark.parametrize("kind, n", [("chain-unit", 20_000), ("peaked-64", 600), ("peaked-64", 2000)])
def test_the_stated_power_holds_by_simulation(kind, n):
    exact = _exact(kind)
    outcomes = list(exact)
    p = np.array([exact[o] for o in outcomes])
    p /= p.sum()
    stated = chi_square([outcomes[0]] * n, exact)  # cells and pooled mass depend only on n and exact
    kept = p * n >= 5
    eps = stated.detectable_tv - stated.pooled_mass  # the bias on the test's cells; pooled cells untouched
    biased = _worst_case_bias(p, kept, eps)
    assert 0.5 * np.abs(biased - p).sum() == pytest.approx(eps)
    rng = np.random.default_rng(5)

    def rejections(q: np.ndarray) -> int:
        total = 0
        for counts in rng.multinomial(n, q, size=400):
            total += chi_square_counts(Counter(dict(zip(outcomes, counts.tolist()))), exact).pvalue < SIGNIFICANCE
        return total

    print(f"{kind}, n = {n}: stated {stated}")
    power = rejections(biased) / 400
    print(f"rejected {power:.0%} of 400 simulated tests at total variation {eps:.3f} (worst-case shape)")
    assert power >= 0.85
    assert rejections(p) <= 3  # and the exact distribution is (almost) never rejected
