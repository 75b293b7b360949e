"""TriForce hierarchy on tiny random models: sparse caches, chunk retrieval, and losslessness.

Greedy output must equal the reference decoder token for token with a ~100-token prompt and a
budget far below it; sampled output must pass the same chi-square test as the plain engine (its
significance, sample size and power are stated at the test), and that test must reject a rule that
accepts every draft token (the positive control).
"""

import pytest
import torch
from conftest import make_tiny_model
from distribution import accept_every_draft_token, assert_rejected, bonus_from_the_wrong_row, assert_same_distribution, sample_sequences
from transformers import AutoModelForCausalLM

from verispec import Engine, GenerationConfig, SamplingParams
from verispec.drafters.triforce import StreamingDraft, TriForceDrafter, make_triforce
from verispec.errors import InvalidParameterError
from verispec.models.loading import load_model
from verispec.models.retrieval_cache import build_retrieval_cache, chunk_scores, select_chunks
from verispec.testing.reference import reference_generate, sequence_distribution

LONG_PROMPT = [(7 * i + 3) % 47 + 1 for i in range(100)]
SMALL = dict(budget=16, chunk=4, recent=8, sinks=2, window=16, gamma1=2)


def test_select_chunks_keeps_the_highest_scoring_chunk_per_layer():
    keys = torch.zeros(2, 1, 8, 2)  # [layers, kv_heads, 4 chunks × 2 slots, head_dim]
    keys[:, 0, 4:6] = torch.tensor([1.0, 0.0])  # chunk 2 points along x
    keys[:, 0, 2:4] = torch.tensor([0.0, 1.0])  # chunk 1 points along y
    keys[:, 0, 6:8] = torch.tensor([0.5, 0.5])  # chunk 3 a bit of both
    query = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])  # layer 0 asks for x, layer 1 for y
    scores = chunk_scores(keys, query, chunk=2)
    torch.testing.assert_close(scores, torch.tensor([[0.0, 0.0, 1.0, 0.5], [0.0, 1.0, 0.0, 0.5]]))
    assert select_chunks(scores, keep=1, chunk=2).tolist() == [[4, 5], [2, 3]]
    assert select_chunks(scores, keep=2, chunk=2).tolist() == [[4, 5, 6, 7], [2, 3, 6, 7]]  # ascending slots


def test_retrieval_cache_holds_the_selected_chunks_then_the_recent_run(target):
    runner = target.runner
    full = runner.new_cache()
    runner.forward(full, torch.tensor(LONG_PROMPT[:-1]), logits="none")  # 99 slots
    query = torch.randn(runner.config.num_layers, runner.config.num_kv_heads, runner.config.head_dim)
    sparse = build_retrieval_cache(runner, full, chunk=4, budget=12, recent=8, query=query)
    assert (sparse.static, sparse.dynamic_start, sparse.covered) == (12, 88, 99)  # 22 chunks, recent 88..98
    expected_slots = select_chunks(chunk_scores(full.keys[:, :, :88], query, 4), 3, 4)
    for layer in range(runner.config.num_layers):
        torch.testing.assert_close(sparse.cache.keys[layer, :, :12], full.keys[layer, :, expected_slots[layer]])
        torch.testing.assert_close(sparse.cache.values[layer, :, 12:23], full.values[layer, :, 88:99])
    sparse.feed([5, 6])  # new tokens continue at the true positions 99, 100
    assert sparse.covered == 101
    sparse.rollback(100)
    assert sparse.covered == 100 and sparse.cache.length == 12 + 12
    with pytest.raises(ValueError, match="evicted"):
        sparse.rollback(50)


