"""The rejection rule alone, on random distributions: output distribution equals the target's.

Each test decodes sequences of 2 tokens with position-dependent (context-free) target and draft
distributions over a 6-token vocabulary, draft γ = 2 per step, N = 20 000 sequences, and runs a
chi-square goodness-of-fit against the exact product distribution at significance 1e-3. The same
harness run with a deliberately wrong rule must reject, which shows the test has power.
"""

import pytest
import torch
from stats import SIGNIFICANCE, chi_square_pvalue

from verispec.sampling.samplers import gumbel_topk, multinomial
from verispec.types import Origin, Verdict
from verispec.verify import verify_greedy, verify_sampled
from verispec.verify.chain import _first_false

VOCAB, LENGTH, SAMPLES, GAMMA = 6, 2, 20_000, 2


def _random_dists(seed: int, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(positions, VOCAB, generator=g) * 1.5, -1)  # [positions, vocab]
    draft = torch.softmax(torch.randn(positions, VOCAB, generator=g) * 1.5, -1)
    return target, draft


def _decode(verify, target, draft, point_mass: bool, seed: int) -> list[tuple[int, ...]]:
    """Speculative decoding of LENGTH tokens; the distribution at a position depends only on the position."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(SAMPLES):
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


def _exact(target) -> dict[tuple[int, ...], float]:
    return {(a, b): float(target[0, a] * target[1, b]) for a in range(VOCAB) for b in range(VOCAB)}


def _wrong_residual(draft_tokens, draft_probs, target_probs, generator):
    """Bug on purpose: after a rejection, sample from the target instead of the residual."""
    gamma = draft_tokens.shape[0]
    idx = torch.arange(gamma)
    d = draft_probs[idx, draft_tokens] if draft_probs is not None else torch.ones(gamma)
    u = torch.rand(gamma, generator=generator)
    n = _first_false(u * d < target_probs[idx, draft_tokens])
    return Verdict(n, int(multinomial(target_probs[n : n + 1], generator)), Origin.RECOVERED)


@pytest.mark.parametrize("point_mass", [False, True], ids=["sampled-draft", "deterministic-draft"])
def test_rejection_rule_is_lossless(point_mass):
    target, draft = _random_dists(seed=7, positions=LENGTH + GAMMA + 1)
    samples = _decode(verify_sampled, target, draft, point_mass, seed=11)
    assert chi_square_pvalue(samples, _exact(target)) > SIGNIFICANCE


@pytest.mark.parametrize("point_mass", [False, True], ids=["sampled-draft", "deterministic-draft"])
def test_a_wrong_rule_is_caught(point_mass):
    target, draft = _random_dists(seed=7, positions=LENGTH + GAMMA + 1)
    samples = _decode(_wrong_residual, target, draft, point_mass, seed=11)
    assert chi_square_pvalue(samples, _exact(target)) < SIGNIFICANCE


def test_greedy_verification_keeps_the_longest_agreeing_prefix():
    v = verify_greedy(torch.tensor([4, 5, 6]), torch.tensor([4, 5, 9, 1]))
    assert (v.accepted, v.next_token, v.next_origin) == (2, 9, Origin.RECOVERED)
    v = verify_greedy(torch.tensor([4, 5]), torch.tensor([4, 5, 0]))  # token id 0 is a normal token
    assert (v.accepted, v.next_token, v.next_origin) == (2, 0, Origin.BONUS)
    v = verify_greedy(torch.tensor([], dtype=torch.long), torch.tensor([3]))
    assert (v.accepted, v.next_token) == (0, 3)


def test_gumbel_topk_draws_without_replacement():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    g = torch.Generator().manual_seed(3)
    logits = probs.log().expand(SAMPLES, -1)  # [samples, vocab]
    pairs = [tuple(row) for row in gumbel_topk(logits, 2, g).tolist()]
    exact = {(a, b): float(probs[a] * probs[b] / (1 - probs[a])) for a in range(4) for b in range(4) if a != b}
    assert chi_square_pvalue(pairs, exact) > SIGNIFICANCE
    assert all(a != b for a, b in pairs)
