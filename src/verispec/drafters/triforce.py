"""TriForce-style hierarchical drafting for long prompts (speculation inside speculation).

Level 1: the small draft model with a StreamingLLM cache (attention sinks + a recent window), so
its cost does not grow with the prompt. Level 2: the TARGET attending only to a retrieval cache —
the prompt's best chunks (by query · mean chunk key, per layer) within `budget` tokens, plus the
recent tokens. Level 2 produces the proposal: it speculatively decodes with level 1 as its drafter
(`gamma1` tokens per inner step, verified by the same rejection rule as the engine uses), so each
proposed token is an exact sample of the level-2 distribution, which is returned as draft_probs.
Level 3 is the engine's normal step: the target with its full cache verifies, which keeps the
output exactly the target's.

This drafter uses the verifiers of `verispec.verify` for its inner level — the one place a drafter
does, because level 2 *is* a speculative decoder. It needs the engine's `attach_target_cache` hook
to build the retrieval cache from the target's prompt cache without a second prefill.
"""

from __future__ import annotations

import torch

from verispec.drafters.base import Drafter, DraftSession
from verispec.drafters.draft_model import sample_chain
from verispec.errors import InvalidParameterError
from verispec.models.loading import require_own_runner
from verispec.models.retrieval_cache import SparseCache, build_retrieval_cache
from verispec.models.runner import Cache, LoadedModel
from verispec.sampling.processors import score_rows
from verispec.types import Draft
from verispec.verify import verify_greedy, verify_sampled

__all__ = ["TriForceDrafter", "StreamingDraft"]


