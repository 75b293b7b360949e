"""STAND's table (the paper's worked example, back-off, persistence) and the drafter factory's options."""

import pytest
import torch

from verispec.drafters import make_drafter
from verispec.drafters.stand import StandDrafter, StandTable
from verispec.errors import InvalidParameterError
from verispec.sampling.processors import SamplingParams

BOB, MARY, TOM, SUE, I, AM = 1, 2, 3, 4, 5, 6


def test_repeat_sightings_blend_with_weights_k_over_k_plus_1():
    table = StandTable(max_n=2, min_n=2)
    table.update((I, AM), torch.tensor([BOB, MARY, TOM]), torch.tensor([0.7, 0.2, 0.05]))
    table.update((I, AM), torch.tensor([BOB, MARY, SUE]), torch.tensor([0.3, 0.6, 0.05]))
    seen, tokens, probs = table.entries[(I, AM)]
    assert seen == 2
    got = dict(zip(tokens, probs))
    assert got == pytest.approx({BOB: 0.5, MARY: 0.4, TOM: 0.025, SUE: 0.025})
    table.update((I, AM), torch.tensor([TOM]), torch.tensor([1.0]))  # third sighting: old × 2/3, new × 1/3
    got = dict(zip(*table.entries[(I, AM)][1:]))
    assert got[TOM] == pytest.approx(0.025 * 2 / 3 + 1 / 3) and got[BOB] == pytest.approx(0.5 * 2 / 3)


def test_entries_keep_only_the_top_10():
    table = StandTable()
    table.update((1, 2), torch.arange(20), torch.linspace(1, 0.05, 20))
    assert table.entries[(1, 2)][1] == tuple(range(10))


def test_lookup_backs_off_from_4_grams_to_2_grams():
    table = StandTable(max_n=4, min_n=2)
    table.update((7, 8), torch.tensor([1]), torch.tensor([1.0]))
    table.update((5, 6, 7, 8), torch.tensor([2]), torch.tensor([1.0]))
    assert table.lookup([5, 6, 7, 8])[0] == (2,)
    assert table.lookup([9, 6, 7, 8])[0] == (1,)
    assert table.lookup([9, 9, 9, 8]) is None


def test_observe_fills_every_n_gram_from_the_target_distributions():
    table = StandTable(max_n=3, min_n=2)
    target_probs = torch.softmax(torch.randn(2, 30, generator=torch.Generator().manual_seed(0)), -1)  # [2, vocab]
    table.observe([10, 11, 12, 13, 14], target_probs)  # rows produced ids 13 and 14
    assert set(table.entries) == {(11, 12), (10, 11, 12), (12, 13), (11, 12, 13)}
    tokens, probs = table.lookup([11, 12, 13])
    assert list(tokens) == torch.topk(target_probs[1], 10).indices.tolist()
    torch.testing.assert_close(torch.tensor(probs), torch.topk(target_probs[1], 10).values)


def test_the_table_persists_across_requests_and_on_disk(tmp_path):
    drafter = StandDrafter(vocab_size=20, max_n=3, k=2, depth=3)
    drafter.start([1, 2, 3, 4, 1, 2])
    second = drafter.start([9, 1, 2])  # the first prompt's n-grams are known to the second request
    draft = second.propose([9, 1, 2], 3, SamplingParams(), None)
    assert draft.tokens.tolist()[:2] == [3, 4] and draft.parents.tolist()[:2] == [-1, 0]
    drafter.save(tmp_path / "stand.json")
    loaded = StandDrafter(vocab_size=20, max_n=3)
    loaded.load(tmp_path / "stand.json")
    assert loaded.table.entries.keys() == drafter.table.entries.keys()
    for key, (seen, tokens, probs) in drafter.table.entries.items():
        assert loaded.table.entries[key] == (seen, tokens, probs)


def test_sampled_stand_drafts_carry_the_rows_they_were_drawn_from():
    drafter = StandDrafter(vocab_size=8, max_n=2, k=3, depth=2, wide=1)
    drafter.table.update((1, 2), torch.tensor([3, 4, 5]), torch.tensor([0.5, 0.3, 0.2]))
    draft = drafter.start([1, 2]).propose([1, 2], 2, SamplingParams(temperature=1.0), torch.Generator().manual_seed(1))
    roots = (draft.parents == -1).nonzero().flatten()
    assert sorted(draft.tokens[roots].tolist()) == [3, 4, 5]
    first = draft.tokens[roots[0]]
    torch.testing.assert_close(draft.probs[roots[0]][3:6], torch.tensor([0.5, 0.3, 0.2]))
    assert float(draft.probs[roots[1]][first]) == 0.0  # later siblings: drawn without the earlier ones


