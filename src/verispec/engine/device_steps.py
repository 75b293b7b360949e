"""Greedy decoding and prompt-lookup speculation with the whole step on the device (issue #32).

On a GPU each forward already replays as one CUDA graph (`models/cuda_graphs.py`), yet the host still
drafts, verifies, commits and reads back every step while the GPU waits: a fifth to a third of a step on an
H200 (BENCHMARKS.md, "GPU"). Here a step is device work on static buffers, and nothing of it comes back to
the host:

    draft  = lookup_on_device(ids, length, γ)                  the γ tokens after the suffix's latest match
    logits = forward_at(cache, [ids[length−1]] + draft, start = length − 1)           [γ+1, vocab]
    target = argmax(logits)                                     the target's token after each prefix
    a      = how many drafts equal `target`, up to the first that does not
    ids[length : length+γ+1] = target;  length += a + 1

It is captured once per γ and cache storage and replayed up to `STEPS_PER_SYNC` times in a row; then one
copy brings back what those steps emitted, and the host emits it as `Generation.commit` would (EOS, stop
strings, the length limit, statistics, the γ policy). Greedy output is the target's argmax chain whatever is
drafted, so it is plain decoding's, token for token; what a step writes past its accepted tokens (the
rejected drafts' keys and values, the target's tokens after them) lies past the valid length, where the next
step writes again. Steps replayed after an EOS are thrown away (at most STEPS_PER_SYNC − 1).

Taken where a step is that simple (`DeviceSteps.of`): a runner that replays its steps (`Runner.step_graphs`),
greedy decoding without penalties, logit bias, grammar, `min_tokens` or log-probabilities, and no drafter or
a prompt-lookup chain (`ngram`). Everything else, and a step too near the end of the context for a run of
replays, takes `Generation.step`'s general path (the two share the request's state between runs);
VERISPEC_DEVICE_STEPS=0 turns this off. On a CPU the same code runs eagerly (the tests).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from verispec.drafters.ngram import NgramDrafter, lookup_on_device
from verispec.models.cuda_graphs import MAX_CHAIN
from verispec.sampling.samplers import argmax
from verispec.types import Origin, StepRecord, TokenEvent

__all__ = ["DeviceSteps", "STEPS_PER_SYNC"]

STEPS_PER_SYNC = 8  # steps replayed before the host reads back what they emitted


@dataclass
class _Buffers:
    """The static tensors a storage's captured steps read and write (one set per cache storage)."""

    ids: torch.Tensor  # [capacity + MAX_CHAIN] long: the sequence, then what the last steps wrote past it
    length: torch.Tensor  # [1] long: the sequence's length
    accepted: torch.Tensor  # [STEPS_PER_SYNC] long: each step's accepted drafts since the host last read
    count: torch.Tensor  # [1] long: steps since the host last read
    cache: object = None  # the cache whose storage this is (the request's, set before each run)
    holder: object = None  # the DeviceSteps whose sequence `ids` holds up to `synced` (else it is loaded again)
    synced: int = 0
    replays: dict[int, object] = field(default_factory=dict)  # γ -> its captured step