def test_streaming_cache_keeps_sinks_and_window_at_their_true_positions(draft):
    level1 = StreamingDraft(draft, sinks=2, window=16, prompt_ids=LONG_PROMPT)
    state = level1.state
    assert (state.static, state.dynamic_length, state.covered) == (2, 16, 99)
    full = draft.runner.new_cache()
    draft.runner.forward(full, torch.tensor(LONG_PROMPT[:-1]), logits="none")
    kept = torch.cat([torch.arange(2), torch.arange(83, 99)])
    # layer-0 keys depend only on the token and its position: equal iff RoPE positions were kept
    torch.testing.assert_close(state.cache.keys[0, :, :18], full.keys[0, :, kept])


def test_a_streaming_cache_that_grows_between_evictions_still_evicts(draft):
    """window > 64: the second prefill block outgrows the cache, which grows inside a forward (inference
    tensors); evicting afterwards, outside inference mode, must still work (a 2K-token prompt once failed)."""
    prompt = [(5 * i + 1) % 47 + 1 for i in range(150)]
    level1 = StreamingDraft(draft, sinks=2, window=70, prompt_ids=prompt)
    assert (level1.state.static, level1.state.dynamic_length, level1.state.covered) == (2, 70, 149)


@pytest.mark.parametrize("level1", ["draft", "target"])
@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_is_token_identical_to_the_reference(target, draft, hf_target, level1, gamma):
    drafter = TriForceDrafter(target, draft if level1 == "draft" else target, **SMALL)
    engine = Engine(target, drafter, gamma=gamma, gamma_policy="constant")
    expected = reference_generate(hf_target, LONG_PROMPT, 20, eos_ids=target.eos_ids)
    generation = engine.start(LONG_PROMPT, GenerationConfig(max_new_tokens=20))
    while not generation.done:
        generation.step()
    assert generation.result().token_ids == expected
    level2 = generation.session.level2
    assert level2.static == 16 and level2.cache.length < generation.cache.length  # really sparse
    if level1 == "target" and gamma == 4:
        assert generation.stats.accepted_tokens > 0  # the bonus / lagging-cache paths were exercised


@pytest.mark.parametrize("params", [SamplingParams(repetition_penalty=1.8),
                                    SamplingParams(presence_penalty=1.5, frequency_penalty=0.5, logit_bias={7: 3.0, 2: -2.0})], ids=str)
def test_penalties_and_bias_stay_exact(target, draft, hf_target, params):
    engine = Engine(target, TriForceDrafter(target, draft, **SMALL), gamma=3, gamma_policy="constant")
    expected = reference_generate(hf_target, LONG_PROMPT, 12, params, eos_ids=target.eos_ids)
    assert engine.generate(LONG_PROMPT, GenerationConfig(max_new_tokens=12, sampling=params)).token_ids == expected


@pytest.fixture(scope="module")
def sampled_setup(tmp_path_factory):
    """A 12-token pair, a prompt whose 19 cached tokens (3 chunks of 4) exceed the budget of 8, the
    TriForce engine and the exact distribution of the next LENGTH tokens."""
    folder = tmp_path_factory.mktemp("triforce-small")
    target_dir = make_tiny_model(folder / "t", vocab_size=12, seed=21, layers=2)
    target, draft = load_model(target_dir), load_model(make_tiny_model(folder / "d", vocab_size=12, seed=22, layers=1))
    target.eos_ids = frozenset()  # fixed-length sequences
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    prompt = [(5 * i + 2) % 11 + 1 for i in range(20)]
    drafter = TriForceDrafter(target, draft, budget=8, chunk=4, recent=4, sinks=2, window=6, gamma1=2)
    engine = Engine(target, drafter, gamma=GAMMA, gamma_policy="constant")
    return engine, prompt, sequence_distribution(hf, prompt, LENGTH, SAMPLED)


# γ = 3 with 3 new tokens: the first step drafts 2 (one token is left for the target's own), so a
# fully accepted block's bonus token is in the tested event
# top-k 4 keeps the outcomes to at most 4³ sequences, so little mass is pooled (untruncated, 12³
# sequences, about a quarter of it would be, and a bias inside the pool is invisible)
LENGTH, GAMMA, SAMPLES = 4, 3, 3_000  # the first token comes from the prefill: 3 speculative
SAMPLED = SamplingParams(temperature=1.0, top_k=4)


