"""A request's output is the same alone or among concurrent requests (issue #34), on every backend
that runs the tiny models: verispec's own runner in float32, bfloat16 and int8, and the Hugging
Face runner, with no drafter, n-gram drafts and a draft model.

Through the real `Scheduler`: five requests with prompts of different lengths (1 to 13 tokens, so
prefill chunks and decode steps interleave and a shared pass holds rows of 1 to 4 positions at
different cache lengths), greedy and seeded sampled, first each one ALONE, then all five at once.
Each request must give the same token ids, and the target's logits for its rows must be the same
bits in every verification pass: the scheduler puts every request's rows into ONE `forward_ragged`
pass, so a row whose logits depended on the other rows of the pass (a matmul kernel picked by the
number of rows, an activation scale shared by the pass, attention over padded caches) fails here
even where the tiny model's wide logit margins would hide it in the tokens. The batched run must
really have shared passes (a turn that stepped all five requests).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from server_helpers import token_ids

from verispec import Engine, GenerationConfig, SamplingParams
from verispec.drafters import DraftModelDrafter, NgramDrafter
from verispec.models.loading import load_model
from verispec.serving.http.scheduler import Scheduler

# different lengths (1…13 tokens), some with repeats for the n-gram drafter; no eos (0) or unknown (1) token
PROMPTS = [[40], [5, 9, 2, 7], [22, 3, 3, 3, 8, 2, 30, 42, 5], [20, 21, 22, 20, 21, 22, 20], [7, 7, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43]]
NEW_TOKENS = 24
# greedy and seeded sampled requests alternate
CONFIGS = [GenerationConfig(max_new_tokens=NEW_TOKENS) if i % 2 == 0 else
           GenerationConfig(max_new_tokens=NEW_TOKENS, sampling=SamplingParams(temperature=1.0), seed=10 + i)
           for i in range(len(PROMPTS))]
PRECISIONS = ["float32", "bfloat16", "int8", "hf"]
DRAFTERS = ["none", "ngram", "model"]


def make_engine(target_dir, draft_dir, precision: str, drafter: str) -> Engine:
    """A fresh engine over the tiny target in `precision` (no eos: every request runs its full length,
    so the five overlap), constant γ = 3."""
    target = load_model(target_dir, precision)
    target.eos_ids = frozenset()
    if drafter == "none":
        draft = None
    elif drafter == "ngram":
        draft = NgramDrafter(max_n=3)
    else:
        draft = DraftModelDrafter(load_model(draft_dir, precision), target.vocab_size)
    return Engine(target, draft, gamma=3, gamma_policy="constant")


def record_passes(engine: Engine) -> dict[int, list[torch.Tensor]]:
    """Wrap the target's `forward_ragged`: every row's logits, per cache (by id), in pass order."""
    runner, seen = engine.target.runner, {}
    ragged = runner.forward_ragged

    def recording(caches, feeds, *rest):
        rows = ragged(caches, feeds, *rest)
        for cache, logits in zip(caches, rows):
            seen.setdefault(id(cache), []).append(logits.clone())
        return rows
    runner.forward_ragged = recording
    return seen


def serve(engine: Engine, indices: list[int], passes: dict[int, list[torch.Tensor]]):
    """Requests `indices` (of PROMPTS/CONFIGS) submitted together to a fresh scheduler over `engine`;
    returns ({index: token ids}, {index: its rows' logits per pass}, the scheduler's turns)."""
    scheduler = Scheduler(engine, max_batch=8, prefill_chunk=8)

    async def run():
        jobs = {i: scheduler.submit(list(PROMPTS[i]), CONFIGS[i]) for i in indices}  # all queued before the worker starts
        scheduler.start()
        try:
            return jobs, dict(zip(jobs, await token_ids(list(jobs.values()))))
        finally:
            scheduler.stop()

    jobs, tokens = asyncio.run(run())
    logits = {i: passes.pop(id(job.generation.cache), []) for i, job in jobs.items()}
    return tokens, logits, list(scheduler.turns)


def differences(engine: Engine) -> tuple[list[str], list]:
    """Run each request alone, then all together on the same engine; what differs (empty: nothing),
    and the batched run's turns."""
    passes = record_passes(engine)
    alone_tokens, alone_logits = {}, {}
    for i in range(len(PROMPTS)):
        tokens, logits, _ = serve(engine, [i], passes)
        alone_tokens[i], alone_logits[i] = tokens[i], logits[i]
    tokens, logits, turns = serve(engine, list(range(len(PROMPTS))), passes)
    problems = []
    for i in range(len(PROMPTS)):
        kind = "greedy" if CONFIGS[i].sampling.greedy else "sampled"
        if tokens[i] != alone_tokens[i]:
            problems.append(f"request {i} ({kind}): tokens {tokens[i]} batched, {alone_tokens[i]} alone")
        assert len(alone_tokens[i]) == NEW_TOKENS and alone_logits[i], f"request {i} did not run"
        for step, (got, want) in enumerate(zip(logits[i], alone_logits[i])):
            if got.shape != want.shape or not torch.equal(got, want):
                gap = float((got - want).abs().max()) if got.shape == want.shape else float("nan")
                problems.append(f"request {i} ({kind}), pass {step}: logits differ (max {gap:.3g})")
                break
    return problems, turns


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_request_gives_the_same_output_alone_or_among_others(tiny_target, tiny_draft, precision, drafter):
    """Fails when a row's logits (or a request's tokens) change with the other requests of the pass."""
    engine = make_engine(tiny_target, tiny_draft, precision, drafter)
    if precision == "bfloat16" and not engine.target.runner.lm_head.row_invariant:
        pytest.skip("oneDNN cannot pack bfloat16 weights on this CPU: its F.linear layers are not promised row-invariant")
    problems, turns = differences(engine)
    assert max(len(turn.stepped) for turn in turns) == len(PROMPTS), "the five requests never shared a target pass"
    assert not problems, "\n".join(problems)


def test_the_identity_check_sees_a_row_that_depends_on_the_pass(tiny_target, tiny_draft):
    """Positive control: a runner whose logits move by a rounding-sized amount with the number of rows
    in the pass (what a kernel chosen by the batch size does) is caught by its logits, even where the
    tokens stay the same."""
    engine = make_engine(tiny_target, tiny_draft, "float32", "ngram")
    runner = engine.target.runner
    ragged = runner.forward_ragged

    def batch_dependent(caches, feeds, *rest):
        return [logits + 1e-6 * (len(caches) - 1) for logits in ragged(caches, feeds, *rest)]
    runner.forward_ragged = batch_dependent
    problems, _ = differences(engine)
    assert any("logits differ" in problem for problem in problems)
