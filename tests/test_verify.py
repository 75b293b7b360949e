"""The rejection rule alone, on random distributions: output distribution equals the target's.

Each test decodes sequences of LENGTH = γ + 1 = 3 tokens with position-dependent (context-free)
target and draft distributions over a 6-token vocabulary (216 cells), draft γ = 2 per step, so the
tested event holds the bonus token of a fully accepted first block, and runs the chi-square test of
tests/stats.py against the exact product distribution. Significance 1e-3, N = 20 000 sequences:
any bias of total variation ≥ 0.04 is rejected with ≥ 90 % power, whatever its shape (the test
prints its own figure). Positive controls, the same harness with a deliberately wrong rule on a
quarter of the samples, must reject: sampling the target instead of the residual after a
rejection, and drawing the bonus token from the wrong row (the last draft position's instead of
the one after the block), each for a sampled and a deterministic draft.
"""

import pytest
import torch
from distribution import assert_rejected, assert_same_distribution, bonus_from_the_wrong_row, product_distribution, random_dists

from verispec.sampling.samplers import gumbel_topk, inverse_cdf, multinomial
from verispec.types import Origin, Verdict
from verispec.verify import verify_greedy, verify_sampled
from verispec.verify.chain import _first_false

VOCAB, GAMMA, SAMPLES = 6, 2, 20_000
LENGTH = GAMMA + 1  # longer than a block: the bonus token is part of the tested event


def _decode(verify, target, draft, point_mass: bool, seed: int, samples: int = SAMPLES) -> list[tuple[int, ...]]:
    """Speculative decoding of LENGTH tokens; the distribution at a position depends only on the position."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(samples):
        seq: list[int] = []
        while len(seq) < LENGTH:
            pos = torch.arange(len(seq), len(seq) + GAMMA + 1).clamp(max=target.shape[0] - 1)
            if point_mass:  # a deterministic drafter: always the draft's most likely token
                tokens, probs = draft[pos[:GAMMA]].argmax(-1), None
            else:
                probs = draft[pos[:GAMMA]]
                tokens = multinomial(probs, g)
            verdict = verify(tokens, probs, target[pos], g)
            seq += tokens[: verdict.accepted].tolist() + [verdict.next_token]
        out.append(tuple(seq[:LENGTH]))
    return out


def _wrong_residual(draft_tokens, draft_probs, target_probs, generator):
    """Bug on purpose: after a rejection, sample from the target instead of the residual."""
    gamma = draft_tokens.shape[0]
    idx = torch.arange(gamma)
    d = draft_probs[idx, draft_tokens] if draft_probs is not None else torch.ones(gamma)
    u = torch.rand(gamma, generator=generator)
    n = _first_false(u * d < target_probs[idx, draft_tokens])
    return Verdict(n, int(multinomial(target_probs[n : n + 1], generator)), Origin.RECOVERED)


@pytest.fixture(scope="module")
def dists():
    return random_dists(seed=7, positions=LENGTH + GAMMA + 1, vocab=VOCAB)


DRAFTS = pytest.mark.parametrize("point_mass", [False, True], ids=["sampled-draft", "deterministic-draft"])


@DRAFTS
def test_rejection_rule_is_lossless(dists, point_mass):
    target, draft = dists
    result = assert_same_distribution(_decode(verify_sampled, target, draft, point_mass, seed=11), product_distribution(target, LENGTH))
    assert result.detectable_tv < 0.045  # the power the module doc promises


# Positive controls run on a quarter of the samples: a rule caught with less data is caught by the full test.
CONTROL_SAMPLES = SAMPLES // 4


@DRAFTS
def test_a_wrong_residual_is_caught(dists, point_mass):
    target, draft = dists
    samples = _decode(_wrong_residual, target, draft, point_mass, seed=11, samples=CONTROL_SAMPLES)
    assert_rejected(samples, product_distribution(target, LENGTH))


@DRAFTS
def test_a_bonus_from_the_wrong_row_is_caught(dists, point_mass):
    """The wrong bonus row biases the output by P(first block fully accepted) · TV(target[1], target[2])
    exactly (total variation); that bias must exceed what the control detects with 90 % power."""
    target, draft = dists
    if point_mass:
        all_accepted = target[0, draft[0].argmax()] * target[1, draft[1].argmax()]
    else:
        all_accepted = torch.minimum(target[:GAMMA], draft[:GAMMA]).sum(-1).prod()
    bias = float(all_accepted * 0.5 * (target[1] - target[2]).abs().sum())
    samples = _decode(bonus_from_the_wrong_row, target, draft, point_mass, seed=11, samples=CONTROL_SAMPLES)
    result = assert_rejected(samples, product_distribution(target, LENGTH))
    print(f"the wrong bonus row's bias: total variation {bias:.3f}")
    assert bias > result.detectable_tv


def test_greedy_verification_keeps_the_longest_agreeing_prefix():
    v = verify_greedy(torch.tensor([4, 5, 6]), torch.tensor([4, 5, 9, 1]))
    assert (v.accepted, v.next_token, v.next_origin) == (2, 9, Origin.RECOVERED)
    v = verify_greedy(torch.tensor([4, 5]), torch.tensor([4, 5, 0]))  # token id 0 is a normal token
    assert (v.accepted, v.next_token, v.next_origin) == (2, 0, Origin.BONUS)
    v = verify_greedy(torch.tensor([], dtype=torch.long), torch.tensor([3]))
    assert (v.accepted, v.next_token) == (0, 3)


def test_gumbel_topk_draws_without_replacement():
    """N = 20 000 ordered pairs from 4 tokens (12 cells), significance 1e-3: detects TV ≥ 0.021 (printed)."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    g = torch.Generator().manual_seed(3)
    logits = probs.log().expand(SAMPLES, -1)  # [samples, vocab]
    exact = {(a, b): float(probs[a] * probs[b] / (1 - probs[a])) for a in range(4) for b in range(4) if a != b}
    pairs = [tuple(row) for row in gumbel_topk(logits, 2, g).tolist()]
    assert_same_distribution(pairs, exact)
    assert all(a != b for a, b in pairs)
    # positive control: plain Gumbel-max twice with replacement, pairs of equal tokens thrown away
    twice = torch.stack([gumbel_topk(logits, 1, g)[:, 0], gumbel_topk(logits, 1, g)[:, 0]], 1).tolist()
    assert_rejected([tuple(row) for row in twice if row[0] != row[1]], exact)


