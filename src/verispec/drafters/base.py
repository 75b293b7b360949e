"""The drafter interface: one object per drafter kind, one session per request.

`Drafter.start(prompt_ids)` opens a `DraftSession` holding that request's state (a KV cache, an
n-gram index, …). Each step the engine calls `session.propose(ids, gamma, ...)` and, after
verification, `session.commit(ids)` with the new committed sequence, so the session can roll back
whatever the target did not keep. A session that returns `Draft.probs = None` is deterministic:
the verifier treats each token as a point mass. A session may return a token tree
(`Draft.parents`); the engine verifies it in one forward with a tree attention mask.

Two optional hooks show a session the target's side. `attach_target_cache` gets the target's prompt
cache once (TriForce builds its retrieval cache from it). Sessions that learn from the target (STAND,
the online drafter) set `observes_target = True`; the engine then calls `observe(ids, target_probs)`
after each commit with the target's distributions at the newly committed positions. Before drafting, the
engine asks `hint(ids)` for the class of step this will be (prompt lookup: the length of the suffix it
matched), whose acceptance the γ policy measures apart (`control/gamma.py`). `finish()`
tells a session its request is over. `start_chunked` opens a session whose own prefill (a draft
model's) is fed later, a chunk per `prefill_step` (a server interleaving a long prompt with other
requests' steps); by default it is `start`, and sessions have nothing left to feed.

`ModelSession` is the base of every session that drafts with a model of its own KV cache (draft
model, tree expansion, vertical cascade): it prefills the cache, feeds it the committed tokens it
lacks, rolls it back to the committed prefix after verification and releases it at the end.
`ComposedSession` is the base of sessions built from other drafters' sessions (merge, horizontal
cascade, hybrid): commit, observe and finish reach every part.

A drafter whose drafts may be token trees says so (`drafts_trees`); `check_target` refuses it for a
target whose runner scores chains only (`Runner.supports_trees`), when an engine takes it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from verispec.drafters.batching import feed
from verispec.drafters.prefix import common_prefix_length
from verispec.errors import InvalidParameterError
from verispec.models.prefixes import draft_prefix_store
from verispec.models.runner import Cache, LoadedModel
from verispec.sampling.processors import SamplingParams
from verispec.types import Draft, Hint

__all__ = ["Drafter", "DraftSession", "ModelSession", "ComposedSession"]


class DraftSession(ABC):
    @abstractmethod
    def propose(
        self, ids: list[int], gamma: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        """Up to `gamma` tokens that may follow `ids` (fewer, even none, is allowed)."""

    observes_target: bool = False

    def budget(self, ids: list[int], gamma: int, most: int) -> int:
        """How many tokens this step may draft after `ids`, given the γ policy's `gamma`: γ, or more (up to
        `most`) for a step whose proposal costs no forward pass (the γ policy sizes a draft model's steps by
        its cost). Default: γ."""
        return gamma

    def hint(self, ids: list[int]) -> Hint | None:
        """What this session knows of its proposal after `ids` before making it: a class of steps whose
        acceptance the `analytic`/`auto` γ policies measure apart, sizing each step by its class (prompt
        lookup: a long matched suffix is right far more often than a one-token match). None (default): every
        step is alike."""
        return None

    def lag(self, ids: list[int]) -> int:
        """The committed tokens of `ids` past the prompt that a draft model of this session must still feed before
        its next draft, past the one every step feeds (a model's cache behind the sequence after steps it drafted
        nothing in): what its next draft costs more than a step's. A prompt it has not read yet is not counted: it is
        read once, whenever (`ModelSession.defer_prefill`). Default: 0 (nothing to feed)."""
        return 0

    def commit(self, ids: list[int]) -> None:
        """`ids` is the committed sequence after verification; drop state past it."""

    def attach_target_cache(self, cache: Cache) -> None:
        """Called once after the target's prefill with its KV cache of prompt[:-1]: read it, never write
        it (the TriForce drafter builds its retrieval cache from it). Default: ignore it."""

    def observe(self, ids: list[int], target_probs: torch.Tensor) -> None:
        """target_probs [m, vocab]: row j is the target's distribution that produced ids[len(ids) − m + j]
        (processed like the sampling distribution; plain softmax under greedy decoding)."""

    def finish(self) -> None:
        """The request is over (finished, stopped or cancelled). Default: nothing to do."""

    def prefill_step(self, max_tokens: int | None = None) -> bool:
        """Feed at most `max_tokens` more prompt tokens (None: all the rest; 0: only ask) into the
        session's own state; returns whether its prefill is complete. Only sessions opened with
        `Drafter.start_chunked` may have any left. Default: nothing to feed."""
        return True

    def defer_prefill(self) -> None:
        """Leave the prompt to the first proposal, which reads whatever it lacks (`ModelSession`'s); `prefill_step`
        then says done at once. Default: nothing to defer (no prompt of its own to read)."""


class Drafter(ABC):
    name: str = "drafter"
    model: LoadedModel | None = None  # the draft model whose forward passes are the drafting cost (None: model-free, c = 0)
    drafts_trees: bool = False  # whether a draft may be a token tree (the target verifies it with a tree mask)
    # whether its sessions run their model only through `ModelSession._feed`, whose forwards requests stepped together
    # share (`batching.py`); otherwise (a session's own forwards, the online head that records each pass) its plan runs
    # alone, on the calling thread
    batches_drafts: bool = False

    def check_target(self, target: LoadedModel) -> None:
        """Refuse a target that cannot verify this drafter's drafts (token trees on a runner that scores
        chains only), with an error that says what to use instead. The engine calls it when it takes
        the drafter, so the refusal comes at load, not at the first step."""
        if self.drafts_trees and not target.runner.supports_trees:
            raise InvalidParameterError(
                f"the {self.name} drafter drafts token trees, which {target.name} cannot verify: its runner "
                f"({target.precision}, model type {target.runner.config.model_type!r}) scores chains only; "
                "use a chain drafter (model, ngram, hybrid, …)"
            )

    @abstractmethod
    def start(self, prompt_ids: list[int]) -> DraftSession:
        """Open the per-request state for a prompt."""

    def start_chunked(self, prompt_ids: list[int]) -> DraftSession:
        """A session whose own prefill the caller feeds a chunk at a time with `session.prefill_step`.
        Default: `start` (the whole prefill now)."""
        return self.start(prompt_ids)

    def prepare_sampling(self) -> None:
        """Build now what a sampled proposal needs and a greedy one does not (a cross-vocabulary draft's shared
        vocabulary: half a second of reading both vocabularies), so that a server's first sampled request does not
        wait for it. Default: nothing to build."""


SINK = 4  # prompt tokens a draft window keeps from the start (the chat template's opening; StreamingLLM's sinks)


def window_cut(length: int, window: int | None) -> tuple[int, int] | None:
    """Where a draft reading at most the last `window` tokens of a `length`-token prompt (and its first SINK)
    leaves the prompt out: (SINK, the first prompt position it reads again), or None (it reads everything).
    A draft only proposes, so what it reads never changes the output; a short view of a long prompt
    prefills in a fraction of the time."""
    skip = length - window if window else 0
    return (SINK, skip) if skip > SINK else None


def windowed(ids: list[int], cut: tuple[int, int] | None) -> list[int]:
    """What a draft with this `window_cut` reads of the sequence `ids`: all of it, or without the prompt's middle."""
    if cut is None:
        return ids
    sink, skip = cut
    return ids[:sink] + ids[skip:]


