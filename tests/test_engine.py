"""The engine against the reference decoder on tiny random models.

Greedy: token-identical for every drafter and γ. Sampling: end-to-end chi-square tests (tests/stats.py)
of the speculative output against the exact distribution the reference enumerates, for plain
temperature and each truncation method: sequences of 3 tokens after γ = 2 draft tokens (so a fully
accepted block's bonus token is in the tested event), 12-token vocabulary, significance 1e-3.
Untruncated (1 728 sequences, the rare ones pooled): N = 3 000, any bias of total variation
≥ 0.15 is rejected with ≥ 90 % power. Truncated (14–64 sequences; the repetition penalty and the
n-gram drafter's point masses are tested under top-4, as are the presence and frequency penalties with a logit bias): N = 1 200, TV ≥ 0.09–0.14;
a processor applied to one side only shifts far more mass than that, and the rule itself is tested
with more power in test_verify.py. Each test prints its figure. Positive control: the same test on
1 000 samples rejects a verifier that accepts every draft token.
"""

import pytest
import torch
from distribution import accept_every_draft_token, assert_rejected, assert_same_distribution, sample_sequences

from verispec import Engine, GenerationConfig, SamplingParams, load
from verispec.engine import EngineBuilder
from verispec.drafters import DraftModelDrafter, NgramDrafter, make_drafter
from verispec.errors import IncompatibleModelsError, InvalidParameterError, ModelNotFoundError, PromptError
from verispec.models.linear import VERIFY_ROWS
from verispec.models.loading import ModelCache, load_model
from verispec.testing.reference import reference_generate, sequence_distribution

PROMPTS = [[5, 9, 2, 7], [11, 3, 3, 3, 8, 1, 30, 12, 5], [40]]


def _drafters(target, draft):
    return {
        "model": DraftModelDrafter(draft, target.vocab_size),
        "self": DraftModelDrafter(target, target.vocab_size),  # always accepted: bonus and lagging-draft paths
        "ngram": NgramDrafter(max_n=3),
        "ngram-oldest": NgramDrafter(max_n=3, oldest=1),
        "none": None,
    }


@pytest.mark.parametrize("gamma", [1, 3, 8])
@pytest.mark.parametrize("kind", ["model", "self", "ngram", "ngram-oldest", "none"])
def test_greedy_is_token_identical_to_the_reference(target, draft, hf_target, kind, gamma):
    engine = Engine(target, _drafters(target, draft)[kind], gamma=gamma, gamma_policy="constant")
    for prompt in PROMPTS:
        expected = reference_generate(hf_target, prompt, 20, eos_ids=target.eos_ids)
        assert engine.generate(prompt, GenerationConfig(max_new_tokens=20)).token_ids == expected


@pytest.mark.parametrize("policy", ["heuristic", "analytic"])
def test_adaptive_gamma_policies_stay_exact(target, draft, hf_target, policy):
    engine = Engine(target, DraftModelDrafter(draft, target.vocab_size), gamma=2, gamma_policy=policy)
    expected = reference_generate(hf_target, PROMPTS[1], 24, eos_ids=target.eos_ids)
    assert engine.generate(PROMPTS[1], GenerationConfig(max_new_tokens=24)).token_ids == expected


def test_the_cache_reserves_little_up_front_and_grows_exactly(target, draft, hf_target, monkeypatch):
    """A request asking for many tokens does not allocate them all at once; the cache grows as the
    sequence does and the output stays the reference's."""
    from verispec.engine import Generation

    monkeypatch.setattr(Generation, "INITIAL_SPARE", 2)
    engine = Engine(target, DraftModelDrafter(draft, target.vocab_size), gamma=3, gamma_policy="constant")
    generation = engine.start(PROMPTS[1], GenerationConfig(max_new_tokens=40))
    assert generation.cache.capacity <= len(generation.ids) + 2 + engine.max_gamma + 2
    while not generation.done:
        generation.step()
    assert generation.result().token_ids == reference_generate(hf_target, PROMPTS[1], 40, eos_ids=target.eos_ids)


