"""Drafts with another tokenizer (`drafters/cross_vocab.py`) against the reference decoder.

Tiny random target and draft with word-level tokenizers that spell some words alike under other ids
and some not at all. Greedy (text re-tokenization): token-identical to the reference for several γ;
a draft that is the target under renumbered ids is accepted in full, which shows the text bridge
proposes the target's own tokens. Sampling (shared vocabulary): an end-to-end chi-square test of the
speculative output against the exact distribution the reference enumerates — significance 1e-3,
top-k 3 (27 sequences), N = 1 200 sequences of 3 tokens after γ = 2 (the bonus token is in the tested event); the printed
line gives the smallest total-variation bias it detects with 90 % power (asserted below 0.12). Positive
control: the same test on half the samples rejects a drafter that forgets to renormalize the
restricted distribution (it reports q smaller than the one it drew from).
"""

import pytest
import torch
from conftest import make_tiny_model
from distribution import assert_rejected, assert_same_distribution, sample_sequences
from transformers import AutoModelForCausalLM

from verispec import Engine, GenerationConfig, SamplingParams
from verispec.drafters import HybridDrafter, make_drafter
from verispec.errors import InvalidParameterError
from verispec.drafters.cross_vocab import CrossVocabDrafter, SharedVocabulary, retokenize, shared_vocabulary
from verispec.models.loading import load_model
from verispec.testing.reference import reference_generate, sequence_distribution