class TriForceDrafter(Drafter):
    """Options: budget (retrieved prompt tokens), chunk (tokens per chunk), recent (level-2 recent
    tokens), sinks + window (level-1 StreamingLLM cache), gamma1 (level-1 tokens per inner step),
    gamma2 (cap on the level-2 draft; 0 = the engine's γ)."""

    def __init__(
        self, target: LoadedModel, draft: LoadedModel, budget: int = 512, chunk: int = 32, recent: int = 64,
        sinks: int = 4, window: int = 256, gamma1: int = 2, gamma2: int = 0,
    ):
        checks = [
            (chunk >= 1, f"chunk must be ≥ 1, got {chunk}"),
            (budget >= chunk, f"budget must hold at least one chunk (budget ≥ chunk = {chunk}), got {budget}"),
            (recent >= 1, f"recent must be ≥ 1, got {recent}"),
            (sinks >= 0, f"sinks must be ≥ 0, got {sinks}"),
            (window >= 1, f"window must be ≥ 1, got {window}"),
            (gamma1 >= 1, f"gamma1 must be ≥ 1, got {gamma1}"),
            (gamma2 >= 0, f"gamma2 must be ≥ 0 (0 = the engine's γ), got {gamma2}"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidParameterError(f"triforce drafter: {message}")
        self.target, self.draft = target, draft
        self.budget, self.chunk, self.recent = budget, chunk, recent
        self.sinks, self.window, self.gamma1, self.gamma2 = sinks, window, gamma1, gamma2
        self.name = f"triforce:budget={budget},chunk={chunk}"

    def start(self, prompt_ids: list[int]) -> DraftSession:
        return _TriForceSession(self, prompt_ids)


class StreamingDraft:
    """Level 1: a draft model over a StreamingLLM cache (sinks + the last `window` committed positions)."""

    def __init__(self, model: LoadedModel, sinks: int, window: int, prompt_ids: list[int]):
        runner = model.runner
        self.sinks, self.window = sinks, window
        self.state = SparseCache(runner, runner.new_cache(sinks + window + 64))
        self.frozen = False
        self.output_start = len(prompt_ids)
        prefix = prompt_ids[:-1]
        for start in range(0, len(prefix), window):  # block-wise prefill: memory stays O(sinks + window)
            self.state.feed(prefix[start : start + window], logits="none")
            self.evict()

    def evict(self) -> None:
        if not self.frozen and self.state.covered >= self.sinks:
            self.state.freeze_prefix(self.sinks)
            self.frozen = True
        if self.frozen:
            self.state.evict(self.window)

    def propose(self, ids, gamma, params, generator, target_vocab_size) -> Draft:
        if gamma == 0:
            return Draft.empty()
        logits = self.state.feed(ids[self.state.covered :], logits="last")  # [1, vocab]
        step = lambda token: self.state.feed([token], logits="last")  # noqa: E731
        return sample_chain(logits, step, ids, gamma, params, generator, target_vocab_size, self.output_start)

    def rollback(self, position: int) -> None:
        self.state.rollback(min(position, self.state.covered))


class _TriForceSession(DraftSession):
    def __init__(self, drafter: TriForceDrafter, prompt_ids: list[int]):
        self.drafter = drafter
        self.level1 = StreamingDraft(drafter.draft, drafter.sinks, drafter.window, prompt_ids)
        self.level2: SparseCache | None = None
        self.prompt_len = len(prompt_ids)

    def attach_target_cache(self, cache: Cache) -> None:
        d = self.drafter
        self.level2 = build_retrieval_cache(d.target.runner, cache, d.chunk, d.budget, d.recent)

    def propose(self, ids, gamma, params, generator):
        if self.level2 is None:
            raise RuntimeError("the triforce drafter needs the target's prompt cache: run it through verispec.Engine")
        if self.drafter.gamma2:
            gamma = min(gamma, self.drafter.gamma2)
        seq = list(ids)
        tokens: list[int] = []
        probs: list[torch.Tensor] = []  # level-2 distributions of the proposed tokens, each [vocab]
        while len(tokens) < gamma:
            new, new_probs = self._level2_step(seq, min(self.drafter.gamma1, gamma - len(tokens) - 1), params, generator)
            seq.extend(new)
            tokens.extend(new)
            probs.extend(new_probs)
            self.level1.rollback(len(seq) - 1)
            self.level2.rollback(len(seq) - 1)
        draft_probs = torch.stack(probs[:gamma]) if probs else None  # [γ, vocab]
        return Draft(torch.tensor(tokens[:gamma], dtype=torch.long), draft_probs)

    def _level2_step(self, seq, gamma1, params, generator) -> tuple[list[int], list[torch.Tensor]]:
        """Level 1 drafts `gamma1` tokens after `seq`; the target over the retrieval cache verifies them."""
        vocab = self.drafter.target.vocab_size
        inner = self.level1.propose(seq, gamma1, params, generator, vocab)
        feed = seq[self.level2.covered :] + inner.tokens.tolist()
        logits = self.level2.feed(feed, logits="all")[-(len(inner) + 1) :]  # [γ1+1, vocab]
        scores = score_rows(logits, params, seq, inner.tokens, output_start=self.prompt_len)  # [γ1+1, …]
        if scores.greedy is not None:
            verdict, level2_probs = verify_greedy(inner.tokens, scores.greedy), []
        else:
            verdict = verify_sampled(inner.tokens, inner.probs, scores.probs, generator)
            level2_probs = list(scores.probs[: verdict.accepted + 1])  # each [vocab]
        return inner.tokens[: verdict.accepted].tolist() + [verdict.next_token], level2_probs

    def commit(self, ids):
        self.level2.rollback(len(ids) - 1)
        self.level1.rollback(len(ids) - 1)
        self.level1.evict()


def make_triforce(target: LoadedModel, draft: LoadedModel, options: dict[str, int]) -> TriForceDrafter:
    require_own_runner(target, "the triforce drafter")
    require_own_runner(draft, "the triforce drafter")
    try:
        return TriForceDrafter(target, draft, **options)
    except TypeError as e:
        raise InvalidParameterError(
            f"bad triforce drafter options {options}: use budget, chunk, recent, sinks, window, gamma1, gamma2"
        ) from e
