"""Cascades and derived drafts on tiny random models.

Greedy: vertical, horizontal and nested cascades, and reduced-vocabulary, layer-truncated and int8
drafts, are token-identical to the reference decoder. Sampling: chi-square tests (tests/stats.py)
against the exact target distribution: N = 3 000 sequences of 4 tokens (the first from the prefill,
then γ = 2 draft tokens, so a fully accepted block's bonus token is in the tested event), 12-token
vocabulary with top-k 4, significance 1e-3: any bias of total variation ≥ 0.12 is rejected with
≥ 90 % power (each test prints its figure). Positive control: the same test catches a draft level
that skips its rejection rule. The draft model's cache equals a fresh recompute of the path
it claims to hold after every step.
"""

import pytest
import torch
from conftest import make_tiny_model
from distribution import assert_rejected, assert_same_distribution, sample_sequences
from transformers import AutoModelForCausalLM

from verispec import Engine, GenerationConfig, SamplingParams
from verispec.drafters import DraftModelDrafter, NgramDrafter, make_drafter
from verispec.drafters.cascade import HorizontalCascadeDrafter, VerticalCascadeDrafter
from verispec.errors import InvalidParameterError
from verispec.models.loading import load_model
from verispec.models.variants import derive_model, truncated
from verispec.testing.reference import reference_generate, sequence_distribution

PROMPTS = [[5, 9, 2, 7], [11, 3, 3, 3, 8, 1, 30, 12, 5, 3, 3, 8], [40]]


@pytest.fixture(scope="module")
def expected(target, hf_target):
    """The reference decoder's 16 greedy tokens after each prompt."""
    return {tuple(p): reference_generate(hf_target, p, 16, eos_ids=target.eos_ids) for p in PROMPTS}


@pytest.fixture(scope="module")
def mini(tiny_dir):
    return load_model(make_tiny_model(tiny_dir / "mini", seed=9, layers=1, hidden=16))


def _cascades(target, draft, mini):
    vocab = target.vocab_size
    return {
        "vertical-ngram": VerticalCascadeDrafter(draft, NgramDrafter(max_n=2), vocab),
        "vertical-model": VerticalCascadeDrafter(draft, DraftModelDrafter(mini, vocab), vocab, inner_gamma=2),
        "vertical-self": VerticalCascadeDrafter(draft, DraftModelDrafter(draft, vocab), vocab),  # inner always accepted
        "nested": VerticalCascadeDrafter(target, VerticalCascadeDrafter(draft, DraftModelDrafter(mini, vocab), vocab), vocab),
        "horizontal": HorizontalCascadeDrafter(DraftModelDrafter(draft, vocab), NgramDrafter(max_n=2), 2, vocab),
        "horizontal-models": HorizontalCascadeDrafter(DraftModelDrafter(draft, vocab), DraftModelDrafter(mini, vocab), 1, vocab),
    }


@pytest.mark.parametrize("gamma", [1, 3, 6])
@pytest.mark.parametrize("kind", ["vertical-ngram", "vertical-model", "vertical-self", "nested", "horizontal", "horizontal-models"])
def test_greedy_cascades_are_token_identical(target, draft, mini, expected, kind, gamma):
    engine = Engine(target, _cascades(target, draft, mini)[kind], gamma=gamma, gamma_policy="constant")
    for prompt in PROMPTS:
        assert engine.generate(prompt, GenerationConfig(max_new_tokens=16)).token_ids == expected[tuple(prompt)]


@pytest.mark.parametrize("spec", ["self:layers=1", "self:layers=2,vocab=30", "model:{draft},vocab=24",
                                  "model:{draft},int8=1", "self:int8=1,layers=2", "cascade:draft={draft}",
                                  "cascade:kind=horizontal,strong=1,draft={draft}"])
def test_greedy_derived_drafts_are_token_identical(target, expected, tiny_draft, spec):
    engine = Engine(target, make_drafter(spec.format(draft=tiny_draft), target), gamma=4, gamma_policy="constant")
    for prompt in PROMPTS:
        assert engine.generate(prompt, GenerationConfig(max_new_tokens=16)).token_ids == expected[tuple(prompt)]


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=1.0)],
                         ids=["greedy", "sampled"])
def test_cascade_caches_hold_exactly_their_path(target, draft, mini, sampling):
    drafter = _cascades(target, draft, mini)["nested"]
    engine = Engine(target, drafter, gamma=4, gamma_policy="constant")
    generation = engine.start(PROMPTS[1], GenerationConfig(max_new_tokens=20, sampling=sampling, seed=3))
    while not generation.done:
        generation.step()
        outer, inner = generation.session, generation.session.inner
        for session, model in ((outer, target), (inner, draft)):
            cache, held = session.cache, session.cached
            assert cache.length == len(held) <= len(generation.ids) - 1
            assert held == generation.ids[: len(held)]
            if not held:  # after the first token: the draft reads the prompt in the next step
                continue
            fresh = model.runner.new_cache()
            model.runner.forward(fresh, torch.tensor(held), logits="none")
            torch.testing.assert_close(cache.keys[:, :, : cache.length], fresh.keys[:, :, : cache.length])
            torch.testing.assert_close(cache.values[:, :, : cache.length], fresh.values[:, :, : cache.length])


