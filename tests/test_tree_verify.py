"""Tree verification alone, on random distributions: the output distribution equals the target's.

Each test decodes sequences of LENGTH = 3 tokens, one more than the tree's depth, so the tested
event holds the bonus token after a fully accepted first tree, over a 6-token vocabulary (216
cells) with position-dependent (context-free) target and draft distributions. Every step drafts a
tree of shape (3, 2): three children of the last committed token, two children under each.
Children are drawn i.i.d. from the draft (SpecInfer), without replacement (Gumbel-top-k), are
deterministic top-k candidates, or mix a deterministic first child with sampled ones. Chi-square
test of tests/stats.py against the exact product distribution, significance 1e-3, N = 5 000
sequences: any bias of total variation ≥ 0.10 is rejected with ≥ 90 % power whatever its shape
(each test prints its figure). Positive controls, the same harness with a deliberately wrong rule
on a third of the samples, must reject: a drafter stating the wrong rows for draws without
replacement; a verifier that forgets to update the residual after a rejected child; a verifier
that emits token 0 as every bonus token.
"""

import pytest
import torch
from distribution import assert_rejected, assert_same_distribution, product_distribution, random_dists, token_0_as_every_bonus

import verispec.verify.tree as tree_module
from verispec.drafters.branching import TreeBuilder
from verispec.sampling.samplers import gumbel_topk, multinomial, without_replacement_probs
from verispec.tokentree import ancestor_mask, depths, keep_nodes, path_to
from verispec.types import Origin
from verispec.verify import verify_tree_greedy, verify_tree_sampled

VOCAB, SAMPLES, SHAPE = 6, 5_000, (3, 2)
LENGTH = len(SHAPE) + 1  # deeper than the tree: the bonus token is part of the tested event
MODES = ["iid", "distinct", "point", "mixed"]


def _children(mode: str, draft_row: torch.Tensor, k: int, g, honest: bool) -> tuple[list[int], list]:
    """k children of a node whose draft distribution is draft_row [vocab], with the rows they were drawn from."""
    if mode == "iid":
        return multinomial(draft_row.expand(k, -1), g).tolist(), [draft_row] * k
    if mode == "distinct":
        tokens = gumbel_topk(draft_row.log()[None], k, g)[0]
        rows = without_replacement_probs(draft_row, tokens) if honest else draft_row.expand(k, -1)
        return tokens.tolist(), list(rows)
    if mode == "point":
        return torch.topk(draft_row, k).indices.tolist(), [None] * k
    first = int(draft_row.argmax())  # mixed: a deterministic candidate, then i.i.d. samples
    return [first] + multinomial(draft_row.expand(k - 1, -1), g).tolist(), [None] + [draft_row] * (k - 1)


def _draft_tree(mode, draft, start, g, honest=True):
    builder = TreeBuilder()
    frontier = [-1]
    for level, k in enumerate(SHAPE):
        row = draft[min(start + level, draft.shape[0] - 1)]
        grown = []
        for parent in frontier:
            tokens, rows = _children(mode, row, k, g, honest)
            grown += [builder.add(t, parent, r) for t, r in zip(tokens, rows)]
        frontier = grown
    return builder.build(VOCAB)


def _decode(mode, target, draft, seed, honest=True, verify=verify_tree_sampled, samples=SAMPLES) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(samples):
        seq: list[int] = []
        while len(seq) < LENGTH:
            d = _draft_tree(mode, draft, len(seq), g, honest)
            rows = torch.cat([torch.zeros(1, dtype=torch.long), depths(d.parents)]) + len(seq)  # [n+1]
            target_probs = target[rows.clamp(max=target.shape[0] - 1)]  # [n+1, vocab]
            verdict = verify(d.tokens, d.parents, d.probs, target_probs, g)
            seq += d.tokens[list(verdict.path)].tolist() + [verdict.next_token]
        out.append(tuple(seq[:LENGTH]))
    return out


@pytest.fixture(scope="module")
def dists():
    return random_dists(seed=7, positions=LENGTH + len(SHAPE) + 1, vocab=VOCAB)