@pytest.mark.parametrize("params", [SamplingParams(repetition_penalty=1.8),
                                    SamplingParams(presence_penalty=1.5, frequency_penalty=0.5, logit_bias={7: 3.0, 2: -2.0})], ids=str)
@pytest.mark.parametrize("drafting", ["draft", "self"])
def test_greedy_with_penalties_and_bias_matches_reference(target, draft, hf_target, params, drafting):
    """`self`: the target drafts for itself, so every draft is accepted and a block's later rows must count
    the drafts before them (the tiny draft's are nearly all rejected under these penalties)."""
    engine = Engine(target, DraftModelDrafter(draft if drafting == "draft" else target, target.vocab_size), gamma=4,
                    gamma_policy="constant")
    expected = reference_generate(hf_target, PROMPTS[1], 16, params, eos_ids=target.eos_ids)
    result = engine.generate(PROMPTS[1], GenerationConfig(max_new_tokens=16, sampling=params))
    assert result.token_ids == expected
    assert drafting == "draft" or result.stats.accepted_tokens >= len(expected) // 2


@pytest.mark.parametrize("drafting", ["draft", "self"])
def test_greedy_min_tokens_ignore_eos_and_stop_token_ids_match_the_reference(target, draft, hf_target, drafting):
    """EOS pushed up by a logit bias so that it comes early: min_tokens holds it off exactly until then (the
    reference masks it the same way), ignore_eos goes on past it, a stop token id ends the answer like it."""
    eos = min(target.eos_ids)
    params = SamplingParams(logit_bias={eos: 4.0})
    engine = Engine(target, DraftModelDrafter(draft if drafting == "draft" else target, target.vocab_size), gamma=4,
                    gamma_policy="constant")
    prompt = PROMPTS[1]
    early = reference_generate(hf_target, prompt, 16, params, eos_ids=target.eos_ids)
    assert early[-1] == eos and len(early) < 6  # the bias makes it end early: what min_tokens must prevent

    def no_end_before(count):
        def allowed(new_tokens):
            mask = torch.ones(target.vocab_size, dtype=torch.bool)
            mask[eos] = len(new_tokens) >= count
            return mask
        return allowed

    cases = [
        (GenerationConfig(max_new_tokens=16, sampling=params, min_tokens=8),
         reference_generate(hf_target, prompt, 16, params, eos_ids=target.eos_ids, allowed=no_end_before(8))),
        (GenerationConfig(max_new_tokens=16, sampling=params, ignore_eos=True), reference_generate(hf_target, prompt, 16, params)),
    ]
    free = cases[1][1]
    stop = free[len(early) + 2]  # a token the unending answer has after its first EOS
    cases.append((GenerationConfig(max_new_tokens=16, sampling=params, ignore_eos=True, stop_token_ids=(stop,)),
                  free[: free.index(stop) + 1]))
    for config, expected in cases:
        result = engine.generate(prompt, config)
        assert result.token_ids == expected, config
    assert len(cases[0][1]) >= 8 and len(cases[1][1]) == 16 and cases[2][1][-1] == stop


def test_caches_hold_exactly_the_accepted_path(target, draft):
    engine = Engine(target, DraftModelDrafter(draft, target.vocab_size), gamma=3, gamma_policy="constant")
    generation = engine.start(PROMPTS[1], GenerationConfig(max_new_tokens=15))
    while not generation.done:
        generation.step()
        for model, cache in ((target, generation.cache), (draft, generation.session.cache)):
            assert cache.length <= len(generation.ids) - 1
            if not cache.length:  # the draft's, after the first token: it reads the prompt in the next step
                continue
            fresh = model.runner.new_cache()
            model.runner.forward(fresh, torch.tensor(generation.ids[: cache.length]), logits="none")
            torch.testing.assert_close(cache.keys[:, :, : cache.length], fresh.keys[:, :, : cache.length])
            torch.testing.assert_close(cache.values[:, :, : cache.length], fresh.values[:, :, : cache.length])
        assert generation.cache.length == len(generation.ids) - 1