# eos and unknown are spelled so that no word begins with them (a tokenizer splits added tokens out first)
WORDS = ["<eos>", "<unk>"] + [f"t{i}" for i in range(2, 12)]
# the draft's words: eos and unknown as the target's, six target words under other ids, four of its own
DRAFT_WORDS = ["<eos>", "<unk>", "t5", "t3", "t9", "u0", "t2", "u1", "t7", "u2", "t4", "u3"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cross")
    target_dir = make_tiny_model(folder / "t", vocab_size=12, seed=31, layers=2, arch="llama", words=WORDS)
    draft_dir = make_tiny_model(folder / "d", vocab_size=12, seed=32, layers=1, arch="llama", words=DRAFT_WORDS)
    target, draft = load_model(target_dir), load_model(draft_dir)
    target.eos_ids = frozenset()  # fixed-length sequences, so the exact distribution is a simple product
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    return target, draft, hf, target_dir, draft_dir


@pytest.fixture(scope="module")
def renamed_target(pair, tmp_path_factory):
    """The target's own weights under a tokenizer that numbers its words in another order."""
    _, _, hf, _, _ = pair
    order = [0, 1] + list(range(11, 1, -1))  # draft id j is target word order[j]
    folder = tmp_path_factory.mktemp("renamed") / "d"
    make_tiny_model(folder, vocab_size=12, seed=0, layers=2, arch="llama", words=[WORDS[i] for i in order])
    renamed = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    renamed.load_state_dict(hf.state_dict())
    with torch.no_grad():
        renamed.model.embed_tokens.weight.copy_(hf.model.embed_tokens.weight[order])
        renamed.lm_head.weight.copy_(hf.lm_head.weight[order])
    renamed.save_pretrained(folder)
    return load_model(folder)


PROMPTS = [[5, 9, 2, 7], [11, 3, 3, 3, 8, 1, 4, 10, 5], [6]]


def test_the_factory_picks_the_cross_vocabulary_drafter(pair):
    target, _, _, _, draft_dir = pair
    drafter = make_drafter(f"model:{draft_dir}", target)
    assert isinstance(drafter, CrossVocabDrafter)
    pairs = dict(zip(drafter.shared.target_ids.tolist(), drafter.shared.draft_ids.tolist()))
    assert pairs == {WORDS.index(w): j for j, w in enumerate(DRAFT_WORDS) if w in WORDS}  # eos, unknown as specials


@pytest.mark.parametrize("cut", ["", ",vocab=8"])
def test_hybrid_takes_a_draft_of_another_tokenizer(pair, cut):
    """`hybrid:draft=NAME`: prompt lookup where its match is long, else a draft model through the text; greedy
    output stays the target's, sampled output is distributed as the target's (the draft takes part in both).
    `vocab=N`: the draft's head scores only its ids < N (the others' logits −inf), and both still hold."""
    target, _, hf, _, draft_dir = pair
    drafter = make_drafter(f"hybrid:draft={draft_dir},min_match=3{cut}", target)
    assert isinstance(drafter.model_drafter, CrossVocabDrafter) and drafter.name.endswith(f"draft={drafter.model.name}")
    runner = drafter.model.runner
    cache = runner.new_cache(4)
    logits = runner.forward(cache, torch.tensor([2, 3]), logits="all")  # [2, draft vocab]
    assert bool(torch.isinf(logits[:, 8:]).all()) == bool(cut) and not torch.isinf(logits[:, :8]).any()
    engine = Engine(target, drafter, gamma=3, gamma_policy="constant")
    for prompt in PROMPTS:
        expected = reference_generate(hf, prompt, 16, eos_ids=target.eos_ids)
        assert engine.generate(prompt, GenerationConfig(max_new_tokens=16)).token_ids == expected
    params = SamplingParams(temperature=1.0, top_k=3)
    samples = sample_sequences(Engine(target, drafter, gamma=GAMMA, gamma_policy="constant"), PROMPT, params, SAMPLES, LENGTH)
    assert assert_same_distribution(samples, sequence_distribution(hf, PROMPT, LENGTH, params)).detectable_tv < 0.12
    assert engine.generate(PROMPT, GenerationConfig(max_new_tokens=24, sampling=params, seed=1)).stats.proposed_tokens > 0
    with pytest.raises(InvalidParameterError, match="unknown ngram drafter option 'draft'"):
        make_drafter(f"ngram:draft={draft_dir}", target)
    with pytest.raises(InvalidParameterError, match=r"vocab must be in \[1, 12\]"):
        make_drafter(f"hybrid:draft={draft_dir},vocab=13", target)


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_greedy_is_token_identical_to_the_reference(pair, gamma):
    target, draft, hf, _, _ = pair
    engine = Engine(target, CrossVocabDrafter(draft, target), gamma=gamma, gamma_policy="constant")
    for prompt in PROMPTS:
        expected = reference_generate(hf, prompt, 16, eos_ids=target.eos_ids)
        assert engine.generate(prompt, GenerationConfig(max_new_tokens=16)).token_ids == expected


def test_the_shared_vocabulary_is_built_before_the_first_sampled_proposal_when_asked(pair):
    """`prepare_sampling` (what a server calls at start) builds the shared vocabulary, through a hybrid drafter too, so
    that no sampled request waits for it; without it, nothing is built before a sampled proposal asks."""
    target, draft, _, _, _ = pair
    lazy, ready = CrossVocabDrafter(draft, target), CrossVocabDrafter(draft, target)
    ready.prepare_sampling()
    assert "shared" not in vars(lazy) and "shared" in vars(ready)
    hybrid = HybridDrafter(CrossVocabDrafter(draft, target))
    hybrid.prepare_sampling()
    assert "shared" in vars(hybrid.model_drafter)


def test_a_session_counts_the_tokens_committed_since_its_draft_last_fed(pair):
    """`lag` (what the batch prices a draft's catching up by, `control/batch.py`): 0 right after a proposal fed the
    cache, one more for each token committed in steps it drafted nothing in; a prompt not read yet not counted (it is read once,
    whenever: `ModelSession.defer_prefill`)."""
    target, draft, _, _, _ = pair
    prompt = PROMPTS[1]
    session = CrossVocabDrafter(draft, target).start(prompt)
    ids = prompt + [6]  # the first token: it and the prompt's last one fed with the first proposal, as a same-vocabulary draft's
    assert session.lag(ids) == 1
    drafted = session.propose(ids, 2, SamplingParams(), None).tokens.tolist()
    ids = ids + drafted[:1] + [7]  # one draft token accepted, then the target's
    session.commit(ids)
    assert session.lag(ids) == 0
    for token in (2, 4, 9):  # three steps without a proposal
        ids = ids + [token]
        session.commit(ids)
    assert session.lag(ids) == 3
    chunked = CrossVocabDrafter(draft, target).start_chunked(prompt)
    assert chunked.lag(prompt) == 0 and chunked.lag(prompt + [2, 4]) == 2  # its prefill not fed yet: only the output counts


def test_a_renamed_copy_of_the_target_is_accepted_in_full(pair, renamed_target):
    """If the text bridge dropped, shifted or mistranslated tokens, the renamed copy would miss."""
    target, _, hf, _, _ = pair
    engine = Engine(target, CrossVocabDrafter(renamed_target, target), gamma=4, gamma_policy="constant")
    result = engine.generate(PROMPTS[1], GenerationConfig(max_new_tokens=20))
    assert result.token_ids == reference_generate(hf, PROMPTS[1], 20, eos_ids=target.eos_ids)
    assert result.stats.acceptance_rate == 1.0


def test_retokenize_reads_the_draft_text_after_the_committed_tokens(pair):
    target, draft, _, _, _ = pair
    tt, dt = target.tokenizer, draft.tokenizer
    context = dt.encode("t5 t3", add_special_tokens=False)
    drafted = dt.encode("t9 u0 t2", add_special_tokens=False)
    assert retokenize(tt, dt, [5, 3], context, drafted) == [9, 1, 2]  # u0 is not a target word: unknown
    assert retokenize(tt, dt, [5, 3], context, []) == []


def trained_tokenizer(kind: str):
    """A small BPE tokenizer trained here: byte-level (Qwen's, GPT-2's kind) or SentencePiece-like (a "▁" before each
    word, bytes for what the vocabulary lacks: Llama's, Gemma's kind), whose pieces split multi-byte characters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["naïve café — 東京 🚀 def f(x): return x ** 2", "Hello, world! The quick brown fox.", "résumé 日本語 ✓"] * 20
    if kind == "byte-level":
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        tokenizer = Tokenizer(models.BPE(byte_fallback=True))
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
        tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
        trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[f"<0x{b:02X}>" for b in range(256)])
    tokenizer.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_the_draft_context_decodes_only_what_is_new_and_gives_the_whole_text(kind):
    """`DraftContext.text` after each committed token is the whole sequence's text (an unfinished character left
    out), though it decodes only the ids past a known prefix, which moves forward (the positive control: it did); a
    sequence that does not extend it (a new request) starts over."""
    from verispec.drafters.cross_vocab import DraftContext, _decode

    tokenizer = trained_tokenizer(kind)
    ids = tokenizer.encode("naïve café — 東京 🚀 résumé 日本語 ✓ Hello, world! " * 6, add_special_tokens=False)
    assert len(ids) > 4 * DraftContext.KEEP
    context = DraftContext(tokenizer, tokenizer)
    for n in range(len(ids) + 1):
        assert context.text(ids[:n]) == _decode(tokenizer, ids[:n]).rstrip("\ufffd"), n
    assert len(context.known_ids) > 2 * DraftContext.KEEP
    other = tokenizer.encode("Hello, world! The quick brown fox.", add_special_tokens=False)
    assert context.text(other) == _decode(tokenizer, other) and context.known_ids == []


@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_a_chunked_prefill_gives_the_same_tokens(pair, chunk):
    """The server's chunked prefill (the draft's own prefill fed a chunk per call too), greedy and sampled."""
    from test_chunked_prefill import chunked

    target, draft, _, _, _ = pair
    engine = Engine(target, CrossVocabDrafter(draft, target), gamma=3, gamma_policy="constant")
    for config in (GenerationConfig(max_new_tokens=12), GenerationConfig(max_new_tokens=12, sampling=SamplingParams(temperature=1.0), seed=3)):
        assert chunked(engine, PROMPTS[1], config, chunk)[0] == engine.generate(PROMPTS[1], config).token_ids


PROMPT, LENGTH, GAMMA, SAMPLES = [3, 7], 3, 2, 1_200


def test_sampled_output_is_distributed_as_the_target(pair):
    target, draft, hf, _, _ = pair
    params = SamplingParams(temperature=1.0, top_k=3)
    engine = Engine(target, CrossVocabDrafter(draft, target), gamma=GAMMA, gamma_policy="constant")
    exact = sequence_distribution(hf, PROMPT, LENGTH, params)
    samples = sample_sequences(engine, PROMPT, params, SAMPLES, LENGTH)
    result = assert_same_distribution(samples, exact)
    assert result.detectable_tv < 0.12  # the power the module doc promises
    stats = engine.generate(PROMPT, GenerationConfig(max_new_tokens=24, sampling=params, seed=1)).stats
    assert stats.proposed_tokens > 0  # the draft proposed: the test is not plain decoding in disguise


def test_the_sampled_test_rejects_an_unnormalized_restriction(pair, monkeypatch):
    """Positive control: reporting the restricted draft probabilities without renormalizing them."""
    monkeypatch.setattr(SharedVocabulary, "restrict", lambda self, probs: probs[self.draft_ids])
    target, draft, hf, _, _ = pair
    params = SamplingParams(temperature=1.0, top_k=3)
    engine = Engine(target, CrossVocabDrafter(draft, target), gamma=GAMMA, gamma_policy="constant")
    exact = sequence_distribution(hf, PROMPT, LENGTH, params)
    assert_rejected(sample_sequences(engine, PROMPT, params, SAMPLES // 2, LENGTH), exact)


def test_shared_vocabulary_respects_the_logits_width(pair):
    target, draft, _, _, _ = pair
    shared = shared_vocabulary(target.tokenizer, draft.tokenizer, 6, 12)
    assert shared.target_ids.tolist() == [0, 1, 2, 3, 4, 5]  # t9 and t7 are past the width


@pytest.mark.real
def test_gemma_with_a_smollm2_draft_gives_the_target_s_own_greedy_output():
    """The shipped pair of two families (262K and 49K vocabularies): Gemma-3-270M drafted for by SmolLM2-135M,
    its default draft (the shipped default, Qwen 0.5B, is larger than this target)."""
    from verispec import load

    engine = load("gemma-3-270m", "model", "float32", gamma_policy="constant")
    assert isinstance(engine.drafter, CrossVocabDrafter) and engine.drafter.model.name == "smollm2-135m-instruct"
    plain = Engine(engine.target, None)
    config = GenerationConfig(max_new_tokens=16)
    for prompt in ("Hello", "Write a Python function that reverses a string."):
        result = engine.generate(prompt, config)
        assert result.token_ids == plain.generate(prompt, config).token_ids
        assert result.stats.accepted_tokens > 0  # the draft really drafts for it


def test_small_shipped_targets_draft_with_smollm2_by_default():
    from verispec.models.registry import DEFAULT_DRAFT, default_draft_for

    assert default_draft_for("qwen2.5-coder-1.5b-instruct") == DEFAULT_DRAFT == "qwen2.5-coder-0.5b-instruct"
    assert default_draft_for("qwen2.5-coder-0.5b-instruct") == default_draft_for("gemma-3-270m") == "smollm2-135m-instruct"
    assert default_draft_for("/a/folder/of/another/model") == DEFAULT_DRAFT
