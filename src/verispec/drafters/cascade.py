"""Cascade speculative drafting (Chen et al., 2023): drafters for the drafter, cheaper drafters for later positions.

Vertical: the draft model's own proposals are themselves drafted by a cheaper `inner` drafter
(n-gram prompt lookup, a smaller model, or another cascade) and verified by the draft model in one
forward, with the same rejection rule the engine applies to the target (`verify.chain`). That rule
makes every emitted token distributed exactly as the draft model's own (processed) distribution
given the tokens before it, so the rows returned as `Draft.probs` are the draft model's
distributions at each position and the target's verification stays lossless. Greedy: the draft
model keeps the inner tokens that equal its argmax, then adds its argmax. The draft model's cache
keeps exactly the path it accepted. This level is a small engine of its own, which is why this
drafter — unlike the others — uses the verifiers.

Horizontal: a strong drafter proposes the first `strong_positions` tokens of the block and a weak one
(n-gram) the rest: position i is reached only when all before it were accepted, so later positions
are worth less and get the cheaper drafter. A deterministic part is a point mass in `Draft.probs`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from verispec.drafters.base import ComposedSession, Drafter, DraftSession, ModelSession
from verispec.errors import InvalidParameterError
from verispec.models.runner import LoadedModel
from verispec.sampling.processors import SamplingParams, score_rows
from verispec.types import Draft
from verispec.verify import verify_greedy, verify_sampled

__all__ = ["VerticalCascadeDrafter", "HorizontalCascadeDrafter"]


def _empty_draft() -> Draft:
    return Draft.empty()


def _widen(probs: torch.Tensor, width: int) -> torch.Tensor:
    """probs [n, v] zero-padded to [n, width] (width ≥ v)."""
    return F.pad(probs, (0, width - probs.shape[-1])) if probs.shape[-1] < width else probs


def _rows(draft: Draft, width: int) -> torch.Tensor:
    """The draft's distributions [len, width]; a point mass at each token for a deterministic draft."""
    if draft.probs is not None:
        return _widen(draft.probs, width)
    return F.one_hot(draft.tokens, width).float()


# --- vertical ------------------------------------------------------------------------------------


class VerticalCascadeDrafter(Drafter):
    """`model` drafts for the target; `inner` drafts for `model` (at most `inner_gamma` tokens at a time)."""

    def __init__(self, model: LoadedModel, inner: Drafter, target_vocab_size: int, inner_gamma: int | None = None):
        if inner_gamma is not None and inner_gamma < 1:
            raise InvalidParameterError(f"inner_gamma must be ≥ 1, got {inner_gamma}")
        self.model = model  # the engine times this model for c (an upper bound: the inner level saves some)
        self.inner, self.inner_gamma = inner, inner_gamma
        self.batches_drafts = inner.model is None or inner.batches_drafts  # its own model runs through `_feed`
        self.target_vocab_size = target_vocab_size
        self.name = f"cascade:{model.name}<{inner.name}"

    def start(self, prompt_ids: list[int]) -> DraftSession:
        return _VerticalSession(self, prompt_ids)

    def start_chunked(self, prompt_ids: list[int]) -> DraftSession:
        return _VerticalSession(self, prompt_ids, prefill=False)


