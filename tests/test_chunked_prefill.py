"""Chunked prefill (`Generation(..., prefill=False)` + `prefill_step`): the prompt fed a chunk at a
time gives the tokens of one whole prefill, for chunk sizes from 1 to larger than the prompt, with
chain, draft-model and token-tree drafters, greedy and seeded sampling; the drafter's session opens
only once the whole prompt is in (the pass with its last token also gives the first new token), and a draft model's own prefill is chunked too; a cache never
doubles past what its request can use."""

from __future__ import annotations

import pytest
import torch
from server_helpers import tiny_engine

from verispec import GenerationConfig, SamplingParams
from verispec.engine import Generation

PROMPT = [20, 21, 22, 20, 21, 5, 9, 13, 7, 20, 21, 22, 30, 31, 2, 8, 20, 21, 22, 11, 12, 40, 41, 20, 21]  # 25 tokens
CONFIGS = [GenerationConfig(max_new_tokens=24),
           GenerationConfig(max_new_tokens=24, sampling=SamplingParams(temperature=1.0), seed=7)]


def chunked(engine, ids, config, chunk: int) -> tuple[list[int], list[int]]:
    """(token ids, cache length after each prefill_step) of a generation prefilled `chunk` tokens at a time."""
    generation = Generation(engine, ids, config, prefill=False)
    lengths = []
    while not generation.prefill_step(chunk):
        if generation.cache.length < len(ids):
            assert generation.session is None, "the drafter's session opened before the prompt was in"
        lengths.append(generation.cache.length)
    lengths.append(generation.cache.length)
    lengths = sorted(set(lengths))  # turns that fed the draft model's prefill leave the target's cache as it was
    while not generation.done:
        generation.step()
    return generation.result().token_ids, lengths


@pytest.mark.parametrize("draft", ["ngram", "model", "tree", "hybrid"])
@pytest.mark.parametrize("chunk", [1, 3, 7, 24, 1000])
def test_chunked_prefill_gives_the_whole_prefills_tokens(tiny_target, tiny_draft, draft, chunk):
    """Fails on the old code (no `prefill=False`) and on a chunked prefill that feeds a chunk wrongly
    (the positive control below shows that such a prefill changes the tokens)."""
    engine = tiny_engine(tiny_target, draft="ngram" if draft == "ngram" else tiny_draft if draft == "model" else (draft, tiny_draft))
    for config in CONFIGS:
        whole = engine.generate(PROMPT, config).token_ids
        got, lengths = chunked(engine, PROMPT, config, chunk)
        assert got == whole, (draft, chunk, config.sampling.temperature)
        steps = [b - a for a, b in zip([0, *lengths], lengths)]
        assert lengths[-1] == len(PROMPT) and all(0 < s <= chunk for s in steps)


def test_a_wrongly_fed_chunk_changes_the_tokens(tiny_target):
    """Positive control: a prefill whose chunks hold their tokens in the wrong order (a plausible
    slicing bug) gives other greedy tokens, so the comparison above would catch it."""
    engine = tiny_engine(tiny_target, draft="ngram")
    config = CONFIGS[0]
    generation = Generation(engine, PROMPT, config, prefill=False)
    runner, body = engine.target.runner, PROMPT[:-1]
    for begin in range(0, len(body), 8):
        runner.forward(generation.cache, torch.tensor(body[begin : begin + 8][::-1]), logits="none")
    assert generation.prefill_step(8)  # nothing left: opens the session
    while not generation.done:
        generation.step()
    assert generation.result().token_ids != engine.generate(PROMPT, config).token_ids


def test_step_finishes_an_unfinished_prefill(tiny_target):
    """A library caller that steps before prefilling gets the same tokens (the rest is prefilled then)."""
    engine = tiny_engine(tiny_target)
    generation = Generation(engine, PROMPT, CONFIGS[0], prefill=False)
    generation.prefill_step(5)
    while not generation.done:
        generation.step()
    assert generation.result().token_ids == engine.generate(PROMPT, CONFIGS[0]).token_ids
    with pytest.raises(Exception, match="at least 1 token"):
        Generation(engine, PROMPT, CONFIGS[0], prefill=False).prefill_step(0)


def test_a_cache_doubles_no_further_than_its_request_can_use(tiny_target, monkeypatch):
    """Fails without the cap: the cache would double to 2 × its start capacity."""
    monkeypatch.setattr(Generation, "INITIAL_SPARE", 40)  # the tiny context (128) is below the real spare
    engine = tiny_engine(tiny_target)
    config = GenerationConfig(max_new_tokens=90)
    generation = engine.start([20, 21], config)
    start, most = generation.initial_capacity, generation.max_capacity
    assert generation.cache.capacity == start and start < most < 2 * start  # [2 prompt + 90 new + a step]
    generation.cache.ensure(start + 1)
    assert generation.cache.capacity == most


@pytest.mark.parametrize("hybrid", [False, True])
def test_a_draft_models_own_prefill_is_chunked_too(tiny_target, tiny_draft, hybrid):
    """With the draft-model drafter, a 3-token chunk fills the target's cache (the whole prompt: its last token gives
    the first new token) in 9 calls, then the draft model's (the prompt but its last token) in 8 more, never more than
    3 positions of either at once. Fails if the draft session prefills the whole prompt when it opens (the target's 9
    calls would be all). Inside `hybrid` the draft model reads the prompt at its first proposal instead
    (`ModelSession.defer_prefill`): the prefill ends with the target's."""
    engine = tiny_engine(tiny_target, draft=("hybrid", tiny_draft) if hybrid else tiny_draft)
    generation = Generation(engine, PROMPT, CONFIGS[0], prefill=False)

    def draft_length() -> int:
        session = generation.session
        return 0 if session is None else (session.model if hybrid else session).cache.length

    fed = []  # (target positions, draft positions) after each call
    while not generation.prefill_step(3):
        fed.append((generation.cache.length, draft_length()))
    fed.append((generation.cache.length, draft_length()))
    assert (len(fed), fed[-1]) == ((9, (25, 0)) if hybrid else (17, (25, 24)))
    steps = [(b[0] - a[0], b[1] - a[1]) for a, b in zip([(0, 0), *fed], fed)]
    assert all(0 <= t <= 3 and 0 <= d <= 3 and (t == 0) != (d == 0) for t, d in steps)


def test_chunked_prefill_on_the_hugging_face_runner(tiny_target):
    """The HF runner's cache takes chunks too: the tokens of one whole prefill, greedy and sampled."""
    from verispec import Engine
    from verispec.drafters import NgramDrafter
    from verispec.models.loading import load_model

    engine = Engine(load_model(tiny_target, "hf"), NgramDrafter(max_n=3), gamma=3, gamma_policy="constant")
    for config in CONFIGS:
        whole = engine.generate(PROMPT, config).token_ids
        for chunk in (1, 7):
            assert chunked(engine, PROMPT, config, chunk)[0] == whole, chunk

