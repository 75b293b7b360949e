"""Hybrid drafting: the near-free n-gram continuation when it looks good, the draft model otherwise.

Per step the n-gram index is asked first (a dict lookup, far cheaper than a draft forward:
BENCHMARKS.md#avx2-which-drafter-for-which-task). Its chain is used when the matched suffix
has at least `min_match` tokens and the n-gram source's measured acceptance (its α over this request,
accepted / judged tokens as `AcceptanceStats` counts it, with an optimistic prior of 1 of 2) is at least
`min_rate` percent; otherwise the draft model proposes. Acceptance is measured by comparing each
proposal with what was committed. The draft model's cache simply lags during n-gram steps and catches
up on its next proposal.
"""

from __future__ import annotations

from verispec.drafters.base import ComposedSession, Drafter, DraftSession
from verispec.drafters.ngram import NgramDrafter
from verispec.drafters.prefix import common_prefix_length
from verispec.errors import InvalidParameterError
from verispec.types import AcceptanceStats

__all__ = ["HybridDrafter"]


class HybridDrafter(Drafter):
    """`model_drafter`: the draft model's drafter (`DraftModelDrafter`, or `CrossVocabDrafter` for a model of
    another tokenizer: `hybrid:draft=NAME`)."""

    def __init__(self, model_drafter: Drafter, min_match: int = 2, min_rate: int = 30, max_n: int = 4):
        if min_match < 1 or not 0 <= min_rate <= 100:
            raise InvalidParameterError(
                f"hybrid drafter needs min_match ≥ 1 and 0 ≤ min_rate ≤ 100 (percent); got {min_match}, {min_rate}"
            )
        self.model_drafter, self.model = model_drafter, model_drafter.model
        self.ngram_drafter = NgramDrafter(max_n=max(max_n, min_match))
        self.min_match, self.min_rate = min_match, min_rate / 100
        self.name = f"hybrid:min_match={min_match},min_rate={min_rate},draft={self.model.name}"

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

    def rate(self, source: str) -> float:
        return self.counts[source].alpha

    def propose(self, ids, gamma, params, generator):
        tokens, matched = self.ngram.lookup(ids, gamma)
        if tokens and matched >= self.drafter.min_match and self.rate("ngram") >= self.drafter.min_rate:
            draft = self.ngram.propose(ids, gamma, params, generator)
            source = "ngram"
        else:
            draft = self.model.propose(ids, gamma, params, generator)
            source = "model"
        self.last = (source, draft.tokens.tolist(), len(ids))
        return draft

    def commit(self, ids):
        if self.last is not None:
            source, proposal, start = self.last
            self.counts[source].add(len(proposal), common_prefix_length(proposal, ids[start : start + len(proposal)]))
            self.last = None
        super().commit(ids)