def _spread_row(vocab: int = 5 * 1024 + 100) -> tuple[torch.Tensor, dict[int, float]]:
    """A row of 20 tokens with weight among zeros, placed at the edges of `inverse_cdf`'s blocks (the first and last
    token of the vocabulary, tokens either side of a block's end) and inside them; unnormalized, as a residual is."""
    tokens = [0, 1, 1022, 1023, 1024, 1025, 1500, 2047, 2048, 3071, 3072, 3500, 4095, 4096, 4100, 5119, 5120, 5150,
              vocab - 2, vocab - 1]
    weights = torch.zeros(vocab)
    weights[tokens] = torch.linspace(0.2, 3.0, len(tokens))
    return weights, {t: float(weights[t] / weights.sum()) for t in tokens}


def test_multinomial_draws_a_rows_distribution_across_its_blocks():
    """N = 20 000 draws (rows of 5,220 tokens: six of `inverse_cdf`'s blocks), significance 1e-3 (TV printed); never
    a token of weight 0. Positive control: the same draws from the row shifted by one token are rejected."""
    weights, exact = _spread_row()
    g = torch.Generator().manual_seed(5)
    draws = torch.cat([multinomial(weights.expand(2_000, -1), g) for _ in range(SAMPLES // 2_000)]).tolist()
    assert set(draws) <= set(exact)
    assert_same_distribution(draws, exact)
    shifted = torch.cat([multinomial(weights.roll(1).expand(2_000, -1), g) for _ in range(3)]).tolist()
    assert_rejected([token - 1 for token in shifted], exact)


def test_inverse_cdf_keeps_to_tokens_with_weight_at_the_ends_of_its_range():
    """A draw of 0 gives the first token with weight, one a hair below 1 the last (rounding may carry it past every
    running sum: it stays on a token with weight), one at a block's exact end the next token with weight; a negative
    weight or a row with no positive finite weight is a clear error."""
    weights, _ = _spread_row()
    draws = torch.tensor([[0.0], [1.0 - 2**-53], [1.0]], dtype=torch.float64)
    assert inverse_cdf(weights.expand(3, -1), draws).tolist() == [0, len(weights) - 1, len(weights) - 1]
    exact = torch.zeros(3 * 1024)  # weights 1, 1, 2 on tokens 1023, 1024, 2047: every sum exact, the first block's end 1/4
    exact[[1023, 1024, 2047]] = torch.tensor([1.0, 1.0, 2.0])
    draws = torch.tensor([[0.0], [0.25 - 2**-54], [0.25], [0.5], [0.9]], dtype=torch.float64)
    assert inverse_cdf(exact.expand(5, -1), draws).tolist() == [1023, 1023, 1024, 2047, 2047]
    for bad in (torch.zeros(1, 10), torch.tensor([[0.5, float("nan")]]), torch.tensor([[float("inf"), 1.0]]),
                torch.tensor([[0.5, -0.1, 1.0]])):
        with pytest.raises(ValueError, match="positive, finite total"):
            inverse_cdf(bad, torch.zeros(1, 1, dtype=torch.float64))