@pytest.mark.parametrize("spec", ["model", "tree", "hybrid", "merge", "cascade:draft={draft}",
                                  "cascade:kind=horizontal,strong=1,draft={draft}"])
def test_the_first_token_goes_out_before_the_draft_models_prefill(target, draft, hf_target, spec):
    """`start` prefills the target only: the first token comes from that pass and `step` gives it at once; the draft
    model (alone or a part of a composed drafter) reads the prompt in the next step, before it drafts (as a server
    feeds it in chunks after the first token); `hybrid`'s at its first proposal (`ModelSession.defer_prefill`)."""
    from verispec.drafters.base import ModelSession

    models = ModelCache(target, draft)
    models.default_draft = draft.name
    engine = Engine(target, make_drafter(spec.format(draft=draft.name), target, load=models), gamma=3, gamma_policy="constant")
    generation = engine.start(PROMPTS[1], GenerationConfig(max_new_tokens=12))

    def model_session(session):  # the session, or the first part of it, that drafts with the draft model's cache
        return session if isinstance(session, ModelSession) else next(filter(None, map(model_session, getattr(session, "sessions", ()))), None)

    model = model_session(generation.session)
    deferred = spec == "hybrid"  # its draft model reads the prompt when it first proposes: prompt lookup may serve all
    assert model.cached == [] and generation.prefilled == deferred
    assert [event.token_id for event in generation.step()] == reference_generate(hf_target, PROMPTS[1], 1)
    assert model.cached == []
    generation.step()
    assert generation.prefilled and (deferred or len(model.cached) >= len(PROMPTS[1]) - 1)
    while not generation.done:
        generation.step()
    assert generation.result().token_ids == reference_generate(hf_target, PROMPTS[1], 12, eos_ids=target.eos_ids)


@pytest.mark.parametrize("spec", ["model", "tree", "merge", "hybrid", "cascade:draft={draft}",
                                  "cascade:kind=horizontal,strong=1,draft={draft}"])
def test_every_draft_cache_is_released_when_a_request_ends(target, tiny_draft, monkeypatch, spec):
    """Every cache a request made (the target's and each model-backed draft session's) is
    released when the generation ends. Fails on the sessions before the ModelSession and
    ComposedSession bases: tree, merge, hybrid and both cascades never released their draft caches
    (a llama.cpp draft would keep its sequence)."""
    from verispec.models.transformer import KVCache, Transformer

    made, released = [], []
    new_cache = Transformer.new_cache  # every cache, prefilled or not, starts here
    monkeypatch.setattr(Transformer, "new_cache", lambda self, *args, **kwargs: made.append(new_cache(self, *args, **kwargs)) or made[-1])
    monkeypatch.setattr(KVCache, "release", lambda self: released.append(self))
    models = ModelCache(target)
    models.default_draft = str(tiny_draft)
    engine = Engine(target, make_drafter(spec.format(draft=tiny_draft), target, load=models), gamma=3, gamma_policy="constant")
    engine.generate(PROMPTS[1], GenerationConfig(max_new_tokens=6))
    assert len(made) >= 2 and all(any(cache is r for r in released) for cache in made)


def test_a_stream_closed_early_ends_its_request(target, draft, monkeypatch):
    """Closing `Engine.stream`'s iterator after its first event ends the request: the target's and the
    draft's caches are released. Fails on a stream without the try/finally, which left it open."""
    from verispec.models.transformer import KVCache

    released = []
    monkeypatch.setattr(KVCache, "release", lambda self: released.append(self))
    engine = Engine(target, DraftModelDrafter(draft, target.vocab_size), gamma=3, gamma_policy="constant")
    events = engine.stream(PROMPTS[1], GenerationConfig(max_new_tokens=30))
    next(events)
    assert not released  # still running
    events.close()
    assert len(released) == 2


# --- sampling: equal in distribution -------------------------------------------------------------

SAMPLED = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_k=4),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=1.0, eta=0.05),
    SamplingParams(temperature=1.0, epsilon=0.05),
    SamplingParams(temperature=1.2, top_k=4, repetition_penalty=1.5),
    SamplingParams(temperature=1.0, top_k=4, presence_penalty=1.0, frequency_penalty=0.8, logit_bias={3: 1.5, 0: -1.0}),
]


