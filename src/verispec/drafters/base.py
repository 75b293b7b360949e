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
after each commit with the target's distributions at the newly committed positions. `finish()`
tells a session its request is over. `start_chunked` opens a session whose own prefill (a draft
model's) is fed later, a chunk per `prefill_step`; by default it is `start`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from verispec.models.loading import LoadedModel
from verispec.models.runner import Cache
from verispec.sampling.processors import SamplingParams
from verispec.types import Draft

__all__ = ["Drafter", "DraftSession"]


class DraftSession(ABC):
    @abstractmethod
    def propose(
        self, ids: list[int], gamma: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        """Up to `gamma` tokens that may follow `ids` (fewer, even none, is allowed)."""

    observes_target: bool = False

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


class Drafter(ABC):
    name: str = "drafter"
    model: LoadedModel | None = None  # the draft model whose forward passes are the drafting cost (None: model-free, c = 0)

    @abstractmethod
    def start(self, prompt_ids: list[int]) -> DraftSession:
        """Open the per-request state for a prompt."""

    def start_chunked(self, prompt_ids: list[int]) -> DraftSession:
        """A session whose own prefill the caller feeds a chunk at a time with `session.prefill_step`
        (a server interleaving long prompts with other requests' steps). Default: `start`, whole."""
        return self.start(prompt_ids)