class ModelSession(DraftSession):
    """A session drafting with `model` over a KV cache of its own that always holds a prefix of the
    sequence: `cached` is the ids whose keys/values it holds, the prompt but its last token at the start.

    With a `window` it reads the sequence through `view`: the prompt's middle left out (`window_cut`).

    Subclasses feed it with `_feed` (tokens appended to the sequence) and `_catch_up` (the committed
    ids it lacks first); `commit` keeps the part of `cached` the committed sequence agrees with, never
    the sequence's last token (the draft has not seen it yet, or it is fed again with the next step);
    `finish` releases the cache. Opened without its prefill, it may leave the prompt to its first proposal
    (`defer_prefill`), which feeds whatever it lacks anyway.
    """

    def __init__(self, model: LoadedModel, prompt_ids: list[int], prefill: bool = True, window: int | None = None):
        self.runner = model.runner
        self.output_start = len(prompt_ids)  # where a sequence's output begins (what presence/frequency penalties count)
        self.cut = window_cut(len(prompt_ids), window)
        prompt_ids = self.view(prompt_ids)
        self._prompt = list(prompt_ids[:-1])  # what the prefill feeds (the last token comes with the first step)
        # an earlier session's keys/values of this prompt's beginning, where exact (`models/prefixes.py`), else an empty cache
        self.prefixes = draft_prefix_store(model)
        capacity = len(prompt_ids) + 64
        reused = self.prefixes.take(prompt_ids, capacity) if self.prefixes is not None else None
        self.cache = reused if reused is not None else self.runner.new_cache(capacity)
        self.cached: list[int] = self._prompt[: self.cache.length]
        # cached[:checked] is a prefix of the sequence the last commit got, and the next commit's sequence
        # agrees with that one before its own last token (it only adds accepted drafts and one token), so
        # a commit compares only from there on: a few tokens, not the whole context
        self._checked = len(self.cached)
        self._deferred = False
        if prefill:  # else prefill_step feeds the rest; a proposal would first feed whatever is still missing anyway
            self.prefill_step()

    def defer_prefill(self) -> None:
        """Its catching up at the first proposal feeds the prompt: for a draft model that may never draft (`hybrid`'s,
        while prompt lookup serves every step, or cut in a busy batch: `control/batch.py`), whose prefill would be
        paid for nothing."""
        self._deferred = True

    def prefill_step(self, max_tokens=None):
        if self._deferred:
            return True
        if len(self.cached) < len(self._prompt) and self._prompt[: len(self.cached)] == self.cached:
            end = len(self._prompt) if max_tokens is None else min(len(self._prompt), len(self.cached) + max_tokens)
            if end > len(self.cached):
                self._feed(self._prompt[len(self.cached) : end], logits="none")
                self._checked = len(self.cached)
        return len(self.cached) >= len(self._prompt)

    def _feed(self, tokens: list[int], logits: str = "last") -> torch.Tensor | None:
        """Append `tokens` to the cache; the runner's logits for them ("last" [1, vocab], "all" [n, vocab]). Among
        other requests drafting at once (`batching.draft_together`), in one pass with their feeds."""
        out = feed(self.runner, self.cache, torch.tensor(tokens, dtype=torch.long), logits)
        self.cached += tokens
        return out

    def view(self, ids: list[int]) -> list[int]:
        """What the draft reads of the sequence `ids` (`windowed`)."""
        return windowed(ids, self.cut)

    def _catch_up(self, ids: list[int], extra: Sequence[int] = (), logits: str = "last") -> torch.Tensor | None:
        """Feed the committed `ids` the cache lacks (at least the last one), then `extra` tokens after them."""
        ids = self.view(ids)
        return self._feed(list(ids[len(self.cached) :]) + list(extra), logits)

    def lag(self, ids):
        return max(0, len(self.view(ids)) - max(len(self.cached), len(self._prompt)) - 1)  # the prompt not counted

    def _rollback(self, length: int) -> None:
        """Keep the first `length` cached positions."""
        self.cache.truncate(length)
        del self.cached[length:]
        self._checked = min(self._checked, length)

    def commit(self, ids):
        ids = self.view(ids)
        start = min(self._checked, len(ids) - 1)
        keep = min(start + common_prefix_length(self.cached[start:], ids[start:]), len(ids) - 1)
        self._rollback(keep)
        self._checked = keep

    def finish(self):
        if self.prefixes is not None:  # for a later request that starts the same way (a conversation's next turn)
            self.prefixes.keep(self.cached, self.cache)
        self.cache.release()


class ComposedSession(DraftSession):
    """A session that drafts with other sessions (`sessions`): each is told every commit, sees the
    target when it asks to, and is finished with this one."""

    def __init__(self, sessions: list[DraftSession]):
        self.sessions = sessions
        self.observes_target = any(s.observes_target for s in sessions)

    def commit(self, ids):
        for session in self.sessions:
            session.commit(ids)

    def lag(self, ids):
        return sum(session.lag(ids) for session in self.sessions)

    def prefill_step(self, max_tokens=None):
        """The parts' own prefills (those opened chunked), one after the other: a chunk goes to the first part
        with some left; None feeds every part all of its own."""
        pending = [session for session in self.sessions if not session.prefill_step(0)]
        for session in pending if max_tokens is None else pending[:1]:
            session.prefill_step(max_tokens)
        return all(session.prefill_step(0) for session in self.sessions)

    def observe(self, ids, target_probs):
        for session in self.sessions:
            if session.observes_target:
                session.observe(ids, target_probs)

    def finish(self):
        for session in self.sessions:
            session.finish()
