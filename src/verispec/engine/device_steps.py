"""Greedy decoding and prompt-lookup speculation with the whole step on the device (issue #32).

On a GPU each forward already replays as one CUDA graph (`models/cuda_graphs.py`), yet the host still
drafts, verifies, commits and reads back every step while the GPU waits: a fifth to a third of a step on an
H200 (BENCHMARKS.md, "GPU"). Here a step is device work on static buffers, and nothing of it comes back to
the host:

    drafts = lookup_on_device(ids, length, γ, K)               K distinct continuations of the suffix's matches
    logits = forward(cache, [ids[length−1]] + drafts, start = length − 1)         [1+Kγ, vocab]
    target = argmax(logits)                                     the target's token after each node
    a      = the most drafts one branch keeps (equal to `target` up to its first miss); the first such branch wins
    ids[length : length+γ+1] = target along that branch;  its keys and values moved after the root;  length += a + 1

With K = 1 (`ngram`) the draft is a chain; with `ngram:nodes=N` a token tree of K = N // γ branches that share only
the root (the host merges a tree's branches where they agree: `NgramDrafter.tree`; here a branch is a fixed
[γ] slice, so that the layout, positions and mask are the same every step). A step is captured once per γ, K
and cache storage and replayed up to `STEPS_PER_SYNC` times in a row; then one copy brings back what those steps
emitted, and the host emits it as `Generation.commit` would (EOS, stop strings, the length limit, statistics, the
γ policy). Greedy output is the target's argmax chain whatever is drafted, so it is plain decoding's, token for
token; what a step writes past its accepted tokens (the other branches' keys and values, the target's tokens
after a miss) lies past the valid length, where the next step writes again. Steps replayed after an EOS are
thrown away (at most STEPS_PER_SYNC − 1). A step whose suffix matched nothing still feeds γ tokens (a fixed shape),
but keeps none of them and counts as a step without a draft, as on the host, so that α and the γ policy see what
prompt lookup proposed.

Taken where a step is that simple (`DeviceSteps.of`): a runner that replays its steps (`Runner.step_graphs`),
greedy decoding without penalties, logit bias, grammar, `min_tokens` or log-probabilities, and no drafter or
prompt lookup by the latest match (`ngram`, `ngram:nodes=N`). Everything else, and a step too near the end of the
context for a run of replays, takes `Generation.step`'s general path (the two share the request's state between
runs); VERISPEC_DEVICE_STEPS=0 turns this off. On a CPU the same code runs eagerly (the tests).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from verispec.drafters.ngram import NgramDrafter, lookup_on_device
from verispec.models.cuda_graphs import MAX_CHAIN, MAX_WIDTH
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
    drafted: torch.Tensor  # [STEPS_PER_SYNC] long: 1 where the step's lookup matched (else it drafted a mere guess)
    count: torch.Tensor  # [1] long: steps since the host last read
    cache: object = None  # the cache whose storage this is (the request's, set before each run)
    holder: object = None  # the DeviceSteps whose sequence `ids` holds up to `synced` (else it is loaded again)
    synced: int = 0
    replays: dict[tuple[int, int], object] = field(default_factory=dict)  # (γ, branches) -> its captured step


@dataclass
class _Tree:
    """Where K branches of γ drafts lie in a step's feed [1+Kγ]: the root (the last committed token), then each
    branch's γ nodes in a row (K = 1: a chain, its mask causal). The same every step for one (γ, K), so a captured
    step reads it as constants."""

    offsets: torch.Tensor  # [1+Kγ] long: each node's position after the root's (a node's depth)
    mask: torch.Tensor  # [1+Kγ, 1+Kγ] bool: what each node attends among the step's (the root, its own branch so far)
    parents: torch.Tensor  # [K, γ] long: the feed index of the node each draft follows (the target's token there is checked)
    paths: torch.Tensor  # [K, γ+1] long: the root, then a branch's nodes (the target's tokens there are what it emits)

    @classmethod
    def of(cls, gamma: int, branches: int, device: torch.device) -> _Tree:
        depth = torch.arange(gamma, device=device)  # [γ]
        nodes = 1 + torch.arange(branches, device=device)[:, None] * gamma + depth  # [K, γ]: feed index of each node
        root = torch.zeros(1, dtype=torch.long, device=device)  # [1]
        branch = torch.cat([root - 1, torch.arange(branches, device=device).repeat_interleave(gamma)])  # [1+Kγ]: the root's −1
        offsets = torch.cat([root, (depth + 1).repeat(branches)])  # [1+Kγ]
        same_branch = (branch[:, None] == branch[None, :]) & (offsets[None, :] <= offsets[:, None])  # [1+Kγ, 1+Kγ]
        mask = same_branch | (branch[None, :] == -1)  # every node sees the root
        roots = root.expand(branches, 1)  # [K, 1]
        parents = torch.cat([roots, nodes[:, :-1]], dim=1)  # [K, γ]
        paths = torch.cat([roots, nodes], dim=1)  # [K, γ+1]
        return cls(offsets, mask, parents, paths)


def branches_for(nodes: int, gamma: int) -> int:
    """The branches a step of depth γ ≥ 1 drafts: 1 for a chain (`nodes` 0), else as many whole branches of γ as
    `nodes` holds (at least one), and no more than a captured forward's MAX_WIDTH positions take."""
    return 1 if not nodes else max(1, min(nodes, MAX_WIDTH - 1) // gamma)


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
        lookup = drafter is None or (isinstance(drafter, NgramDrafter) and not drafter.oldest)
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
        branches = branches_for(self.drafter.nodes, gamma) if gamma else 1
        start = time.perf_counter()
        cache = generation.cache
        # one storage for the whole run (its graphs are bound to it): the last step's tree may reach (K−1)γ past its chain
        cache.ensure(length - 1 + steps * (gamma + 1) + (branches - 1) * gamma)
        buffers = self._buffers(cache)
        replay = self._replay(buffers, gamma, branches)
        for _ in range(steps):
            replay()
        # one read: the new length, the steps run, each step's accepted drafts and whether it drafted, the tokens written
        read = torch.cat([buffers.length, buffers.count, buffers.accepted, buffers.drafted,
                          buffers.ids[length : length + steps * (gamma + 1)]]).tolist()
        new_length, ran = read[0], read[1]
        accepted, drafted = read[2 : 2 + ran], read[2 + STEPS_PER_SYNC : 2 + STEPS_PER_SYNC + ran]
        tokens = read[2 + 2 * STEPS_PER_SYNC :][: new_length - length]
        buffers.synced = new_length
        return self._emit(tokens, accepted, drafted, gamma, branches, (time.perf_counter() - start) / ran)

    def _buffers(self, cache) -> _Buffers:
        """The static buffers of `cache`'s storage, holding this request's sequence, its length set and its
        step count at 0."""
        key = ("device steps", cache.keys.data_ptr(), cache.values.data_ptr(), cache.capacity)
        buffers = self.graphs.steps.get(key)
        device = cache.keys.device
        if buffers is None:
            zeros = lambda n: torch.zeros(n, dtype=torch.long, device=device)  # noqa: E731
            buffers = self.graphs.steps[key] = _Buffers(zeros(cache.capacity + MAX_CHAIN), zeros(1), zeros(STEPS_PER_SYNC), zeros(STEPS_PER_SYNC), zeros(1))
        ids = self.generation.ids
        if buffers.holder is not self or buffers.synced != len(ids):  # another request's, or steps taken on the host
            buffers.ids[: len(ids)].copy_(torch.tensor(ids), non_blocking=True)
            buffers.holder, buffers.synced = self, len(ids)
        buffers.length.fill_(len(ids))
        buffers.count.zero_()
        buffers.cache = cache
        return buffers

    def _replay(self, buffers: _Buffers, gamma: int, branches: int):
        """The step of depth γ and `branches` on `buffers`, captured on first use (its warm-up step undone) or,
        where no graph may be captured, run eagerly."""
        replay = buffers.replays.get((gamma, branches))
        if replay is None:
            tree = _Tree.of(gamma, branches, buffers.ids.device) if gamma else None
            run = lambda: self._step(buffers, tree)  # noqa: E731
            before = buffers.length.clone(), buffers.count.clone()
            replay = buffers.replays[gamma, branches] = self.graphs.replayed(run) or run
            buffers.length.copy_(before[0])  # a capture's warm-up ran one step: its writes lie past the sequence
            buffers.count.copy_(before[1])
        return replay

    @torch.inference_mode()  # the cache's storage holds inference tensors (a tree's step moves keys and values)
    def _step(self, buffers: _Buffers, tree: _Tree | None) -> None:
        """One step, device work only (see the module docstring): plain decoding (`tree` None) or K ≥ 1 branches of γ
        drafts (one branch: a chain)."""
        ids, length, cache = buffers.ids, buffers.length, buffers.cache
        last = length - 1  # [1]: the last committed token, fed first; the cache holds the tokens before it
        if tree is None:
            target = argmax(self.graphs.forward_at(cache, ids[last], last))  # [1]
            accepted = matched = torch.zeros_like(length)  # [1]
        else:
            branches, gamma = tree.parents.shape
            drafts, matched = lookup_on_device(ids, length, gamma, self.drafter.max_n, self.drafter.min_n, branches)  # [K, γ]
            feed = torch.cat([ids[last], drafts.flatten()])  # [1+Kγ]
            logits = self.graphs.forward_at(cache, feed, last, last + tree.offsets, tree.mask)  # [1+Kγ, vocab]
            judged = argmax(logits)  # [1+Kγ]: the target's token after each node
            kept = (drafts == judged[tree.parents]).long().cumprod(1).sum(1)  # [K]: drafts each branch keeps
            best = kept.argmax(0, keepdim=True)  # [1]: the first branch that keeps the most
            accepted, target = kept[best], judged[tree.paths[best][0]]  # [1], [γ+1]: the target's tokens along it
            if branches > 1:  # the kept branch's keys and values go right after the root (branch 0's are there already)
                slots = last + 1 + torch.arange(gamma, device=ids.device)  # [γ]
                for storage in (cache.keys, cache.values):  # [layers, kv_heads, capacity, head_dim]
                    storage.index_copy_(2, slots, storage.index_select(2, slots + best * gamma))
        drafted = (matched > 0).long()  # [1]: a step without a match drafted a guess, which counts as no draft
        accepted = accepted * drafted  # its lucky tokens are not taken (fewer accepted is still the target's chain)
        ids.index_copy_(0, length + torch.arange(len(target), device=ids.device), target)
        buffers.accepted.index_copy_(0, buffers.count, accepted)
        buffers.drafted.index_copy_(0, buffers.count, drafted)
        buffers.count.add_(1)
        length.add_(accepted + 1)

    def _emit(self, tokens: list[int], accepted: list[int], drafted: list[int], gamma: int, branches: int,
              seconds: float) -> list[TokenEvent]:
        """Commit the steps that accepted `accepted` drafts each (of γ where `drafted`, else of none) and emitted
        `tokens` between them, one step at a time as `Generation.commit` does (the sequence, the cache's length,
        statistics, the γ policy, the events), up to the step that ends the request."""
        generation, events = self.generation, []
        generation.stats.add_phase("device steps", seconds * len(accepted))
        for taken, matched in zip(accepted, drafted):
            emitted, tokens = tokens[: taken + 1], tokens[taken + 1 :]
            generation.ids.extend(emitted)
            generation.cache.length = len(generation.ids) - 1  # the step wrote the slots of all but its last token
            if generation.session is not None:
                generation.session.commit(generation.ids)
            proposed = gamma if matched else 0
            nodes = branches * proposed if branches > 1 else None  # a tree's
            generation.stats.record(StepRecord(proposed, taken, 0.0, seconds, width=nodes, free=proposed > 0))
            generation.policy.update(proposed, taken, len(generation.ids), nodes=nodes)
            last = Origin.TARGET if proposed == 0 else Origin.BONUS if taken == proposed else Origin.RECOVERED
            events += generation._emit(emitted, [Origin.ACCEPTED] * taken + [last])
            if generation.done:
                break
        return events
