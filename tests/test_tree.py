"""Token trees in the engine, on tiny random models, against the reference decoder.

Greedy: token-identical to the target alone for every tree drafter. Cache: after every tree step the
target's (and the draft's) KV cache equals a fresh recompute of the committed ids. Sampling: one
end-to-end chi-square test per sampled tree drafter against the exact distribution the reference
enumerates: N = 1 000 sequences of 3 tokens, trees of depth γ = 2 (so the bonus token after a fully
accepted tree is in the tested event), 12-token vocabulary with top-k 4 (64 sequences),
significance 1e-3: any bias of total variation ≥ 0.18 is rejected with ≥ 90 % power (the test
prints its figure). Positive control: the same test on a third of the samples rejects a verifier
that emits token 0 as every bonus token.
"""

import pytest
import torch
from distribution import assert_rejected, assert_same_distribution, sample_sequences, token_0_as_every_bonus

from verispec import Engine, GenerationConfig, SamplingParams
from verispec.drafters.branching import TreeBuilder
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.tree import ExpansionDrafter, MergeDrafter
from verispec.testing.reference import reference_generate, sequence_distribution
from verispec.tokentree import ancestor_mask, path_to, tree_attention_mask
from verispec.types import Draft

PROMPTS = [[5, 9, 2, 7], [11, 3, 3, 3, 8, 1, 30, 12, 5, 11, 3, 3], [40]]


def tree_drafters(target, draft, kind):
    vocab = target.vocab_size
    if kind == "expansion":
        return ExpansionDrafter(draft, vocab, k=2, depth=3, wide=2)
    if kind == "expansion-self":  # the target as its own draft: deep accepted paths and bonus tokens
        return ExpansionDrafter(target, vocab, k=3, depth=4, wide=1)
    if kind == "merge":
        return MergeDrafter.model_and_ngram(draft, vocab)
    if kind == "stand":
        from verispec.drafters.stand import StandDrafter

        return StandDrafter(vocab, k=2, depth=4)
    if kind == "ngram-tree":
        from verispec.drafters.ngram import NgramDrafter

        return NgramDrafter(nodes=8)
    if kind == "lookup":
        return MergeDrafter.lookup(vocab, nodes=8, table_nodes=8)
    from verispec.drafters.hybrid import HybridDrafter

    return HybridDrafter(DraftModelDrafter(draft, vocab))


KINDS = ["expansion", "expansion-self", "merge", "stand", "hybrid", "ngram-tree", "lookup"]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tree_decoding_is_token_identical_to_the_reference(target, draft, hf_target, kind):
    engine = Engine(target, tree_drafters(target, draft, kind), gamma=4, gamma_policy="constant")
    for prompt in PROMPTS:
        expected = reference_generate(hf_target, prompt, 20, eos_ids=target.eos_ids)
        assert engine.generate(prompt, GenerationConfig(max_new_tokens=20)).token_ids == expected


def test_hybrid_tells_the_policy_which_source_drafts_each_step(target, draft, hf_target):
    """`hint` chooses the step's source: after a repeated prompt prompt lookup's class (its matched length, free:
    no draft forward), and `propose` drafts that chain; after text never seen the draft model's class
    (`MODEL_STEPS`), and `propose` drafts what the model alone would. Under the analytic policy the output stays
    the target's."""
    from verispec.drafters.hybrid import MODEL_STEPS

    repeated, fresh = [5, 9, 2, 7, 11, 3] * 4, [5, 9, 2, 7]
    session = tree_drafters(target, draft, "hybrid").start(repeated)
    hint = session.hint(repeated)
    assert hint.free and hint.key == 3
    assert session.propose(repeated, 5, SamplingParams(), None).tokens.tolist() == [5, 9, 2, 7, 11]
    session = tree_drafters(target, draft, "hybrid").start(fresh)
    assert session.hint(fresh) == MODEL_STEPS and not MODEL_STEPS.free
    alone = DraftModelDrafter(draft, target.vocab_size).start(fresh).propose(fresh, 3, SamplingParams(), None)
    assert session.propose(fresh, 3, SamplingParams(), None).tokens.tolist() == alone.tokens.tolist()
    engine = Engine(target, tree_drafters(target, draft, "hybrid"), gamma=2, gamma_policy="analytic")
    result = engine.generate(repeated, GenerationConfig(max_new_tokens=20))
    assert result.token_ids == reference_generate(hf_target, repeated, 20, eos_ids=target.eos_ids)