@pytest.mark.parametrize("mode", MODES)
def test_tree_rejection_rule_is_lossless(dists, mode):
    target, draft = dists
    result = assert_same_distribution(_decode(mode, target, draft, seed=11), product_distribution(target, LENGTH))
    assert result.detectable_tv < 0.1  # the power the module doc promises


# Positive controls run on a third of the samples: a rule caught with less data is caught by the full test.
CONTROL_SAMPLES = SAMPLES // 3


def test_wrong_rows_for_draws_without_replacement_are_caught(dists):
    target, draft = dists
    samples = _decode("distinct", target, draft, seed=11, honest=False, samples=CONTROL_SAMPLES)
    assert_rejected(samples, product_distribution(target, LENGTH))


def test_a_verifier_that_keeps_the_old_residual_is_caught(dists, monkeypatch):
    monkeypatch.setattr(tree_module, "residual_distribution", lambda residual, row, token: residual)
    target, draft = dists
    assert_rejected(_decode("iid", target, draft, seed=11, samples=CONTROL_SAMPLES), product_distribution(target, LENGTH))


def test_a_verifier_that_emits_token_0_as_every_bonus_is_caught(dists):
    target, draft = dists
    samples = _decode("point", target, draft, seed=11, verify=token_0_as_every_bonus, samples=CONTROL_SAMPLES)
    assert_rejected(samples, product_distribution(target, LENGTH))


# --- greedy and structure ------------------------------------------------------------------------


def test_greedy_tree_follows_the_target_argmax_to_the_deepest_node():
    #            root → 4 (0) → 5 (2) → 6 (4)
    #                 → 7 (1) → 5 (3)
    tokens, parents = torch.tensor([4, 7, 5, 5, 6]), torch.tensor([-1, -1, 0, 1, 2])
    v = verify_tree_greedy(tokens, parents, torch.tensor([7, 5, 5, 9, 9, 1]))  # argmax at root, after 0..4
    assert (v.path, v.next_token, v.next_origin) == ((1, 3), 9, Origin.BONUS)
    v = verify_tree_greedy(tokens, parents, torch.tensor([4, 5, 5, 6, 9, 0]))
    assert (v.path, v.next_token, v.next_origin) == ((0, 2, 4), 0, Origin.BONUS)
    v = verify_tree_greedy(tokens, parents, torch.tensor([4, 8, 5, 6, 9, 0]))
    assert (v.path, v.next_token, v.next_origin) == ((0,), 8, Origin.RECOVERED)
    v = verify_tree_greedy(tokens, parents, torch.tensor([3, 5, 5, 6, 9, 0]))
    assert (v.accepted, v.path, v.next_token) == (0, (), 3)


def test_duplicate_siblings_take_the_longer_accepted_path():
    tokens, parents = torch.tensor([4, 4, 8]), torch.tensor([-1, -1, 1])
    v = verify_tree_greedy(tokens, parents, torch.tensor([4, 1, 8, 2]))
    assert v.path == (1, 2) and v.next_token == 2


def test_ancestor_mask_matches_a_brute_force_walk():
    g = torch.Generator().manual_seed(5)
    for n in (0, 1, 5, 17, 48):
        parents = torch.tensor([int(torch.randint(-1, i, (1,), generator=g)) if i else -1 for i in range(n)], dtype=torch.long)
        brute = torch.tensor([[j in path_to(parents, i) for j in range(n)] for i in range(n)], dtype=torch.bool).reshape(n, n)
        assert torch.equal(ancestor_mask(parents), brute)
        assert torch.equal(depths(parents), torch.tensor([len(path_to(parents, i)) for i in range(n)], dtype=torch.long))


def test_keep_nodes_renumbers_parents():
    parents = torch.tensor([-1, 0, -1, 1, 2])
    index, renumbered = keep_nodes(parents, torch.tensor([True, True, True, False, True]))
    assert index.tolist() == [0, 1, 2, 4] and renumbered.tolist() == [-1, 0, -1, 2]


def test_without_replacement_rows_remove_the_earlier_draws():
    rows = without_replacement_probs(torch.tensor([0.5, 0.25, 0.15, 0.1]), torch.tensor([1, 0]))
    torch.testing.assert_close(rows, torch.tensor([[0.5, 0.25, 0.15, 0.1], [0.5 / 0.75, 0.0, 0.15 / 0.75, 0.1 / 0.75]]))