PROMPT, LENGTH, GAMMA, SAMPLES, TRUNCATED_SAMPLES = [3, 7], 3, 2, 3_000, 1_200


def _truncates(params: SamplingParams) -> bool:
    return params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0 or params.eta > 0 or params.epsilon > 0


@pytest.mark.parametrize("params", SAMPLED, ids=str)
def test_sampled_output_is_distributed_as_the_target(small_pair, params):
    target, draft, hf = small_pair
    engine = Engine(target, DraftModelDrafter(draft, target.vocab_size), gamma=GAMMA, gamma_policy="constant")
    exact = sequence_distribution(hf, PROMPT, LENGTH, params)
    samples = TRUNCATED_SAMPLES if _truncates(params) else SAMPLES
    result = assert_same_distribution(sample_sequences(engine, PROMPT, params, samples, LENGTH), exact)
    assert result.detectable_tv < (0.14 if _truncates(params) else 0.2)  # the power the module doc promises


def test_sampled_ngram_drafts_are_lossless(small_pair):
    """Deterministic drafts (point masses) under the rule; top-4, so tokens repeat and the n-gram drafts often."""
    target, _, hf = small_pair
    params = SamplingParams(temperature=1.0, top_k=4)
    engine = Engine(target, NgramDrafter(max_n=2), gamma=GAMMA, gamma_policy="constant")
    exact = sequence_distribution(hf, PROMPT, LENGTH, params)
    result = assert_same_distribution(sample_sequences(engine, PROMPT, params, TRUNCATED_SAMPLES, LENGTH), exact)
    assert result.detectable_tv < 0.14  # the power the module doc promises


def test_min_tokens_samples_from_the_target_without_its_end_tokens(small_pair, monkeypatch):
    """Token 5 made an end token, banned at every position by min_tokens = LENGTH: the output is distributed
    as the target's with token 5 masked out (the reference's `allowed`), drafts proposing it or not."""
    target, draft, hf = small_pair
    monkeypatch.setattr(target, "eos_ids", frozenset({5}))
    params = SamplingParams(temperature=1.0, top_k=4)  # the mask comes before the truncation, as a grammar's does
    engine = Engine(target, DraftModelDrafter(draft, target.vocab_size), gamma=GAMMA, gamma_policy="constant")
    no_five = torch.ones(target.vocab_size, dtype=torch.bool)
    no_five[5] = False
    exact = sequence_distribution(hf, PROMPT, LENGTH, params, allowed=lambda prefix: no_five)
    samples = sample_sequences(engine, PROMPT, params, TRUNCATED_SAMPLES, LENGTH, min_tokens=LENGTH)
    assert all(5 not in sample for sample in samples)
    assert assert_same_distribution(samples, exact).detectable_tv < 0.14


def test_the_end_to_end_test_catches_a_wrong_rule(small_pair, monkeypatch):
    """Accepting every draft token (no rejection) must be detected by the same test, on 1 000 samples."""
    import verispec.engine.shapes as engine_module

    monkeypatch.setattr(engine_module, "verify_sampled", accept_every_draft_token)
    target, draft, hf = small_pair
    params = SamplingParams(temperature=1.0)
    engine = Engine(target, DraftModelDrafter(draft, target.vocab_size), gamma=GAMMA, gamma_policy="constant")
    exact = sequence_distribution(hf, PROMPT, LENGTH, params)
    assert_rejected(sample_sequences(engine, PROMPT, params, 1_000, LENGTH), exact)


def test_same_seed_same_output(target, draft):
    engine = Engine(target, DraftModelDrafter(draft, target.vocab_size), gamma=3)
    config = GenerationConfig(max_new_tokens=12, sampling=SamplingParams(temperature=1.0), seed=42)
    assert engine.generate(PROMPTS[0], config).token_ids == engine.generate(PROMPTS[0], config).token_ids