def test_factory_builds_model_free_drafters_and_names_bad_options(tiny_target):
    from verispec.models.loading import load_model

    target = load_model(tiny_target)
    stand = make_drafter("stand:max_n=3,k=3,depth=4", target)
    assert isinstance(stand, StandDrafter) and stand.fanout == {(): 3, (0,): 1, (1,): 1, (2,): 1, (0, 0): 1, (1, 0): 1, (2, 0): 1, (0, 0, 0): 1, (1, 0, 0): 1, (2, 0, 0): 1}
    assert stand.table.max_n == 3 and len(stand.paths) == 3 * 4
    assert isinstance(make_drafter("stand", target), StandDrafter)
    with pytest.raises(InvalidParameterError, match="'width'"):
        make_drafter("stand:width=3", target)
    with pytest.raises(InvalidParameterError, match="'gamma'.*max_n"):
        make_drafter("ngram:gamma=3", target)
    with pytest.raises(InvalidParameterError, match="depth"):
        make_drafter("stand:depth=0", target)
    for kind in ("tree", "merge", "hybrid"):  # option names are checked before the draft model loads
        with pytest.raises(InvalidParameterError, match=f"unknown {kind} drafter option 'bogus'"):
            make_drafter(f"{kind}:bogus=1", target)


# ---- the searched shape ---------------------------------------------------------------------------

def test_replay_counts_exactly_what_the_engine_accepts(target):
    """The shape search's replay of greedy STAND equals real decoding with that shape: same steps,
    same accepted tokens (so its per-node acceptance is what the engine would see)."""
    from verispec import Engine, GenerationConfig
    from verispec.drafters.branching import level_paths
    from verispec.tools.measure import teacher_forced_logits
    from verispec.tools.tree_search import replay

    prompt, shape = [5, 9, 2, 7, 5, 9, 2, 7, 11, 5, 9], level_paths(2, 3, 2)
    engine = Engine(target, StandDrafter(target.vocab_size, max_n=3, paths=shape), gamma=3, gamma_policy="constant")
    result = engine.generate(prompt, GenerationConfig(max_new_tokens=30))
    probs = torch.softmax(teacher_forced_logits(target, prompt + result.token_ids, len(prompt)), dim=-1)
    counts, steps = replay(StandDrafter(target.vocab_size, max_n=3, paths=shape), prompt, result.token_ids, probs, 3)
    assert steps == result.stats.steps and sum(counts.values()) == result.stats.accepted_tokens > 0
    assert set(counts) <= set(shape)


def test_ranking_keeps_every_prefix_a_tree():
    from collections import Counter

    from verispec.drafters.branching import check_paths, level_paths
    from verispec.tools.tree_search import expected_tokens_by_size, rank_nodes

    candidates = level_paths(3, 3, 3)
    counts = Counter({(0,): 9, (1,): 2, (2,): 5, (0, 0): 7, (0, 1): 8, (2, 0): 4})  # (2,) beats (1,): must wait for it
    ranking = rank_nodes(counts, candidates)
    assert ranking[:4] == [(0,), (0, 0), (0, 1), (1,)] and ranking.index((2,)) == 4 and len(ranking) == len(candidates)
    for n in range(1, len(ranking) + 1):
        check_paths(ranking[:n])  # raises if a prefix is not a tree
    sizes = expected_tokens_by_size(ranking, counts, steps=10)
    assert sizes[0] == 1 and sizes[1] == pytest.approx(1.9) and sizes == sorted(sizes)
    with pytest.raises(InvalidParameterError, match="lower-ranked sibling"):
        check_paths([(0,), (0, 1)])


def test_the_searched_shape_ships_and_is_selectable(target):
    from verispec.drafters.branching import check_paths
    from verispec.drafters.stand import searched_shape

    shipped = searched_shape(10)
    assert len(shipped) == 10 and check_paths(shipped) == shipped and shipped[0] == (0,)
    assert len(make_drafter("stand:nodes=10", target).paths) == 10
    with pytest.raises(InvalidParameterError, match="nodes=100000"):
        make_drafter("stand:nodes=100000", target)