@pytest.mark.parametrize("params", [SamplingParams(repetition_penalty=1.8),
                                    SamplingParams(presence_penalty=1.5, frequency_penalty=0.5, logit_bias={7: 3.0, 2: -2.0})], ids=str)
def test_greedy_trees_with_penalties_and_bias_match_the_reference(target, draft, hf_target, params):
    engine = Engine(target, tree_drafters(target, draft, "expansion"), gamma=3, gamma_policy="constant")
    expected = reference_generate(hf_target, PROMPTS[1], 16, params, eos_ids=target.eos_ids)
    assert engine.generate(PROMPTS[1], GenerationConfig(max_new_tokens=16, sampling=params)).token_ids == expected


@pytest.mark.parametrize("kind", ["expansion", "expansion-self"])
def test_greedy_trees_hold_off_the_end_until_min_tokens(target, draft, hf_target, kind):
    """EOS pushed up by a logit bias: a tree's nodes at every depth are masked by their own output position."""
    eos = min(target.eos_ids)
    params = SamplingParams(logit_bias={eos: 4.0})
    engine = Engine(target, tree_drafters(target, draft, kind), gamma=4, gamma_policy="constant")

    def allowed(new_tokens):
        mask = torch.ones(target.vocab_size, dtype=torch.bool)
        mask[eos] = len(new_tokens) >= 8
        return mask

    expected = reference_generate(hf_target, PROMPTS[1], 16, params, eos_ids=target.eos_ids, allowed=allowed)
    result = engine.generate(PROMPTS[1], GenerationConfig(max_new_tokens=16, sampling=params, min_tokens=8))
    assert result.token_ids == expected and len(expected) >= 8


def test_min_tokens_masks_a_trees_rows_by_their_output_position(target):
    """Rows are masked by depth, not by index: the second child of the root is as early as the first."""
    from verispec.engine.shapes import shape_of

    eos = min(target.eos_ids)
    generation = Engine(target, None).start(PROMPTS[0], GenerationConfig(max_new_tokens=16, min_tokens=3))
    assert len(generation.output_ids) == 1  # the prefill's token: two more positions may not end the answer
    tree = Draft(torch.tensor([7, 8, 9, 10, 11]), None, torch.tensor([-1, -1, 0, 1, 2]))  # depths 1 1 2 2 3
    allowed = generation._allowed_rows(tree, shape_of(tree))  # [6, vocab]: the root's row, then each node's
    assert allowed[:, eos].tolist() == [False, False, False, True, True, True]
    assert allowed[:, 7].all()
    generation.close()


def test_tree_mask_is_the_ancestor_relation():
    parents = torch.tensor([-1, -1, 0, 0, 2, 1])
    mask = tree_attention_mask(parents)
    for i in range(len(parents)):
        for j in range(len(parents)):
            assert bool(mask[i + 1, j + 1]) == (j in path_to(parents, i))
    assert mask[:, 0].all() and not mask[0, 1:].any()
    assert torch.equal(mask[1:, 1:], ancestor_mask(parents))


@pytest.mark.parametrize("kind", ["expansion", "merge"])
def test_caches_hold_exactly_the_accepted_path_after_tree_steps(target, draft, kind):
    engine = Engine(target, tree_drafters(target, draft, kind), gamma=3, gamma_policy="constant")
    generation = engine.start(PROMPTS[1], GenerationConfig(max_new_tokens=15))
    tree_steps = 0
    while not generation.done:
        plan = generation.plan()
        tree_steps += plan.tree_mask is not None
        logits = target.runner.forward(generation.cache, plan.feed, plan.positions, plan.tree_mask)
        generation.commit(plan, logits, 0.0)
        assert generation.cache.length == len(generation.ids) - 1
        session = generation.session
        draft_cache = session.cache if kind == "expansion" else session.sessions[0].cache
        assert draft_cache.length <= len(generation.ids) - 1
        for model, cache in ((target, generation.cache), (draft, draft_cache)):
            fresh = model.runner.new_cache()
            model.runner.forward(fresh, torch.tensor(generation.ids[: cache.length]), logits="none")
            torch.testing.assert_close(cache.keys[:, :, : cache.length], fresh.keys[:, :, : cache.length])
            torch.testing.assert_close(cache.values[:, :, : cache.length], fresh.values[:, :, : cache.length])
    assert tree_steps > 0


# --- sampling: equal in distribution -------------------------------------------------------------