class _VerticalSession(ModelSession):
    def __init__(self, drafter: VerticalCascadeDrafter, prompt_ids: list[int], prefill: bool = True):
        super().__init__(drafter.model, prompt_ids, prefill)
        self.drafter = drafter
        self.inner = drafter.inner.start(prompt_ids)

    def propose(self, ids, gamma, params, generator):
        context = list(ids)
        tokens: list[int] = []
        rows: list[torch.Tensor] = []  # the draft model's distributions, [accepted + 1, vocab] per mini-step
        while len(tokens) < gamma:
            budget = gamma - len(tokens) - 1  # the draft model always adds one token of its own
            if self.drafter.inner_gamma is not None:
                budget = min(budget, self.drafter.inner_gamma)
            inner = self.inner.propose(context, budget, params, generator) if budget > 0 else _empty_draft()
            inner = Draft(inner.tokens[:budget], None if inner.probs is None else inner.probs[:budget])
            new_tokens, model_probs = self._verify(context, inner, params, generator)
            context += new_tokens
            tokens += new_tokens
            if model_probs is not None:
                rows.append(model_probs)
            self.inner.commit(context)
        draft_probs = _widen(torch.cat(rows), self.drafter.target_vocab_size) if rows else None  # [γ, vocab]
        return Draft(torch.tensor(tokens, dtype=torch.long), draft_probs)

    def _verify(self, context: list[int], inner: Draft, params: SamplingParams, generator) -> tuple[list[int], torch.Tensor | None]:
        """Score the inner draft with the draft model in one forward; keep what its rejection rule accepts.

        Returns the new tokens (accepted inner tokens + one of the draft model's) and, when sampling,
        the draft model's distributions at those positions [len(new tokens), vocab].
        """
        drafted = len(inner)
        logits = self._catch_up(context, inner.tokens.tolist(), logits="all")[-(drafted + 1) :]  # [m+1, vocab]
        scores = score_rows(logits, params, context, inner.tokens, output_start=self.output_start)  # [m+1, …]
        model_probs = scores.probs
        if model_probs is None:
            verdict = verify_greedy(inner.tokens, scores.greedy)
        else:  # both distributions over the wider vocabulary
            width = max(model_probs.shape[-1], 0 if inner.probs is None else inner.probs.shape[-1])
            inner_probs = None if inner.probs is None else _widen(inner.probs, width)
            verdict = verify_sampled(inner.tokens, inner_probs, _widen(model_probs, width), generator)
            model_probs = model_probs[: verdict.accepted + 1]
        self._rollback(len(context) + verdict.accepted)  # keys of the accepted path only
        return inner.tokens[: verdict.accepted].tolist() + [verdict.next_token], model_probs

    def commit(self, ids):
        super().commit(ids)
        self.inner.commit(ids)

    def finish(self):
        super().finish()
        self.inner.finish()


# --- horizontal ----------------------------------------------------------------------------------


class HorizontalCascadeDrafter(Drafter):
    """`strong` proposes the first `strong_positions` tokens of each block, `weak` the later ones."""

    def __init__(self, strong: Drafter, weak: Drafter, strong_positions: int, target_vocab_size: int):
        if strong_positions < 1:
            raise InvalidParameterError(f"strong (positions the strong drafter owns) must be ≥ 1, got {strong_positions}")
        self.strong, self.weak, self.strong_positions = strong, weak, strong_positions
        self.target_vocab_size = target_vocab_size
        self.model = strong.model  # c of the strong drafter, for the engine's cost model
        self.batches_drafts = all(d.model is None or d.batches_drafts for d in (strong, weak))
        self.name = f"cascade:{strong.name}[:{strong_positions}]+{weak.name}"

    def start(self, prompt_ids: list[int]) -> DraftSession:
        return _HorizontalSession(self, prompt_ids)

    def start_chunked(self, prompt_ids: list[int]) -> DraftSession:
        return _HorizontalSession(self, prompt_ids, chunked=True)


class _HorizontalSession(ComposedSession):
    def __init__(self, drafter: HorizontalCascadeDrafter, prompt_ids: list[int], chunked: bool = False):
        self.drafter = drafter
        self.strong, self.weak = (d.start_chunked(prompt_ids) if chunked else d.start(prompt_ids)
                                  for d in (drafter.strong, drafter.weak))
        super().__init__([self.strong, self.weak])

    def propose(self, ids, gamma, params, generator):
        first = min(gamma, self.drafter.strong_positions)
        strong = self.strong.propose(ids, first, params, generator) if first > 0 else _empty_draft()
        strong = Draft(strong.tokens[:first], None if strong.probs is None else strong.probs[:first])
        rest = gamma - len(strong)
        weak = self.weak.propose(list(ids) + strong.tokens.tolist(), rest, params, generator) if rest > 0 else _empty_draft()
        weak = Draft(weak.tokens[:rest], None if weak.probs is None else weak.probs[:rest])
        tokens = torch.cat([strong.tokens, weak.tokens])  # [γ']
        if strong.probs is None and weak.probs is None:
            return Draft(tokens)
        width = self.drafter.target_vocab_size
        return Draft(tokens, torch.cat([_rows(strong, width), _rows(weak, width)]))  # [γ', vocab]
