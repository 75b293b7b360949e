"""Log-probabilities of emitted tokens (`GenerationConfig.logprobs`): exact under speculation.

Every emitted token was scored by the target in the pass that emitted it, so speculative decoding
(n-gram, a draft model, the target as its own draft: accepted, recovered and bonus tokens) reports the
same values as plain decoding, and both equal the log-softmax of one direct forward of the Hugging
Face target over the whole sequence — the raw distribution, before temperature or truncation.
"""

import pytest
import torch

from verispec import Engine, GenerationConfig, SamplingParams
from verispec.drafters import DraftModelDrafter, NgramDrafter
from verispec.errors import InvalidParameterError

PROMPT = [11, 3, 3, 3, 8, 1, 30, 12, 5]
TOL = 1e-4


def _events(engine, config):
    return [event for event in engine.stream(PROMPT, config)]


def _direct(hf_target, tokens: list[int]) -> torch.Tensor:
    """log_softmax of the HF target over prompt + tokens: row i scores tokens[i]. [len(tokens), vocab]"""
    with torch.inference_mode():
        logits = hf_target(torch.tensor([PROMPT + tokens])).logits[0].float()
    return torch.log_softmax(logits[len(PROMPT) - 1 : -1], dim=-1)


@pytest.mark.parametrize("kind", ["ngram", "model", "self"])
def test_speculative_logprobs_equal_plain_decoding_and_a_direct_forward(target, draft, hf_target, kind):
    """Fails if a token's value comes from the wrong logits row (e.g. off by one on a rejection or bonus)."""
    drafter = {"ngram": NgramDrafter(max_n=3), "model": DraftModelDrafter(draft, target.vocab_size),
               "self": DraftModelDrafter(target, target.vocab_size)}[kind]
    config = GenerationConfig(max_new_tokens=24, logprobs=3)
    plain = _events(Engine(target, None), config)
    speculative = _events(Engine(target, drafter, gamma=4, gamma_policy="constant"), config)
    assert [e.token_id for e in speculative] == [e.token_id for e in plain]
    direct = _direct(hf_target, [e.token_id for e in plain])  # [n, vocab]
    for i, (fast, slow) in enumerate(zip(speculative, plain)):
        assert abs(fast.logprobs.logprob - slow.logprobs.logprob) < TOL
        assert abs(fast.logprobs.logprob - float(direct[i, fast.token_id])) < TOL
        values, ids = direct[i].topk(3)
        assert [t for t, _ in fast.logprobs.top] == ids.tolist()
        assert all(abs(v - float(w)) < TOL for (_, v), w in zip(fast.logprobs.top, values))


def test_logprobs_are_the_raw_distribution_when_sampling(target, draft, hf_target):
    """Temperature and top-p change what is sampled, not the reported values (fails if the processed
    distribution were reported)."""
    config = GenerationConfig(max_new_tokens=12, logprobs=0, seed=3, sampling=SamplingParams(temperature=0.6, top_p=0.9))
    events = _events(Engine(target, DraftModelDrafter(draft, target.vocab_size), gamma=3, gamma_policy="constant"), config)
    direct = _direct(hf_target, [e.token_id for e in events])
    assert events and all(abs(e.logprobs.logprob - float(direct[i, e.token_id])) < TOL for i, e in enumerate(events))
    assert all(e.logprobs.top == () for e in events)


def test_the_result_carries_one_value_per_token(target, hf_target):
    """`generate()` returns them too, EOS included (a stream gives EOS no event unless it releases text)."""
    plain = Engine(target, None).generate(PROMPT, GenerationConfig(max_new_tokens=10))
    eos_ids, target.eos_ids = target.eos_ids, frozenset({plain.token_ids[4]})  # the generation ends on this token
    try:
        result = Engine(target, NgramDrafter(max_n=2), gamma=3, gamma_policy="constant").generate(
            PROMPT, GenerationConfig(max_new_tokens=40, logprobs=1))
    finally:
        target.eos_ids = eos_ids
    assert result.finish_reason == "stop" and result.token_ids[-1] == plain.token_ids[4]
    assert len(result.logprobs) == len(result.token_ids) and result.to_dict()["logprobs"][0]["top"][0][0] >= 0
    direct = _direct(hf_target, result.token_ids)
    assert all(abs(lp.logprob - float(direct[i, t])) < TOL for i, (t, lp) in enumerate(zip(result.token_ids, result.logprobs)))


def test_logprobs_only_when_asked_and_bounded(target):
    assert all(e.logprobs is None for e in _events(Engine(target, NgramDrafter()), GenerationConfig(max_new_tokens=6)))
    assert Engine(target, None).generate(PROMPT, GenerationConfig(max_new_tokens=3)).logprobs is None
    for bad in (-1, 21, 2.5):
        with pytest.raises(InvalidParameterError, match="logprobs"):
            GenerationConfig(logprobs=bad)


def test_prompt_logprobs_score_every_prompt_token_given_those_before(target, draft, hf_target, monkeypatch):
    """`prompt_logprobs`: the first prompt token has none, token i the log-softmax of one direct forward at
    row i − 1; scored a few rows at a time (3 here: the chunks' seams are checked) and the answer unchanged."""
    from verispec.engine import loop

    monkeypatch.setattr(loop, "PROMPT_LOGPROBS_ROWS", 3)
    engine = Engine(target, DraftModelDrafter(draft, target.vocab_size), gamma=3, gamma_policy="constant")
    result = engine.generate(PROMPT, GenerationConfig(max_new_tokens=6, prompt_logprobs=2))
    assert result.token_ids == engine.generate(PROMPT, GenerationConfig(max_new_tokens=6)).token_ids
    with torch.inference_mode():
        direct = torch.log_softmax(hf_target(torch.tensor([PROMPT])).logits[0].float(), dim=-1)  # [len, vocab]
    scored = result.prompt_logprobs
    assert len(scored) == len(PROMPT) and scored[0] is None
    for i in range(1, len(PROMPT)):
        assert abs(scored[i].logprob - float(direct[i - 1, PROMPT[i]])) < TOL
        assert [t for t, _ in scored[i].top] == direct[i - 1].topk(2).indices.tolist()
