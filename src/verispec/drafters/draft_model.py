"""Drafting with a small model of the target's family, with its own static KV cache.

The draft cache always holds a prefix of the committed sequence: after verification it is cut to
the accepted path, with no recomputation. When every draft token was accepted the draft has not
seen its own last token yet; the next step feeds it together with the target's bonus token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from verispec.drafters.base import Drafter, DraftSession, ModelSession
from verispec.models.runner import LoadedModel
from verispec.sampling.processors import SamplingParams, greedy_tokens, penalties, to_probs
from verispec.sampling.samplers import multinomial
from verispec.types import Draft

__all__ = ["DraftModelDrafter", "sample_chain"]


def sample_chain(
    logits: torch.Tensor,
    step: Callable[[int], torch.Tensor],
    ids: list[int],
    gamma: int,
    params: SamplingParams,
    generator: torch.Generator | None,
    target_vocab_size: int,
    output_start: int,
) -> Draft:
    """Draw `gamma` tokens one by one after `ids` (whose output begins at `output_start`): `logits` [1, vocab]
    predict the first, `step(token)` feeds a token and returns the logits [1, vocab] after it. Draft probs
    are padded to the target's vocab."""
    vocab = logits.shape[-1]
    seen = penalties(params, vocab, ids, device=logits.device, output_start=output_start)  # one row, or None
    tokens: list[int] = []
    probs: list[torch.Tensor] = []
    for i in range(gamma):
        if params.greedy:
            token = int(greedy_tokens(logits, params, seen))
        else:
            row = to_probs(logits, params, seen)  # [1, vocab]
            token = int(multinomial(row, generator))
            probs.append(row[0])
        tokens.append(token)
        if seen is not None:
            seen.add(token)
        if i + 1 < gamma:
            logits = step(token)
    draft_probs = None
    if probs:
        draft_probs = torch.stack(probs)  # [γ, vocab]
        if vocab < target_vocab_size:
            draft_probs = F.pad(draft_probs, (0, target_vocab_size - vocab))
    return Draft(torch.tensor(tokens, dtype=torch.long), draft_probs)


class DraftModelDrafter(Drafter):
    """window: the draft reads at most the last `window` prompt tokens (`base.window_cut`; None: all)."""

    batches_drafts = True  # a chain of `_feed` calls

    def __init__(self, model: LoadedModel, target_vocab_size: int, window: int | None = None):
        self.model, self.window = model, window
        self.name = f"model:{model.name}"
        self.target_vocab_size = target_vocab_size

    def start(self, prompt_ids: list[int]) -> DraftSession:
        return _DraftModelSession(self, prompt_ids)

    def start_chunked(self, prompt_ids: list[int]) -> DraftSession:
        return _DraftModelSession(self, prompt_ids, prefill=False)


class _DraftModelSession(ModelSession):
    def __init__(self, drafter: DraftModelDrafter, prompt_ids: list[int], prefill: bool = True):
        super().__init__(drafter.model, prompt_ids, prefill, drafter.window)
        self.target_vocab_size = drafter.target_vocab_size

    def propose(self, ids, gamma, params, generator):
        if gamma == 0:
            return Draft.empty()
        logits = self._catch_up(ids)  # [1, vocab]
        step = lambda token: self._feed([token])  # noqa: E731
        return sample_chain(logits, step, ids, gamma, params, generator, self.target_vocab_size, self.output_start)