def test_an_unseeded_request_leaves_torch_global_generator_alone(target, draft):
    """Without a seed a request draws its own, so user code that seeded torch still gets its numbers."""
    engine = Engine(target, DraftModelDrafter(draft, target.vocab_size), gamma=3)
    config = GenerationConfig(max_new_tokens=8, sampling=SamplingParams(temperature=1.0))
    torch.manual_seed(7)
    want = torch.rand(4)
    torch.manual_seed(7)
    engine.generate(PROMPTS[0], config)
    assert torch.equal(torch.rand(4), want)
    first, second = engine.start(PROMPTS[0], config), engine.start(PROMPTS[0], config)
    assert first.generator.initial_seed() != second.generator.initial_seed()  # still a fresh seed per request
    first.close()
    second.close()


def test_plain_and_speculative_targets_share_one_weight_layout(tiny_target):
    """`load` lays the target out the same with or without a drafter: rounding, hence fp32 greedy
    tokens, cannot depend on whether a request drafts."""
    plain, speculative = load(str(tiny_target), "none"), load(str(tiny_target), "ngram")
    assert plain.target.runner.variant == speculative.target.runner.variant == f",rows={VERIFY_ROWS}"


# --- stopping and bad input ----------------------------------------------------------------------


def test_stops_at_eos_stop_string_and_length(target, draft, hf_target):
    engine = Engine(target, DraftModelDrafter(draft, target.vocab_size), gamma=4, gamma_policy="constant")
    result = engine.generate(PROMPTS[1], GenerationConfig(max_new_tokens=7))
    assert len(result.token_ids) <= 7 and result.stats.new_tokens == len(result.token_ids)
    full = engine.generate(PROMPTS[1], GenerationConfig(max_new_tokens=30))
    words = full.text.split()
    assert len(words) >= 3, f"no third word to stop at, the stop-string case would test nothing: {full.text!r}"
    stop = words[2]
    cut = engine.generate(PROMPTS[1], GenerationConfig(max_new_tokens=30, stop=(stop,)))
    assert cut.finish_reason == "stop" and stop not in cut.text and full.text.startswith(cut.text)
    eos_engine = Engine(target, None)
    target.eos_ids, saved = frozenset({full.token_ids[3]}), target.eos_ids
    try:
        ended = eos_engine.generate(PROMPTS[1], GenerationConfig(max_new_tokens=30))
    finally:
        target.eos_ids = saved
    assert ended.finish_reason == "stop" and ended.token_ids[-1] == full.token_ids[3]
    assert ended.token_ids == full.token_ids[: len(ended.token_ids)]


def test_bad_inputs_raise_clear_errors(target, tiny_other_vocab):
    engine = Engine(target, None)
    with pytest.raises(PromptError, match="empty"):
        engine.generate("   ")
    with pytest.raises(PromptError, match="context"):
        engine.generate(list(range(1, 40)) * 4)
    with pytest.raises(InvalidParameterError, match="gamma"):
        Engine(target, None, gamma=0)
    with pytest.raises(InvalidParameterError, match="max_new_tokens"):
        GenerationConfig(max_new_tokens=0)
    with pytest.raises(InvalidParameterError, match="gamma policy"):
        Engine(target, None, gamma_policy="fastest")
    with pytest.raises(ModelNotFoundError, match="unknown model"):
        load_model("no-such-model-7b")
    with pytest.raises(IncompatibleModelsError, match="vocabularies differ"):
        make_drafter(f"cascade:draft={tiny_other_vocab}", target)  # a plain draft model may, see test_cross_vocab
    with pytest.raises(InvalidParameterError, match="name=integer"):
        make_drafter("ngram:max_n=three", target)


