"""The distribution-test harness shared by the verifier unit tests and the end-to-end engine tests.

A distribution test samples sequences, compares them with the exact distribution by the
chi-square test of tests/stats.py, and prints one line with its significance, its sample size and
the smallest total-variation bias it detects with 90 % power (run pytest with -rP or -s to see it).
Every such test has a positive control beside it: the same harness with a deliberately wrong rule
must reject (`assert_rejected`).
"""

from __future__ import annotations

import itertools

import torch
from stats import SIGNIFICANCE, ChiSquare, chi_square

from verispec.sampling.samplers import multinomial
from verispec.types import Origin, Verdict
from verispec.verify import verify_sampled, verify_tree_sampled

__all__ = [
    "random_dists", "product_distribution", "sample_sequences", "assert_same_distribution", "assert_rejected",
    "accept_every_draft_token", "bonus_from_the_wrong_row", "token_0_as_every_bonus",
]


def random_dists(seed: int, positions: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Position-dependent (context-free) target and draft distributions, each [positions, vocab].

    The draft resembles the target, as real drafts do (its logits are the target's plus noise; a
    token is accepted with probability 0.5–0.8 at seed 7), so both rejections and fully accepted
    blocks, whose bonus token the tests must see, are frequent.
    """
    g = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(positions, vocab, generator=g) * 1.5
    draft_logits = target_logits + torch.randn(positions, vocab, generator=g) * 1.5
    return torch.softmax(target_logits, -1), torch.softmax(draft_logits, -1)


def product_distribution(target: torch.Tensor, length: int) -> dict[tuple[int, ...], float]:
    """Exact probability of every sequence of `length` tokens when position i follows target[i]."""
    vocab = target.shape[1]
    rows = target[:length].tolist()
    out = {}
    for seq in itertools.product(range(vocab), repeat=length):
        prob = 1.0
        for i, token in enumerate(seq):
            prob *= rows[i][token]
        out[seq] = prob
    return out


def sample_sequences(engine, prompt: list[int], params, n: int, length: int, **config) -> list[tuple[int, ...]]:
    """n engine generations of `length` new tokens after `prompt`, seeds 0 … n−1 (`config`: other GenerationConfig fields)."""
    from verispec import GenerationConfig

    return [tuple(engine.generate(prompt, GenerationConfig(max_new_tokens=length, sampling=params, seed=seed, **config)).token_ids)
            for seed in range(n)]


def assert_same_distribution(samples: list, exact: dict, min_expected: float = 5.0) -> ChiSquare:
    """Fail if the samples are not distributed as `exact` (p ≤ SIGNIFICANCE); print the test's power."""
    result = chi_square(samples, exact, min_expected)
    print(result)
    assert result.pvalue > SIGNIFICANCE, f"not distributed as the exact distribution: {result}"
    return result


def assert_rejected(samples: list, exact: dict, min_expected: float = 5.0) -> ChiSquare:
    """Positive control: samples from a deliberately wrong rule must be rejected."""
    result = chi_square(samples, exact, min_expected)
    print(f"positive control: {result}")
    assert result.pvalue < SIGNIFICANCE, f"a wrong rule went unnoticed, the test has no power against it: {result}"
    return result


# --- deliberately wrong rules (positive controls) ------------------------------------------------
# Both bugs touch only the bonus token, so a test whose event stops at γ tokens (or at the tree's
# depth) cannot see them: the tests check sequences one token longer.


def accept_every_draft_token(draft_tokens, draft_probs, target_probs, generator) -> Verdict:
    """`verify_sampled` with no rejection at all: every draft token kept, then a bonus from the last row."""
    return Verdict(len(draft_tokens), int(torch.multinomial(target_probs[-1], 1, generator=generator)), Origin.BONUS)


def bonus_from_the_wrong_row(draft_tokens, draft_probs, target_probs, generator) -> Verdict:
    """`verify_sampled` with a bug: the bonus token drawn from the target row of the last draft token
    (target_probs[γ−1]) instead of the row after the block (target_probs[γ])."""
    verdict = verify_sampled(draft_tokens, draft_probs, target_probs, generator)
    if verdict.next_origin is not Origin.BONUS or verdict.accepted == 0:  # no draft token: no wrong row to take
        return verdict
    return Verdict(verdict.accepted, int(multinomial(target_probs[-2:-1], generator)), Origin.BONUS)


def token_0_as_every_bonus(draft_tokens, parents, draft_probs, target_probs, generator) -> Verdict:
    """`verify_tree_sampled` with a bug: token 0 as the bonus after an accepted leaf, not a draw from the target."""
    verdict = verify_tree_sampled(draft_tokens, parents, draft_probs, target_probs, generator)
    if verdict.next_origin is not Origin.BONUS:
        return verdict
    return Verdict(verdict.accepted, 0, Origin.BONUS, verdict.path)