def test_sampled_output_is_distributed_as_the_target(sampled_setup):
    """Chi-square at α = SIGNIFICANCE (1e-3) on n = 3 000 sequences of 4 tokens (the first from the
    prefill; top-k 4 of a 12-token vocabulary, the rare sequences pooled): detects any bias of total
    variation ≥ 0.17 with ≥ 90 % power
    (printed). Positive controls: the next test."""
    engine, prompt, exact = sampled_setup
    result = assert_same_distribution(sample_sequences(engine, prompt, SAMPLED, SAMPLES, LENGTH), exact)
    assert result.detectable_tv < 0.2  # the power the docstring states


@pytest.mark.parametrize("where", ["level 2", "engine"])
def test_the_sampled_test_catches_a_wrong_rule(sampled_setup, monkeypatch, where):
    """Positive controls: the same test, on a third of the samples, rejects TriForce when its level 2
    keeps every level-1 token (its proposal is then not drawn from the level-2 distribution it
    reports), and when the engine draws the bonus token after a fully accepted block from the wrong
    row of the target's distributions."""
    import verispec.drafters.triforce as triforce_module
    import verispec.engine.shapes as engine_module

    if where == "level 2":
        monkeypatch.setattr(triforce_module, "verify_sampled", accept_every_draft_token)
    else:
        monkeypatch.setattr(engine_module, "verify_sampled", bonus_from_the_wrong_row)
    engine, prompt, exact = sampled_setup
    assert_rejected(sample_sequences(engine, prompt, SAMPLED, SAMPLES // 3, LENGTH), exact)


def test_bad_options_raise_clear_errors(target, draft):
    with pytest.raises(InvalidParameterError, match="budget"):
        TriForceDrafter(target, draft, budget=8, chunk=16)
    with pytest.raises(InvalidParameterError, match="gamma1"):
        TriForceDrafter(target, draft, gamma1=0)
    with pytest.raises(InvalidParameterError, match="use budget, chunk"):
        make_triforce(target, draft, {"bugdet": 4})


def test_long_context_tasks_are_deterministic_and_hold_their_facts(target):
    from verispec.tools.bench.longctx import make_document, make_tasks

    document, codes = make_document(300, target.tokenizer, seed=3)
    assert make_document(300, target.tokenizer, seed=3) == (document, codes)
    assert len(target.tokenizer(document)["input_ids"]) >= 300
    assert all(f"vault {n} is {code}." in document for n, code in codes.items())
    summary, question = make_tasks(300, target.tokenizer, seed=3)
    assert summary.kind == "summary" and question.answer in codes.values() and question.prompt.startswith(document)


def test_long_context_measurement_compares_methods_on_one_task(target, draft):
    from verispec.tools.bench.longctx import LongTask, _speedups, measure

    task = LongTask("question", " ".join(f"t{t}" for t in LONG_PROMPT[:80]), None)
    drafters = {"plain": None, "triforce": TriForceDrafter(target, draft, **SMALL)}
    rows = measure(target, drafters, task, max_new_tokens=8, gamma=3)
    _speedups(rows)
    assert rows["plain"]["token_ids"] == rows["triforce"]["token_ids"]
    assert rows["triforce"]["speedup_vs_plain"] > 0 and 1 <= rows["plain"]["new_tokens"] <= 8


def test_long_context_rows_are_saved_and_plotted(tmp_path):
    import json

    from verispec.tools.bench.longctx import _save

    rows = [{"length": n, "task": "question", "method": m, "prompt_tokens": n + 20, "decode_tok_s": s,
             "peak_extra_mib": 10.0 * n} for n in (1024, 2048) for m, s in (("plain", 5.0), ("triforce", 7.5))]
    _save(rows, {"lengths": "1024,2048"}, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "rows.json").read_text())["rows"] == rows
    assert (tmp_path / "out" / "longctx-question.png").stat().st_size > 10_000
