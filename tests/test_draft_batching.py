"""Requests drafting side by side (`drafters/batching.py`): their draft models' forwards batched into shared passes.

Four requests (greedy and seeded sampled, prompts of different lengths, a draft model of constant γ 3) are stepped
as the scheduler steps them, first each ALONE, then all four TOGETHER through `draft_together`: every step's draft
tokens and draft probabilities must be the same bits, the output the same tokens, and the together run must really
have shared passes (fewer draft passes than feeds). Positive control: a draft runner whose rows change with the
pass (noise scaled by the row count) is caught by the same comparison. Then the gate's own promises: a runner that
does not declare `batch_invariant` never gets a shared pass, a task that fails fails alone (also when its row breaks
a shared pass), and a feed wider than the runner's exact width runs alone.
"""

from __future__ import annotations

import threading

import pytest
import torch

from verispec import Engine, GenerationConfig, SamplingParams
from verispec.drafters import DraftModelDrafter
from verispec.drafters.batching import draft_together, feed
from verispec.models.loading import load_model

PROMPTS = [[5, 9, 2, 7], [22, 3, 3, 3, 8, 2, 30, 42, 5], [40], [7, 7, 11, 13, 17, 19, 23]]
CONFIGS = [GenerationConfig(max_new_tokens=16) if i % 2 == 0 else
           GenerationConfig(max_new_tokens=16, sampling=SamplingParams(temperature=1.0), seed=3 + i) for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def engine(tiny_target, tiny_draft):
    target, draft = load_model(tiny_target, "int8"), load_model(tiny_draft, "int8")
    target.eos_ids = frozenset()  # every request runs its full length
    assert draft.runner.batch_invariant
    return Engine(target, DraftModelDrafter(draft, target.vocab_size), gamma=3, gamma_policy="constant")


def run(engine: Engine, together: bool) -> list[tuple[list, list[int]]]:
    """Per request: its steps' (draft tokens, draft probs) and its output, requests stepped alone or together."""
    generations = [engine.start(prompt, config) for prompt, config in zip(PROMPTS, CONFIGS)]
    drafts: list[list] = [[] for _ in generations]
    for generation in generations:
        while not generation.prefill_step():
            pass
        generation.take_held()
    groups = [generations] if together else [[g] for g in generations]
    for group in groups:
        while live := [g for g in group if not g.done]:
            plans = draft_together([g.plan for g in live])
            rows = engine.target.runner.forward_ragged([g.cache for g in live], [p.feed for p in plans],
                                                       [p.positions for p in plans], [p.tree_mask for p in plans])
            for generation, plan, logits in zip(live, plans, rows):
                probs = plan.draft.probs
                drafts[generations.index(generation)].append((plan.draft.tokens.tolist(), None if probs is None else probs.clone()))
                generation.commit(plan, logits, 0.0)
    return [(steps, g.output_ids) for steps, g in zip(drafts, generations)]


def differences(alone, together) -> list[str]:
    found = []
    for request, ((steps_a, out_a), (steps_t, out_t)) in enumerate(zip(alone, together)):
        for step, ((tokens_a, probs_a), (tokens_t, probs_t)) in enumerate(zip(steps_a, steps_t)):
            if tokens_a != tokens_t or (probs_a is None) != (probs_t is None) or (probs_a is not None and not torch.equal(probs_a, probs_t)):
                found.append(f"request {request} step {step}: the draft differs")
        if out_a != out_t:
            found.append(f"request {request}: the output differs")
    return found


def counting_passes(runner, monkeypatch) -> list[int]:
    """Record the rows of each `forward_ragged` call of `runner`."""
    passes, ragged = [], runner.forward_ragged
    monkeypatch.setattr(runner, "forward_ragged", lambda caches, feeds, *rest, **kw: passes.append(len(caches)) or ragged(caches, feeds, *rest, **kw))
    return passes


def test_drafts_made_together_are_the_drafts_made_alone(engine, monkeypatch):
    draft_runner = engine.drafter.model.runner
    alone = run(engine, together=False)
    passes = counting_passes(draft_runner, monkeypatch)
    together = run(engine, together=True)
    assert differences(alone, together) == []
    assert max(passes) == len(PROMPTS) and sum(passes) > len(passes)  # shared passes, of all four requests at times
    assert any(probs is not None for steps, _ in together for _, probs in steps)  # sampled drafts were compared too


def test_the_comparison_catches_rows_that_change_with_the_pass(engine, monkeypatch):
    """Positive control: a draft runner whose logits move with the number of rows in the pass."""
    runner = engine.drafter.model.runner
    alone = run(engine, together=False)
    ragged = runner.forward_ragged

    def noisy(caches, feeds, *rest, **kw):
        return [logits + 0.5 * (len(caches) - 1) * torch.arange(logits.shape[-1]) / logits.shape[-1] for logits in ragged(caches, feeds, *rest, **kw)]

    monkeypatch.setattr(runner, "forward_ragged", noisy)
    assert differences(alone, run(engine, together=True)) != []


def test_a_runner_that_does_not_batch_exactly_runs_each_feed_alone(engine, monkeypatch):
    runner = engine.drafter.model.runner
    monkeypatch.setattr(type(runner), "batch_invariant", property(lambda self: False))
    passes = counting_passes(runner, monkeypatch)
    run(engine, together=True)
    assert passes == []


def test_a_failing_task_fails_alone(engine, monkeypatch):
    """One task raises before drafting, another while its row is in a shared pass (the pass fails, then each row
    runs alone): those two get their exceptions, the others their plans, and nothing waits forever."""
    runner = engine.drafter.model.runner
    generations = [engine.start(prompt, config) for prompt, config in zip(PROMPTS, CONFIGS)]
    for generation in generations:
        while not generation.prefill_step():
            pass
        generation.take_held()
    broken_cache = generations[2].session.cache
    forward, ragged = runner.forward, runner.forward_ragged

    def refuse(caches, *rest, **kw):
        if any(cache is broken_cache for cache in caches):
            raise RuntimeError("a broken row")
        return ragged(caches, *rest, **kw)

    monkeypatch.setattr(runner, "forward_ragged", refuse)
    monkeypatch.setattr(runner, "forward", lambda cache, *rest, **kw: refuse([cache]) if cache is broken_cache else forward(cache, *rest, **kw))

    def first_fails():
        raise ValueError("before drafting")

    results = draft_together([first_fails, generations[1].plan, generations[2].plan, generations[3].plan])
    assert isinstance(results[0], ValueError) and isinstance(results[2], RuntimeError)
    assert all(len(results[i].draft) == 3 for i in (1, 3))
    assert threading.active_count() < 20


def test_a_wide_feed_runs_alone(engine, monkeypatch):
    """Past the runner's exact width a feed is not batched (a prompt's piece runs the runner's own way), and it runs
    on the calling thread like every forward of the step."""
    runner = engine.drafter.model.runner
    passes, threads, forward = counting_passes(runner, monkeypatch), [], runner.forward
    monkeypatch.setattr(runner, "forward", lambda *args, **kw: threads.append(threading.current_thread()) or forward(*args, **kw))
    caches = [runner.new_cache() for _ in range(3)]
    wide = torch.arange(runner.exact_positions + 1) % 40 + 2
    logits = draft_together([lambda: feed(runner, caches[0], wide, "last"), lambda: feed(runner, caches[1], wide[:2], "all"),
                             lambda: feed(runner, caches[2], wide[:1], "last")])
    assert passes == [2] and threads == [threading.current_thread()]
    assert [x.shape[0] for x in logits] == [1, 2, 1] and [c.length for c in caches] == [len(wide), 2, 1]


def test_each_feed_of_a_shared_pass_gets_the_logits_it_asks_for(engine, monkeypatch):
    """Feeds asking "none", "last" and "all" share one pass, each scored as it asks: the bits `forward` gives it alone."""
    runner = engine.drafter.model.runner
    feeds = [torch.tensor([5, 9, 2]), torch.tensor([22, 3]), torch.tensor([40, 7, 7, 11])]
    modes = ["none", "last", "all"]
    alone = [runner.forward(runner.new_cache(), tokens, logits=mode) for tokens, mode in zip(feeds, modes)]
    passes, caches = counting_passes(runner, monkeypatch), [runner.new_cache() for _ in feeds]
    shared = draft_together([lambda i=i: feed(runner, caches[i], feeds[i], modes[i]) for i in range(len(feeds))])
    assert passes == [3] and shared[0] is None and alone[0] is None
    assert all(torch.equal(a, b) for a, b in zip(alone[1:], shared[1:])) and [x.shape[0] for x in shared[1:]] == [1, 4]


def test_a_task_without_a_model_runs_on_the_calling_thread_and_threads_are_kept():
    here = threading.current_thread()
    before = threading.active_count()
    for _ in range(50):
        threads = draft_together([threading.current_thread] * 3, [False, True, True])
        assert threads[0] is here and here not in threads[1:] and threads[1] is not threads[2]
    assert threading.active_count() <= before + 6  # kept for the next step, not one more per call
    assert draft_together([threading.current_thread, threading.current_thread], [True, False]) == [here, here]  # one: here


def test_only_drafters_that_draft_through_feed_share_passes(engine):
    """The online drafter's head records each pass's last row (its training data: another request's, in a shared
    pass), tree expansion and TriForce run forwards of their own: their plans run alone. A model drafter and hybrid
    over it share; prompt lookup runs no model."""
    from verispec.drafters import NgramDrafter
    from verispec.drafters.hybrid import HybridDrafter
    from verispec.drafters.online import OnlineDrafter
    from verispec.drafters.tree import ExpansionDrafter

    from verispec.drafters.cascade import HorizontalCascadeDrafter, VerticalCascadeDrafter

    model = engine.drafter
    assert model.batches_drafts and HybridDrafter(model).batches_drafts
    vocab, online = model.target_vocab_size, OnlineDrafter(model.model, model.target_vocab_size)
    assert VerticalCascadeDrafter(model.model, NgramDrafter(), vocab).batches_drafts
    assert not VerticalCascadeDrafter(model.model, online, vocab).batches_drafts
    assert HorizontalCascadeDrafter(model, NgramDrafter(), 2, vocab).batches_drafts
    assert not HorizontalCascadeDrafter(online, NgramDrafter(), 2, vocab).batches_drafts
    assert not OnlineDrafter(model.model, model.target_vocab_size).batches_drafts
    assert not ExpansionDrafter(model.model, model.target_vocab_size).batches_drafts
    flags = [Engine(engine.target, drafter).start(PROMPTS[0], CONFIGS[0]).batches_drafts
             for drafter in (model, NgramDrafter(), OnlineDrafter(model.model, model.target_vocab_size), None)]
    assert flags == [True, False, False, False]