# --- derived drafts ------------------------------------------------------------------------------


def test_derived_models_share_weights_and_cut_the_head(target, draft):
    short = truncated(target.runner, 2)
    assert short.config.num_layers == 2 and all(a is b for a, b in zip(short.layers, target.runner.layers))
    assert short.new_cache().keys.shape[0] == 2
    reduced = derive_model(draft, vocab=20)
    ids = torch.tensor([3, 7, 11, 30])
    full_logits = draft.runner.forward(draft.runner.new_cache(), ids)  # [4, 48]
    cut_logits = reduced.runner.forward(reduced.runner.new_cache(), ids)  # [4, 48]
    torch.testing.assert_close(cut_logits[:, :20], full_logits[:, :20])
    assert torch.isinf(cut_logits[:, 20:]).all() and reduced.name.endswith(",vocab=20")
    int8 = derive_model(draft, int8=True)
    int8_logits = int8.runner.forward(int8.runner.new_cache(), ids)
    assert not torch.equal(int8_logits, full_logits)  # really quantized …
    torch.testing.assert_close(int8_logits, full_logits, atol=0.5, rtol=0.05)  # … and still close


@pytest.mark.parametrize("spec, option", [
    ("cascade:kind=diagonal", "kind"), ("cascade:strong=2", "strong"), ("cascade:kind=horizontal,inner_gamma=2", "inner_gamma"),
    ("cascade:max_n=x", "max_n"), ("self:layers=99", "layers"), ("self:depth=2", "depth"), ("self:int8=2", "int8"),
    ("self:layers=1,vocab=999", "vocab"), ("self:layers", "layers"),
])
def test_bad_options_name_the_option(target, spec, option):
    with pytest.raises(InvalidParameterError, match=option):
        make_drafter(spec, target)


def test_each_kind_alone_builds(target):
    assert make_drafter("self", target).model.runner.config.num_layers == 1  # a quarter of 3 layers, at least 1


# --- sampling: equal in distribution -------------------------------------------------------------


@pytest.fixture(scope="module")
def small_models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("small-cascade")
    target_dir = make_tiny_model(folder / "t", vocab_size=12, seed=21, layers=2)
    target = load_model(target_dir)
    target.eos_ids = frozenset()  # fixed-length sequences: the exact distribution is a simple product
    draft = load_model(make_tiny_model(folder / "d", vocab_size=12, seed=22, layers=1))
    mini = load_model(make_tiny_model(folder / "m", vocab_size=12, seed=23, layers=1, hidden=16))
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    return target, draft, mini, hf


PROMPT, LENGTH, GAMMA, SAMPLES = [3, 7], 4, 2, 3_000  # the first token comes from the prefill: 3 speculative


def _samples_and_exact(small_models, drafter_of, params: SamplingParams, n: int):
    target, draft, mini, hf = small_models
    engine = Engine(target, drafter_of(target, draft, mini), gamma=GAMMA, gamma_policy="constant")
    return sample_sequences(engine, PROMPT, params, n, LENGTH), sequence_distribution(hf, PROMPT, LENGTH, params)


def _vertical(target, draft, mini):
    return VerticalCascadeDrafter(draft, DraftModelDrafter(mini, 12), 12)


def _horizontal(target, draft, mini):
    return HorizontalCascadeDrafter(DraftModelDrafter(draft, 12), NgramDrafter(max_n=1), 1, 12)


@pytest.mark.parametrize("drafter_of", [_vertical, _horizontal], ids=["vertical", "horizontal"])
def test_sampled_cascades_are_distributed_as_the_target(small_models, drafter_of):
    result = assert_same_distribution(*_samples_and_exact(small_models, drafter_of, SamplingParams(temperature=1.0, top_k=4), SAMPLES))
    assert result.detectable_tv < 0.14  # the power the module doc promises


def test_the_test_catches_a_draft_level_without_rejection(small_models, monkeypatch):
    """If the draft model kept every inner token, its tokens would follow the inner model, not draft_probs."""
    import verispec.drafters.cascade as cascade_module
    from verispec.types import Origin, Verdict

    def accept_all(draft_tokens, draft_probs, target_probs, generator):
        return Verdict(len(draft_tokens), int(torch.multinomial(target_probs[-1], 1, generator=generator)), Origin.BONUS)

    monkeypatch.setattr(cascade_module, "verify_sampled", accept_all)
    assert_rejected(*_samples_and_exact(small_models, _vertical, SamplingParams(temperature=1.0, top_k=4), SAMPLES))
