"""The gguf drafter (`drafters/llama_cpp.py`) without llama.cpp: its session logic over a stand-in
context backed by the tiny draft model, so every rollback shows up as a different proposal.

With the same draft model behind it, the gguf drafter must propose exactly what `DraftModelDrafter`
proposes, step for step: same output, same acceptance statistics, same sampled output for a seed (the
same random draws). Outputs must equal plain decoding of the target. The real llama.cpp path is
tested on the real pair in test_real_pair.py when llama-cpp-python is installed.
"""

import sys

import pytest
import torch

from verispec import Engine, GenerationConfig, SamplingParams
from verispec.drafters import DraftModelDrafter, make_drafter
from verispec.drafters.llama_cpp import LlamaCppDrafter
from verispec.errors import IncompatibleModelsError, InvalidParameterError

PROMPTS = [[5, 9, 2, 7], [11, 3, 3, 3, 8, 1, 30, 12, 5], [40]]


class RunnerContext:
    """A `LlamaCppContext` stand-in: a verispec runner and its KV cache behind the same methods."""

    def __init__(self, model, window: int = 256, shift: int = 0):
        self.runner, self.tokenizer = model.runner, model.tokenizer
        self.cache = self.runner.new_cache(window + 1)
        self.window, self.shift = window, shift
        self.resets = 0

    @property
    def length(self) -> int:
        return self.cache.length

    def truncate(self, length: int) -> None:
        self.cache.truncate(min(self.cache.length, length))

    def reset(self) -> None:
        self.cache.truncate(0)
        self.resets += 1

    def eval(self, tokens: list[int]) -> torch.Tensor:
        return self.runner.forward(self.cache, torch.tensor(tokens), logits="last")  # [1, vocab]

    def tokenize(self, text: str) -> list[int]:
        return [token + self.shift for token in self.tokenizer.encode(text, add_special_tokens=False)]


def _gguf(target, draft, **options) -> LlamaCppDrafter:
    return LlamaCppDrafter(RunnerContext(draft, **options), target, "tiny")


@pytest.mark.parametrize("gamma", [1, 4])
def test_proposes_what_the_draft_model_proposes_and_keeps_greedy_output_exact(target, draft, gamma):
    plain = Engine(target, None)
    by_model = Engine(target, DraftModelDrafter(draft, target.vocab_size), gamma=gamma, gamma_policy="constant")
    by_gguf = Engine(target, _gguf(target, draft), gamma=gamma, gamma_policy="constant")
    config = GenerationConfig(max_new_tokens=24)
    for prompt in PROMPTS:
        expected = plain.generate(prompt, config).token_ids
        ours, reference = by_gguf.generate(prompt, config), by_model.generate(prompt, config)
        assert ours.token_ids == reference.token_ids == expected
        assert ours.stats.per_position_acceptance == reference.stats.per_position_acceptance
        assert ours.stats.steps == reference.stats.steps


def test_sampling_draws_what_the_draft_model_draws(target, draft):
    config = GenerationConfig(max_new_tokens=24, sampling=SamplingParams(temperature=1.0, top_k=8), seed=7)
    by_model = Engine(target, DraftModelDrafter(draft, target.vocab_size), gamma=3, gamma_policy="constant")
    by_gguf = Engine(target, _gguf(target, draft), gamma=3, gamma_policy="constant")
    for prompt in PROMPTS:
        assert by_gguf.generate(prompt, config).token_ids == by_model.generate(prompt, config).token_ids


def test_interleaved_requests_share_the_one_context_correctly(target, draft):
    """Two requests stepped in turn (as a server's scheduler does) on one llama.cpp context: each
    session starts over when it finds the other's tokens there, and both stay exact."""
    drafter = _gguf(target, draft)
    engine = Engine(target, drafter, gamma=3, gamma_policy="constant")
    config = GenerationConfig(max_new_tokens=20)
    expected = [Engine(target, None).generate(p, config).token_ids for p in PROMPTS[:2]]
    generations = [engine.start(p, config) for p in PROMPTS[:2]]
    while not all(g.done for g in generations):
        for generation in generations:
            generation.step()
    assert [g.result().token_ids for g in generations] == expected
    assert drafter.context.resets > 2


def test_no_draft_past_the_context_window(target, draft):
    drafter = _gguf(target, draft, window=16)
    engine = Engine(target, drafter, gamma=4, gamma_policy="constant")
    result = engine.generate(PROMPTS[1], GenerationConfig(max_new_tokens=16))
    assert result.token_ids == Engine(target, None).generate(PROMPTS[1], GenerationConfig(max_new_tokens=16)).token_ids
    proposed = [record.proposed for record in result.stats.records]  # drafted while it fit, then none
    assert proposed[0] == 4 and proposed[-1] == 0, proposed


def test_a_gguf_of_another_family_is_refused(target, draft):
    with pytest.raises(IncompatibleModelsError, match="does not share the tokenizer"):
        _gguf(target, draft, shift=1)


def test_the_analytic_policy_times_the_drafter_once(target, draft, monkeypatch):
    drafter = _gguf(target, draft)
    calls = []
    monkeypatch.setattr(drafter, "token_seconds", lambda: calls.append(1) or 0.001)
    engine = Engine(target, drafter, gamma_policy="analytic")
    engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=4))
    engine.generate(PROMPTS[1], GenerationConfig(max_new_tokens=4))
    assert calls == [1]
    assert engine.costs.draft_token_seconds == 0.001 and engine.costs.draft_cost_ratio() > 0


def test_without_llama_cpp_the_spec_says_how_to_install_it(target, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp now raises ImportError
    with pytest.raises(InvalidParameterError, match=r"pip install 'verispec\[llama-cpp\]'"):
        make_drafter("gguf", target)
