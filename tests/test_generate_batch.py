"""`Engine.generate_batch`: prompts stepped together (`engine/together.py`), each result what `generate` gives alone.

Five prompts of different lengths and lengths of answer (so requests finish apart and waiting ones start as others
finish), greedy and seeded sampled, with no drafter, prompt lookup and a draft model, two at a time: every result's
tokens (and text) must equal that prompt's `generate` alone, and the target must really have run shared passes. Bad
arguments are clear errors before any decoding; a request that fails mid-way ends the call and leaves the engine
usable.
"""

from __future__ import annotations

import pytest

from verispec import Engine, GenerationConfig, SamplingParams
from verispec.drafters import DraftModelDrafter, NgramDrafter
from verispec.drafters.cascade import VerticalCascadeDrafter
from verispec.errors import InvalidParameterError, PromptError
from verispec.models.loading import load_model

PROMPTS = [[5, 9, 2, 7], [22, 3, 3, 3, 8, 2, 30, 42, 5], [40], [20, 21, 22, 20, 21, 22, 20], [7, 7, 11, 13, 17, 19, 23]]
CONFIGS = [GenerationConfig(max_new_tokens=8 + 4 * i) if i % 2 == 0 else
           GenerationConfig(max_new_tokens=8 + 4 * i, sampling=SamplingParams(temperature=1.0), seed=5 + i) for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def models(tiny_target, tiny_draft):
    target = load_model(tiny_target, "int8")
    target.eos_ids = frozenset()  # every request runs its full length
    return target, load_model(tiny_draft, "int8")


def passes_of(runner, monkeypatch) -> list[int]:
    rows, ragged = [], runner.forward_ragged
    monkeypatch.setattr(runner, "forward_ragged", lambda caches, *rest, **kw: rows.append(len(caches)) or ragged(caches, *rest, **kw))
    return rows


@pytest.mark.parametrize("drafter", ["none", "ngram", "model", "cascade"])
def test_each_result_is_what_the_prompt_gets_alone(models, drafter, monkeypatch):
    target, draft = models
    made = {"none": None, "ngram": NgramDrafter(max_n=3), "model": DraftModelDrafter(draft, target.vocab_size),
            "cascade": VerticalCascadeDrafter(draft, NgramDrafter(max_n=3), target.vocab_size)}[drafter]
    engine = Engine(target, made, gamma=3, gamma_policy="constant")
    alone = [engine.generate(prompt, config) for prompt, config in zip(PROMPTS, CONFIGS)]
    passes, finished = passes_of(target.runner, monkeypatch), []
    together = engine.generate_batch(PROMPTS, CONFIGS, max_batch=2, on_result=lambda i, result: finished.append((i, result)))
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert sorted(i for i, _ in finished) == list(range(5)) and all(together[i] is result for i, result in finished)
    assert [i for i, _ in finished][:2] == [0, 1]  # as they finish: the two shortest first
    assert [r.text for r in together] == [r.text for r in alone] and [r.finish_reason for r in together] == ["length"] * 5
    assert max(passes) == 2  # shared target passes
    same = engine.generate_batch(PROMPTS[:2], CONFIGS[0])  # one config for every prompt
    assert [r.token_ids for r in same] == [engine.generate(p, CONFIGS[0]).token_ids for p in PROMPTS[:2]]


def test_bad_arguments_are_clear_errors_before_any_decoding(models, monkeypatch):
    target, _ = models
    engine = Engine(target)
    passes = passes_of(target.runner, monkeypatch)
    forward = target.runner.forward
    monkeypatch.setattr(target.runner, "forward", lambda *a, **k: pytest.fail("decoded before the arguments were checked"))
    for prompts, config, max_batch, match in [
        ("t5 t6", None, 8, "a list of prompts"), ([], None, 8, "1 to"), ([[5], 7], None, 8, "each a text"),
        ([[5]], None, 0, "max_batch"), ([[5]], None, 65, "max_batch"), ([[5]], None, True, "max_batch"),
        ([[5], [6]], [CONFIGS[0]], 8, "1 configs for 2 prompts"),
    ]:
        with pytest.raises(InvalidParameterError, match=match):
            engine.generate_batch(prompts, config, max_batch)
    with pytest.raises(PromptError):
        engine.generate_batch([[5, 6], [target.vocab_size + 3]])  # the second prompt is bad: nothing decoded
    assert passes == []
    monkeypatch.setattr(target.runner, "forward", forward)


def test_a_request_that_fails_ends_the_call_and_the_engine_goes_on(models, monkeypatch):
    from verispec.engine.loop import Generation

    target, _ = models
    engine = Engine(target, NgramDrafter(max_n=3), gamma=3, gamma_policy="constant")
    want = [engine.generate(prompt, CONFIGS[0]).token_ids for prompt in PROMPTS]
    commit, calls = Generation.commit, []

    def failing(self, *args):
        calls.append(1)
        if len(calls) == 12:
            raise RuntimeError("a fault mid-way")
        return commit(self, *args)

    monkeypatch.setattr(Generation, "commit", failing)
    with pytest.raises(RuntimeError, match="a fault mid-way"):
        engine.generate_batch(PROMPTS, CONFIGS[0], max_batch=3)
    monkeypatch.setattr(Generation, "commit", commit)
    assert [r.token_ids for r in engine.generate_batch(PROMPTS, CONFIGS[0], max_batch=3)] == want
