"""Hybrid drafting: the near-free n-gram continuation when it looks good, the draft model otherwise.

Per step the n-gram index is asked first (a dict lookup, far cheaper than a draft forward:
BENCHMARKS.md#avx2-which-drafter-for-which-task). Its chain is used when the matched suffix
has at least `min_match` tokens and the n-gram source's measured acceptance (its α over this request,
accepted / judged tokens as `AcceptanceStats` counts it, with an optimistic prior of 1 of 2) is at least
`min_rate` percent (default 0: off, the γ policy sizes and pauses lookup's classes by their own acceptance; at
30, long chains' rejected tails shut lookup out of summaries, 10 % slower there); otherwise the draft model
proposes. Acceptance is measured by comparing each
proposal with what was committed. The draft model's cache simply lags during n-gram steps and catches
up on its next proposal; opened by the engine (`start_chunked`), it reads the prompt only at its first proposal
(`ModelSession.defer_prefill`), so a request that prompt lookup serves throughout, or that a busy batch never lets
draft with the model (`control/batch.py`), pays no draft prefill.

The γ policy sizes the two sources' steps apart (`hint`): an n-gram step is in prompt lookup's class of its
matched length and costs no draft forward (`Hint.free`: priced at c = 0), a draft model step is in a class of
its own (`MODEL_STEPS`), priced at the draft's measured cost. So under the `analytic` and `auto` policies an
n-gram chain runs as long as its class's acceptance pays for on the target's curve, and the model's steps are
sized, or paused, by the model's own acceptance, not by the long chains' (which sized them before: on
summaries the model then drafted past what it was accepted).
"""

from __future__ import annotations

import copy

import torch

from verispec.control.plan import ALPHA_PRIORS
from verispec.drafters.base import ComposedSession, Drafter, DraftSession
from verispec.drafters.ngram import NgramDrafter, match_hint
from verispec.drafters.prefix import common_prefix_length
from verispec.errors import InvalidParameterError
from verispec.types import AcceptanceStats, Draft, Hint

__all__ = ["HybridDrafter", "MODEL_STEPS"]

# the draft model's steps: a class apart from prompt lookup's (keys 1… by matched length), from the prior the plan
# predicts hybrid's draft with
MODEL_STEPS = Hint(0, ALPHA_PRIORS["hybrid"])


class HybridDrafter(Drafter):
    """`model_drafter`: the draft model's drafter (`DraftModelDrafter`, or `CrossVocabDrafter` for a model of
    another tokenizer: `hybrid:draft=NAME`). `window`: the draft model reads at most the prompt's last
    `window` tokens (`base.window_cut`; 0: all of it), so that a long prompt does not cost a long draft
    prefill where the n-gram index does the copying."""

    def __init__(self, model_drafter: Drafter, min_match: int = 2, min_rate: int = 0, max_n: int = 4, window: int = 0):
        if min_match < 1 or not 0 <= min_rate <= 100:
            raise InvalidParameterError(
                f"hybrid drafter needs min_match ≥ 1 and 0 ≤ min_rate ≤ 100 (percent); got {min_match}, {min_rate}"
            )
        if window:  # the draft model reads the prompt's last `window` tokens; the n-gram index reads all of it
            model_drafter = copy.copy(model_drafter)
            model_drafter.window = window
        self.model_drafter, self.model = model_drafter, model_drafter.model
        self.batches_drafts = model_drafter.batches_drafts  # prompt lookup runs no model
        self.ngram_drafter = NgramDrafter(max_n=max(max_n, min_match))
        self.min_match, self.min_rate = min_match, min_rate / 100
        self.name = f"hybrid:min_match={min_match},min_rate={min_rate},draft={self.model.name}" + (f",window={window}" if window else "")

    def prepare_sampling(self) -> None:
        self.model_drafter.prepare_sampling()

    def start(self, prompt_ids: list[int]) -> DraftSession:
        return _HybridSession(self, prompt_ids)

    def start_chunked(self, prompt_ids: list[int]) -> DraftSession:
        return _HybridSession(self, prompt_ids, chunked=True)


class _HybridSession(ComposedSession):
    def __init__(self, drafter: HybridDrafter, prompt_ids: list[int], chunked: bool = False):
        self.drafter = drafter
        start = drafter.model_drafter.start_chunked if chunked else drafter.model_drafter.start
        self.model = start(prompt_ids)
        if chunked:  # the draft model reads the prompt at its first proposal: prompt lookup may serve every step
            self.model.defer_prefill()
        self.ngram = drafter.ngram_drafter.start(prompt_ids)
        super().__init__([self.model, self.ngram])
        self.counts = {source: AcceptanceStats(proposed=2, accepted=1, judged=2) for source in ("ngram", "model")}  # prior 1/2
        self.last: tuple[str, list[int], int] | None = None  # (source, proposal, committed length then)
        self.choice: tuple[int, int] | None = None  # (len(ids), the matched length the n-gram step drafts after; 0: the model's step)

    def rate(self, source: str) -> float:
        return self.counts[source].alpha

    def _matched(self, ids: list[int]) -> int:
        """The length of the suffix whose n-gram continuation this step drafts, or 0: the draft model proposes
        (chosen once a step, by `hint` or else `propose`)."""
        if self.choice is None or self.choice[0] != len(ids):
            tokens, matched = self.ngram.lookup(ids, 1)
            takes = bool(tokens) and matched >= self.drafter.min_match and self.rate("ngram") >= self.drafter.min_rate
            self.choice = (len(ids), matched if takes else 0)
        return self.choice[1]

    def hint(self, ids):
        matched = self._matched(ids)
        return match_hint(matched) if matched else MODEL_STEPS

    def propose(self, ids, gamma, params, generator):
        if self._matched(ids):
            draft, source = Draft(torch.tensor(self.ngram.lookup(ids, gamma)[0], dtype=torch.long)), "ngram"
        else:
            draft, source = self.model.propose(ids, gamma, params, generator), "model"
        self.last = (source, draft.tokens.tolist(), len(ids))
        return draft

    def commit(self, ids):
        if self.last is not None:
            source, proposal, start = self.last
            accepted = common_prefix_length(proposal, ids[start : start + len(proposal)])
            self.counts[source].add(len(proposal), accepted)
            self.last = None
        super().commit(ids)