def test_a_request_drafts_with_models_already_loaded_never_new_ones(tiny_target, tiny_draft):
    """`load` freezes its ModelCache: per-request drafters reuse the loaded models or fail clearly."""
    engine = load(str(tiny_target), str(tiny_draft), gamma_policy="constant")
    prompt = [5, 9, 2, 7, 5, 9]
    want = Engine(engine.target, None).generate(prompt, GenerationConfig(max_new_tokens=12)).token_ids
    for spec in (None, "none", "ngram", "tree:k=2,depth=3", f"model:{tiny_draft}", "hybrid:min_match=2"):
        assert engine.generate(prompt, GenerationConfig(max_new_tokens=12, drafter=spec)).token_ids == want, spec
    assert engine.drafter_for(None) is engine.drafter and engine.drafter_for("ngram") is engine.drafter_for(" ngram ")
    assert engine.drafter_for("tree:k=2,depth=3").model is engine.drafter.model  # the loaded draft, shared
    with pytest.raises(InvalidParameterError, match="is not loaded here") as error:
        engine.generate(prompt, GenerationConfig(max_new_tokens=4, drafter="model:some-other-draft"))
    assert error.value.param == "drafter"
    for width in range(1, Engine.MAX_EXTRA_DRAFTERS + 3):  # the per-request drafters kept stay bounded
        engine.drafter_for(f"ngram:max_n={width}")
    assert len(engine._drafters) == Engine.MAX_EXTRA_DRAFTERS


def test_an_engine_builder_loads_each_model_once_and_builds_each_drafter_once(tiny_target, tiny_draft):
    """EngineBuilder, what `load` and the benchmarks build engines with: engines with one drafter spec
    share one drafter, every model-backed drafter drafts with the one loaded draft model (the
    builder's default draft), and `freeze` makes it the loaded models' default. A builder that built
    a drafter per engine or loaded a model per drafter fails here."""
    builder = EngineBuilder(str(tiny_target), default_draft=str(tiny_draft))
    first, second = builder.engine("model", 3, "constant"), builder.engine("model", 4, "constant")
    assert first.drafter is second.drafter and first.target is second.target and (first.gamma, second.gamma) == (3, 4)
    tree = builder.engine("tree:k=2,depth=3", gamma_policy="constant")
    assert tree.drafter.model is first.drafter.model and tree.models is first.models is builder.models
    assert builder.engine("none").drafter is None and builder.drafter(None) is None
    assert builder.models.names == [first.target.name, first.drafter.model.name]
    builder.freeze()
    assert builder.models.frozen and builder.models.default_draft == first.drafter.model.name


def test_a_request_sets_gamma_and_policy(target):
    engine = Engine(target, NgramDrafter(max_n=2), gamma=4, gamma_policy="analytic")
    generation = engine.start([5, 9, 2, 7, 5, 9, 2, 7], GenerationConfig(max_new_tokens=20, gamma=2, gamma_policy="constant"))
    assert type(generation.policy).__name__ == "ConstantGamma" and generation.policy.next_gamma() == 2
    while not generation.done:
        generation.step()
    assert all(record.proposed <= 2 for record in generation.stats.records)
    with pytest.raises(InvalidParameterError, match="gamma"):
        GenerationConfig(gamma=0)
    with pytest.raises(InvalidParameterError, match="gamma policy"):
        GenerationConfig(gamma_policy="fastest")


def test_a_prepared_drafter_is_only_read_by_a_request(tiny_target, tiny_draft, monkeypatch):
    """`Engine.prepare` builds a request's drafter and measures its costs; a request over it (the
    scheduler's `Generation`) then builds and measures nothing."""
    import verispec.drafters as drafters_module
    from verispec.control.costs import CostModel
    from verispec.engine import Generation

    engine = load(str(tiny_target), str(tiny_draft), gamma_policy="analytic")
    built = engine.prepare("ngram:max_n=3")
    assert built is engine.prepare(" ngram:max_n=3 ") and built.name.startswith("ngram")

    def refuse(*args, **kwargs):
        raise AssertionError("heavy work on the request path")

    monkeypatch.setattr(drafters_module, "make_drafter", refuse)
    monkeypatch.setattr(CostModel, "calibrated", classmethod(refuse))
    config = GenerationConfig(max_new_tokens=4, drafter="ngram:max_n=3")
    generation = Generation(engine, [5, 9, 2, 7, 5, 9], config)
    assert generation.drafter is built
    with pytest.raises(AssertionError, match="request path"):
        Generation(engine, [5, 9, 2], GenerationConfig(max_new_tokens=4, drafter="ngram:max_n=4"))  # not prepared
