"""The runner against the transformers implementation, and its KV cache operations."""

import pytest
import torch
from conftest import make_tiny_model
from transformers import AutoModelForCausalLM

from verispec.models.transformer import Transformer


def _pair(folder):
    return Transformer.from_folder(folder), AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_logits_match_transformers_for_each_architecture(tmp_path):
    for arch in ("qwen2", "llama"):
        ours, hf = _pair(make_tiny_model(tmp_path / arch, arch=arch, seed=5))
        ids = torch.randint(0, 48, (12,), generator=torch.Generator().manual_seed(0))
        expected = hf(ids[None]).logits[0]  # [12, vocab]
        cache = ours.new_cache(4)  # small on purpose: must grow
        got = torch.cat([ours.forward(cache, ids[:5]), ours.forward(cache, ids[5:6]), ours.forward(cache, ids[6:])])
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_truncate_then_continue_equals_fresh_recompute(tiny_target):
    model = Transformer.from_folder(tiny_target)
    ids = torch.arange(3, 17)
    cache = model.new_cache()
    model.forward(cache, ids[:8], logits="none")
    model.forward(cache, torch.tensor([40, 41, 42, 43]), logits="none")  # a rejected draft
    cache.truncate(8)
    rolled = model.forward(cache, ids[8:])
    fresh_cache = model.new_cache()
    fresh = model.forward(fresh_cache, ids)[8:]
    torch.testing.assert_close(rolled, fresh)
    torch.testing.assert_close(cache.keys[:, :, :14], fresh_cache.keys[:, :, :14])


def test_tree_mask_and_keep_equal_the_chain(tiny_target):
    """Two branches in one forward; keeping branch B's slots equals running B as a chain."""
    model = Transformer.from_folder(tiny_target)
    prefix = torch.arange(5, 11)
    branch_a, branch_b = torch.tensor([20, 21]), torch.tensor([30, 31])
    cache = model.new_cache()
    model.forward(cache, prefix, logits="none")
    tokens = torch.cat([branch_a, branch_b])
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    positions = torch.tensor([6, 7, 6, 7])
    tree_logits = model.forward(cache, tokens, positions=positions, tree_mask=mask)
    cache.keep(6, torch.tensor([2, 3]))
    after_keep = model.forward(cache, torch.tensor([9]))

    chain_cache = model.new_cache()
    chain = model.forward(chain_cache, torch.cat([prefix, branch_b, torch.tensor([9])]))
    torch.testing.assert_close(tree_logits[2:], chain[6:8], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(after_keep[0], chain[8], atol=1e-5, rtol=1e-5)


def test_packed_linear_equals_f_linear():
    from verispec.models.linear import PackedLinear, packing_available

    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(384, 256, generator=g), torch.randn(384, generator=g)
    layer = PackedLinear(weight, bias)
    assert layer.packed == packing_available()
    for rows in (1, 3, 9):
        x = torch.randn(rows, 256, generator=g)
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, weight, bias), atol=1e-4, rtol=1e-4)


def test_forward_ragged_equals_per_row_forward(tiny_target):
    """Rows of different cache lengths and feed widths in one pass give each row's own logits."""
    model = Transformer.from_folder(tiny_target)
    g = torch.Generator().manual_seed(3)
    prefixes = [torch.randint(0, 48, (n,), generator=g) for n in (3, 9, 1, 6)]
    feeds = [torch.randint(0, 48, (n,), generator=g) for n in (5, 1, 3, 2)]
    solo_caches, ragged_caches = [model.new_cache(4) for _ in prefixes], [model.new_cache(4) for _ in prefixes]
    for prefix, solo, ragged in zip(prefixes, solo_caches, ragged_caches):
        model.forward(solo, prefix, logits="none")
        model.forward(ragged, prefix, logits="none")
    expected = [model.forward(cache, feed) for cache, feed in zip(solo_caches, feeds)]
    got = model.forward_ragged(ragged_caches, feeds)
    for want, have, solo, ragged in zip(expected, got, solo_caches, ragged_caches):
        assert have.shape == want.shape
        torch.testing.assert_close(have, want, atol=1e-4, rtol=1e-4)
        assert ragged.length == solo.length
        torch.testing.assert_close(ragged.keys[:, :, : ragged.length], solo.keys[:, :, : solo.length], atol=1e-5, rtol=1e-5)
    # the caches keep working afterwards, as after a plain forward
    torch.testing.assert_close(model.forward(ragged_caches[1], feeds[0]), model.forward(solo_caches[1], feeds[0]), atol=1e-4, rtol=1e-4)


def test_forward_ragged_takes_tree_rows(tiny_target):
    """A token-tree row (positions + tree mask) next to a chain row gives what `forward` gives each."""
    model = Transformer.from_folder(tiny_target)
    prefix = torch.tensor([4, 8, 15, 16])
    tree = torch.tensor([23, 42, 7, 9])  # root 23 with children 42 and 7; 9 under 42
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    positions = torch.tensor([4, 5, 5, 6])
    chain = torch.tensor([3, 5])
    caches = {name: [model.new_cache(), model.new_cache()] for name in ("solo", "ragged")}
    for solo, ragged in zip(caches["solo"], caches["ragged"]):
        model.forward(solo, prefix, logits="none")
        model.forward(ragged, prefix, logits="none")
    want = [model.forward(caches["solo"][0], tree, positions=positions, tree_mask=mask),
            model.forward(caches["solo"][1], chain)]
    got = model.forward_ragged(caches["ragged"], [tree, chain], positions=[positions, None], tree_masks=[mask, None])
    for have, expected in zip(got, want):
        torch.testing.assert_close(have, expected, atol=1e-4, rtol=1e-4)
    sibling_logits = model.forward(model.new_cache(), torch.cat([prefix, tree[[0, 2]]]))[-1]  # 7 sees 23 only
    torch.testing.assert_close(got[0][2], sibling_logits, atol=1e-4, rtol=1e-4)


def test_forward_ragged_refuses_a_cache_twice_or_a_missing_feed(tiny_target):
    """`forward_ragged` checks its rows before any work (the check `ragged_rows` the backends share).
    Fails on a check that lets the same cache stand for two rows, which would feed it twice."""
    model = Transformer.from_folder(tiny_target)
    cache, other, feed = model.new_cache(), model.new_cache(), torch.tensor([3, 4])
    with pytest.raises(ValueError, match="the same cache twice"):
        model.forward_ragged([cache, cache], [feed, feed])
    with pytest.raises(ValueError, match="one feed per cache, got 2 caches and 1 feeds"):
        model.forward_ragged([cache, other], [feed])
    assert cache.length == other.length == 0  # nothing was fed