PROMPT, LENGTH, GAMMA, SAMPLES = [3, 7, 3], 3, 2, 1_000
PARAMS = SamplingParams(temperature=1.0, top_k=4)


@pytest.mark.parametrize("kind", ["expansion", "stand"])  # mixed (merge) rows: test_tree_verify.py
def test_sampled_tree_drafts_are_lossless(small_pair, kind):
    target, draft, hf = small_pair
    engine = Engine(target, tree_drafters(target, draft, kind), gamma=GAMMA, gamma_policy="constant")
    samples = sample_sequences(engine, PROMPT, PARAMS, SAMPLES, LENGTH)
    result = assert_same_distribution(samples, sequence_distribution(hf, PROMPT, LENGTH, PARAMS))
    assert result.detectable_tv < 0.18  # the power the module doc promises


def test_sampled_ngram_trees_are_lossless(small_pair):
    """Deterministic trees (point-mass nodes): a prompt where the last token occurred twice before, followed by
    different tokens, so the first step's draft branches (checked), and the outputs keep repeating tokens."""
    target, draft, hf = small_pair
    prompt = [3, 7, 3, 5, 3]
    drafter = tree_drafters(target, draft, "ngram-tree")
    assert drafter.start(prompt).propose(prompt, GAMMA, PARAMS, None).parents.tolist() == [-1, 0, -1, 2]  # 5 3 | 7 3
    engine = Engine(target, drafter, gamma=GAMMA, gamma_policy="constant")
    samples = sample_sequences(engine, prompt, PARAMS, SAMPLES, LENGTH)
    result = assert_same_distribution(samples, sequence_distribution(hf, prompt, LENGTH, PARAMS))
    assert result.detectable_tv < 0.18


def test_sampled_lookup_trees_are_lossless(small_pair, monkeypatch):
    """Prompt lookup's deterministic nodes and STAND's sampled ones in one tree (`lookup`): some step's tree holds
    both kinds (checked), and the outputs are the target's distribution."""
    target, draft, hf = small_pair
    prompt = [3, 7, 3, 5, 3]
    drafter = tree_drafters(target, draft, "lookup")
    kinds = set()
    build = TreeBuilder.build

    def recording(builder, vocab_size):
        if len(builder.tokens):
            kinds.add((any(row is None for row in builder.rows), any(row is not None for row in builder.rows)))
        return build(builder, vocab_size)

    monkeypatch.setattr(TreeBuilder, "build", recording)
    engine = Engine(target, drafter, gamma=GAMMA, gamma_policy="constant")
    samples = sample_sequences(engine, prompt, PARAMS, SAMPLES, LENGTH)
    assert (True, True) in kinds  # a mixed tree: deterministic and sampled nodes side by side
    result = assert_same_distribution(samples, sequence_distribution(hf, prompt, LENGTH, PARAMS))
    assert result.detectable_tv < 0.18


def test_merged_trees_share_deterministic_paths_and_keep_sampled_nodes_apart():
    builder = TreeBuilder()
    builder.add_draft(Draft(torch.tensor([5, 3, 7, 3]), None, torch.tensor([-1, 0, -1, 2])), gamma=4)  # 5 3 | 7 3
    row = torch.full((10,), 0.1)
    builder.add_draft(Draft(torch.tensor([7, 3, 9, 5]), None, torch.tensor([-1, 0, 1, -1])), gamma=4)  # 7 3 9 | 5
    builder.add_draft(Draft(torch.tensor([5, 8]), torch.stack([row, row]), torch.tensor([-1, 0])), gamma=4)  # sampled
    builder.add_draft(Draft(torch.tensor([7, 3, 1])), gamma=2)  # a chain: its first γ tokens, both already there
    assert builder.tokens == [5, 3, 7, 3, 9, 5, 8]
    assert builder.parents == [-1, 0, -1, 2, 3, -1, 5]  # 9 under the first tree's 7 3; the sampled 5 its own branch


def test_the_end_to_end_test_catches_a_wrong_bonus(small_pair, monkeypatch):
    import verispec.engine.shapes as engine_module

    monkeypatch.setattr(engine_module, "verify_tree_sampled", token_0_as_every_bonus)
    target, draft, hf = small_pair
    engine = Engine(target, tree_drafters(target, draft, "expansion"), gamma=GAMMA, gamma_policy="constant")
    samples = sample_sequences(engine, PROMPT, PARAMS, SAMPLES // 3, LENGTH)
    assert_rejected(samples, sequence_distribution(hf, PROMPT, LENGTH, PARAMS))
