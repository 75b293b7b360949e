"""Hybrid drafting: the near-free n-gram continuation when it looks good, the draft model otherwise.

Per step the n-gram index is asked first (a dict lookup, far cheaper than a draft forward:
BENCHMARKS.md#avx2-which-drafter-for-which-task). Its chain is used when the matched suffix
has at least `min_match` tokens and the n-gram source's measured acceptance (its α over this request,
accepted / judged tokens as `AcceptanceStats` counts it, with an optimistic prior of 1 of 2) is at least
`min_rate` percent; otherwise the draft model proposes. Acceptance is measured by comparing each
proposal with what was committed. The draft model's cache simply lags during n-gram steps and catches
up on its next proposal.

The γ policy sizes the draft model's steps (each token a forward). An n-gram chain costs none, and a long
match often runs on for many tokens, so its length is its own (`budget`): Hugging Face's schedule over
the n-gram steps alone, from 4, +2 after a chain accepted whole, −1 otherwise (with the model's γ, 2–3 on
a CPU, prompt lookup inside `hybrid` lost to prompt lookup alone on summaries and code: BENCHMARKS.md).
"""

from __future__ import annotations

import copy

import torch

from verispec.drafters.base import ComposedSession, Drafter, DraftSession
from verispec.drafters.ngram import NgramDrafter
from verispec.drafters.prefix import common_prefix_length
from verispec.errors import InvalidParameterError
from verispec.types import AcceptanceStats, Draft

__all__ = ["HybridDrafter"]

MAX_NGRAM_CHAIN = 16  # the longest n-gram chain the schedule grows to (a step drafts at most the engine's max γ)


class HybridDrafter(Drafter):
    """`model_drafter`: the draft model's drafter (`DraftModelDrafter`, or `CrossVocabDrafter` for a model of
    another tokenizer: `hybrid:draft=NAME`). `window`: the draft model reads at most the prompt's last
    `window` tokens (`base.window_cut`; 0: all of it), so that a long prompt does not cost a long draft
    prefill where the n-gram index does the copying."""

    def __init__(self, model_drafter: Drafter, min_match: int = 2, min_rate: int = 30, max_n: int = 4, window: int = 0):
        if min_match < 1 or not 0 <= min_rate <= 100:
            raise InvalidParameterError(
                f"hybrid drafter needs min_match ≥ 1 and 0 ≤ min_rate ≤ 100 (percent); got {min_match}, {min_rate}"
            )
        if window:  # the draft model reads the prompt's last `window` tokens; the n-gram index reads all of it
            model_drafter = copy.copy(model_drafter)
            model_drafter.window = window
        self.model_drafter, self.model = model_drafter, model_drafter.model
        self.ngram_drafter = NgramDrafter(max_n=max(max_n, min_match))
        self.min_match, self.min_rate = min_match, min_rate / 100
        self.name = f"hybrid:min_match={min_match},min_rate={min_rate},draft={self.model.name}" + (f",window={window}" if window else "")

    def start(self, prompt_ids: list[int]) -> DraftSession:
        return _HybridSession(self, prompt_ids)


class _HybridSession(ComposedSession):
    def __init__(self, drafter: HybridDrafter, prompt_ids: list[int]):
        self.drafter = drafter
        self.model = drafter.model_drafter.start(prompt_ids)
        self.ngram = drafter.ngram_drafter.start(prompt_ids)
        super().__init__([self.model, self.ngram])
        self.counts = {source: AcceptanceStats(proposed=2, accepted=1, judged=2) for source in ("ngram", "model")}  # prior 1/2
        self.last: tuple[str, list[int], int] | None = None  # (source, proposal, committed length then)
        self.ngram_gamma = 4  # the n-gram chains' own length (module docstring)
        self.found: tuple[int, list[int]] | None = None  # (len(ids), the n-gram chain `budget` found then; []: none)

    def rate(self, source: str) -> float:
        return self.counts[source].alpha

    def _ngram_chain(self, ids: list[int], gamma: int) -> list[int]:
        """The n-gram continuation of up to `gamma` tokens if this step takes it, else []."""
        tokens, matched = self.ngram.lookup(ids, gamma)
        return tokens if tokens and matched >= self.drafter.min_match and self.rate("ngram") >= self.drafter.min_rate else []

    def budget(self, ids, gamma, most):
        chain = self._ngram_chain(ids, most) if gamma > 0 else []
        self.found = (len(ids), chain)  # this step's lookup, which `propose` takes
        return min(self.ngram_gamma, most) if chain else gamma

    def propose(self, ids, gamma, params, generator):
        found, self.found = self.found, None
        chain = found[1] if found is not None and found[0] == len(ids) else self._ngram_chain(ids, gamma)
        if chain:
            draft, source = Draft(torch.tensor(chain[:gamma], dtype=torch.long)), "ngram"
        else:
            draft, source = self.model.propose(ids, gamma, params, generator), "model"
        self.last = (source, draft.tokens.tolist(), len(ids))
        return draft

    def commit(self, ids):
        if self.last is not None:
            source, proposal, start = self.last
            accepted = common_prefix_length(proposal, ids[start : start + len(proposal)])
            self.counts[source].add(len(proposal), accepted)
            if source == "ngram":
                whole = accepted == len(proposal)
                self.ngram_gamma = min(self.ngram_gamma + 2, MAX_NGRAM_CHAIN) if whole else max(self.ngram_gamma - 1, 1)
            self.last = None
        super().commit(ids)