class DeviceSteps:
    """One request's steps on the device: `run()` replays a run of them and emits what they made."""

    def __init__(self, generation, graphs, drafter: NgramDrafter | None):
        self.generation, self.graphs, self.drafter = generation, graphs, drafter

    @classmethod
    def of(cls, generation) -> DeviceSteps | None:
        """The device steps of `generation` (a `Generation` whose prompt is in), or None where its steps must go
        through the host (see the module docstring)."""
        graphs, drafter, config = generation.target.runner.step_graphs, generation.drafter, generation.config
        simple = (generation.params.greedy and not generation.params.penalised and not generation.params.logit_bias
                  and generation.constraint is None and config.logprobs is None and config.min_tokens == 0)
        lookup = drafter is None or (isinstance(drafter, NgramDrafter) and not drafter.nodes and not drafter.oldest)
        if graphs is None or not simple or not lookup or os.environ.get("VERISPEC_DEVICE_STEPS", "1") == "0":
            return None
        return cls(generation, graphs, drafter)

    def run(self) -> list[TokenEvent] | None:
        """Replay up to STEPS_PER_SYNC steps, then emit their tokens; None (nothing done) where the context has no
        room for a run or the cache's storage is not the pool's: the caller takes the general path."""
        generation = self.generation
        length, remaining = len(generation.ids), generation.max_new - len(generation.output_ids)
        widest = 1 if self.drafter is None else min(generation.engine.max_gamma, MAX_CHAIN - 1) + 1
        steps = min(STEPS_PER_SYNC, remaining, (generation.target.context_length - length) // widest)
        if steps < 1 or not self.graphs.replays_on(generation.cache):
            return None
        gamma = 0 if self.drafter is None else max(0, min(generation.policy.next_gamma(), remaining - 1, widest - 1))
        start = time.perf_counter()
        cache = generation.cache
        cache.ensure(length - 1 + steps * (gamma + 1))  # one storage for the whole run (its graphs are bound to it)
        buffers = self._buffers(cache)
        replay = self._replay(buffers, gamma)
        for _ in range(steps):
            replay()
        # one read: the new length, the steps run, each step's accepted drafts, the tokens written
        read = torch.cat([buffers.length, buffers.count, buffers.accepted, buffers.ids[length : length + steps * (gamma + 1)]]).tolist()
        new_length, ran, accepted = read[0], read[1], read[2 : 2 + read[1]]
        tokens = read[2 + STEPS_PER_SYNC :][: new_length - length]
        buffers.synced = new_length
        return self._emit(tokens, accepted, gamma, (time.perf_counter() - start) / ran)

    def _buffers(self, cache) -> _Buffers:
        """The static buffers of `cache`'s storage, holding this request's sequence, its length set and its
        step count at 0."""
        key = ("device steps", cache.keys.data_ptr(), cache.values.data_ptr(), cache.capacity)
        buffers = self.graphs.steps.get(key)
        device = cache.keys.device
        if buffers is None:
            zeros = lambda n: torch.zeros(n, dtype=torch.long, device=device)  # noqa: E731
            buffers = self.graphs.steps[key] = _Buffers(zeros(cache.capacity + MAX_CHAIN), zeros(1), zeros(STEPS_PER_SYNC), zeros(1))
        ids = self.generation.ids
        if buffers.holder is not self or buffers.synced != len(ids):  # another request's, or steps taken on the host
            buffers.ids[: len(ids)].copy_(torch.tensor(ids), non_blocking=True)
            buffers.holder, buffers.synced = self, len(ids)
        buffers.length.fill_(len(ids))
        buffers.count.zero_()
        buffers.cache = cache
        return buffers

    def _replay(self, buffers: _Buffers, gamma: int):
        """The step of width γ+1 on `buffers`, captured on first use (its warm-up step undone) or, where no graph
        may be captured, run eagerly."""
        replay = buffers.replays.get(gamma)
        if replay is None:
            run = lambda: self._step(buffers, gamma)  # noqa: E731
            before = buffers.length.clone(), buffers.count.clone()
            replay = buffers.replays[gamma] = self.graphs.replayed(run) or run
            buffers.length.copy_(before[0])  # a capture's warm-up ran one step: its writes lie past the sequence
            buffers.count.copy_(before[1])
        return replay

    def _step(self, buffers: _Buffers, gamma: int) -> None:
        """One step of width γ+1, device work only (see the module docstring)."""
        ids, length = buffers.ids, buffers.length
        last = length - 1  # [1]: the last committed token, fed first; the cache holds the tokens before it
        if gamma:
            draft, _ = lookup_on_device(ids, length, gamma, self.drafter.max_n, self.drafter.min_n)  # [γ]
            feed = torch.cat([ids[last], draft])  # [γ+1]
        else:
            feed = ids[last]  # [1]
        target = argmax(self.graphs.forward_at(buffers.cache, feed, last))  # [γ+1]: the target's token after each prefix
        accepted = (draft == target[:-1]).long().cumprod(0).sum(0, keepdim=True) if gamma else torch.zeros_like(length)  # [1]
        ids.index_copy_(0, length + torch.arange(gamma + 1, device=ids.device), target)
        buffers.accepted.index_copy_(0, buffers.count, accepted)
        buffers.count.add_(1)
        length.add_(accepted + 1)

    def _emit(self, tokens: list[int], accepted: list[int], gamma: int, seconds: float) -> list[TokenEvent]:
        """Commit the steps that accepted `accepted` drafts each and emitted `tokens` between them, one step at a
        time as `Generation.commit` does (the sequence, the cache's length, statistics, the γ policy, the events),
        up to the step that ends the request."""
        generation, events = self.generation, []
        generation.stats.add_phase("device steps", seconds * len(accepted))
        for taken in accepted:
            emitted, tokens = tokens[: taken + 1], tokens[taken + 1 :]
            generation.ids.extend(emitted)
            generation.cache.length = len(generation.ids) - 1  # the step wrote the slots of all but its last token
            if generation.session is not None:
                generation.session.commit(generation.ids)
            generation.stats.record(StepRecord(gamma, taken, 0.0, seconds, free=gamma > 0))
            generation.policy.update(gamma, taken, len(generation.ids))
            last = Origin.TARGET if gamma == 0 else Origin.BONUS if taken == gamma else Origin.RECOVERED
            events += generation._emit(emitted, [Origin.ACCEPTED] * taken + [last])
            if generation.done:
                break
        return events
