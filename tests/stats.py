"""The statistics of the distribution tests: a chi-square goodness-of-fit and the bias it can detect.

Every distribution test asks "do these n samples come from the exact distribution?" with Pearson's
chi-square at significance SIGNIFICANCE, after pooling the outcomes whose expected count is below
`min_expected` into one cell. A test that passes says nothing unless it could have failed, so each
test also states its power: `ChiSquare.detectable_tv`, the smallest total-variation distance
between the sampled and the exact distribution that the test rejects with probability ≥ POWER.

How the power is computed (`detectable_tv`). If the samples come from q instead of p, Pearson's
statistic over k cells is approximately noncentral chi-square with k − 1 degrees of freedom and
noncentrality λ = n Σ (q_i − p_i)² / p_i. The power at significance α is P(χ²_{k−1}(λ) > c_α),
increasing in λ; `noncentrality_for_power` finds the smallest λ with power ≥ POWER. Stated shape:
the WORST case, not a convenient one: for any q at total variation ε from p on the cells, Cauchy–
Schwarz gives Σ (q_i − p_i)² / p_i ≥ ε²/P₊ + ε²/P₋ ≥ 4ε² (P₊, P₋ the exact probabilities of the
cells where q gains and where it loses, P₊ + P₋ ≤ 1), so every such q has λ ≥ 4nε² and ε = √(λ/4n)
is detected whatever its shape (a bias that moves mass between two cells a and b has the larger
λ = nε²(1/p_a + 1/p_b)). Bias inside the pooled cell is invisible, but the total variation on the
cells is at least the full one minus the pooled mass m, so the bound stated for the full
distribution is √(λ/4n) + m. The noncentral approximation is asymptotic; tests/test_stats.py
checks it by simulation at the sizes the suite uses.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

from scipy.optimize import brentq
from scipy.stats import chi2, chisquare, ncx2

SIGNIFICANCE = 1e-3  # reject "same distribution" below this p-value
POWER = 0.9  # every test states the total variation it detects with at least this probability


@lru_cache(maxsize=None)
def noncentrality_for_power(df: int, alpha: float = SIGNIFICANCE, power: float = POWER) -> float:
    """The smallest noncentrality λ at which a chi-square test with df degrees of freedom rejects
    at significance alpha with probability ≥ power."""
    critical = chi2.isf(alpha, df)
    return float(brentq(lambda lam: ncx2.sf(critical, df, lam) - power, 1e-9, 1e6))


def detectable_tv(n: int, cells: int, pooled_mass: float = 0.0, alpha: float = SIGNIFICANCE, power: float = POWER) -> float:
    """The total variation from the exact distribution that n samples over `cells` cells detect
    with probability ≥ power at significance alpha, whatever the bias's shape (see the module doc)."""
    return math.sqrt(noncentrality_for_power(cells - 1, alpha, power) / (4 * n)) + pooled_mass


@dataclass(frozen=True)
class ChiSquare:
    pvalue: float
    n: int
    cells: int  # after pooling
    pooled_mass: float  # exact probability of the outcomes pooled into one cell
    alpha: float = SIGNIFICANCE

    @property
    def detectable_tv(self) -> float:
        return detectable_tv(self.n, self.cells, self.pooled_mass, self.alpha)

    def __str__(self) -> str:
        return (f"chi-square p = {self.pvalue:.3g} (alpha = {self.alpha:g}, n = {self.n}, {self.cells} cells, "
                f"pooled mass {self.pooled_mass:.3f}; detects any bias of total variation >= "
                f"{self.detectable_tv:.3f} with >= {POWER:.0%} power)")


def chi_square(samples: list, expected: dict, min_expected: float = 5.0) -> ChiSquare:
    """Pearson's test of `samples` against the probabilities `expected` (outcome -> prob).

    Outcomes with expected count < min_expected are pooled into one cell (merged into the smallest
    other cell if the pool itself stays below min_expected); an observed outcome with zero expected
    probability makes the p-value 0. Fewer than two cells is an error, not a pass: such a test
    could never reject.
    """
    return chi_square_counts(Counter(samples), expected, min_expected)


def chi_square_counts(counts: Counter, expected: dict, min_expected: float = 5.0) -> ChiSquare:
    """`chi_square` from the count of each outcome."""
    n = sum(counts.values())
    assert n > 0, "no samples: nothing to test"
    total_prob = sum(expected.values())
    kept = [(counts.get(o, 0), p / total_prob * n) for o, p in expected.items() if p / total_prob * n >= min_expected]
    pooled = [(counts.get(o, 0), p / total_prob * n) for o, p in expected.items() if 0 < p / total_prob * n < min_expected]
    pooled_obs, pooled_exp = sum(c for c, _ in pooled), sum(e for _, e in pooled)
    if pooled and pooled_exp < min_expected and kept:  # a pool too small for the approximation: merge it
        smallest = min(range(len(kept)), key=lambda i: kept[i][1])
        kept[smallest] = (kept[smallest][0] + pooled_obs, kept[smallest][1] + pooled_exp)
        pooled_mass = kept[smallest][1] / n  # a bias inside the merged cell is as invisible as one inside the pool
    else:
        if pooled:
            kept.append((pooled_obs, pooled_exp))
        pooled_mass = pooled_exp / n
    if len(kept) < 2:
        raise AssertionError(f"{len(kept)} cell(s) after pooling ({len(expected)} outcomes, n = {n}): the test could never reject")
    cells = len(kept)
    if any(count and (outcome not in expected or expected[outcome] == 0) for outcome, count in counts.items()):
        return ChiSquare(0.0, n, cells, pooled_mass)
    observed, wanted = [c for c, _ in kept], [e for _, e in kept]
    scale = n / sum(wanted)
    return ChiSquare(float(chisquare(observed, [w * scale for w in wanted]).pvalue), n, cells, pooled_mass)


def chi_square_pvalue(samples: list, expected: dict, min_expected: float = 5.0) -> float:
    """The p-value alone (see `chi_square`)."""
    return chi_square(samples, expected, min_expected).pvalue
