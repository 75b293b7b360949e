"""Several requests stepped together: their drafts side by side, ONE target pass for all, each its own commit.

What the server's scheduler does each turn for its decoding requests (`serving/http/scheduler.py`), and what
`Engine.generate_batch` does for a list of prompts. On a memory-bound CPU a target pass of k requests' rows costs
little more than one request's (`benchmarks/probes/ragged_pass.py`), so k requests decode nearly k times as fast
together as one after the other. Each request's output is what it gets alone: every runner's `forward_ragged`
computes a row the same whatever else the pass holds, drafts are batched only where that holds too
(`drafters/batching.py`), and each request samples with its own generator. A greedy request may draft fewer tokens
than alone where the shared pass's width costs the batch more than they gain (`control/batch.py`): its tokens are
the same whatever its γ; so may a sampled one without a seed (its output is promised in distribution only, which
no γ changes); a seeded one's γ never moves, since its draws depend on it. A pass is a list of
`Row`s: the server adds a piece of another request's prompt to its decoding requests' verification rows where the
runner keeps every row and every prompt cut exact (`mixes_prompts`).

A step may keep its account (`StepAccount`): its seconds by part beside what the cost model its batch was sized on
priced them at, so that a server shows where a step's time goes and whether its costs still hold on this machine.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from verispec.control.batch import drafting_cost, size_together
from verispec.control.costs import CostModel
from verispec.drafters.batching import draft_together
from verispec.engine.loop import Engine, Generation, GenerationConfig, PromptChunk, Proposal, StepPlan
from verispec.models.runner import Cache, Runner
from verispec.types import GenerationResult, TokenEvent

__all__ = ["Row", "StepAccount", "draft_plans", "forward_rows", "generate_together", "mixes_prompts", "prompt_row", "step_together",
           "verification_row"]


@dataclass
class StepAccount:
    """One step taken together, in seconds: what it took by part, and what the cost model its batch was sized on
    (`control/batch.py`) priced it at: each draft token at its c with a draft model's catching up, the pass at
    T(positions)/T(1) after the rows' mean context. A price stays None where no request's policy measured costs
    (plain decoding). Where measured and priced part, the machine runs other than when its costs were measured, or
    the cost model misses a cost."""

    drafting: float = 0.0  # the requests' proposals and drafts (`draft_plans`)
    target_pass: float = 0.0  # the shared target pass
    total: float = 0.0  # the whole step, commits included
    priced_drafting: float | None = None
    priced_pass: float | None = None
    costs: CostModel | None = None  # what the batch was sized on
    context: int = 0  # the rows' mean context (tokens)
    rows: int = 0  # in the pass, a riding prompt chunk's included
    positions: int = 0

    def passed(self, seconds: float, rows: Sequence[Row]) -> None:
        """The target pass over `rows` took `seconds`: kept beside its price."""
        self.target_pass, self.rows, self.positions = seconds, len(rows), sum(len(row.feed) for row in rows)
        if self.costs is not None:
            self.priced_pass = self.pass_price(self.costs)

    def pass_price(self, costs: CostModel) -> float:
        """Seconds `costs` price this step's pass at."""
        return costs.one_seconds(self.context) * costs.pass_cost(self.positions, self.rows, self.context)


def draft_plans(generations: list[Generation], account: StepAccount | None = None, riding: int = 0) -> list[StepPlan | BaseException]:
    """Each generation's plan (its drafts), side by side, at the γ that serves the batch best (`control/batch.py`:
    a greedy request's γ cut where the shared pass's width costs more than its drafts gain): per generation its plan
    or the exception it raised. `riding`: the positions of a prompt chunk the pass will hold too (a row of its own,
    `prompt_row`), priced with it. `account`: given, it gets the drafting's seconds and price, and what prices the pass."""
    started = time.perf_counter()
    proposals: list[Proposal | BaseException] = []
    for generation in generations:
        try:
            proposals.append(generation.propose())
        except Exception as error:  # noqa: BLE001 - this request's alone
            proposals.append(error)
    ready = [i for i, p in enumerate(proposals) if not isinstance(p, BaseException)]
    outlooks = [proposals[i].outlook for i in ready]
    costs = _costs(generations, ready)
    context = sum(len(generations[i].ids) for i in ready) // max(1, len(ready))
    try:
        sized = size_together(outlooks, _pass_cost(costs, len(ready) + bool(riding), context, riding))
    except Exception as error:  # noqa: BLE001 - pricing the batch (measuring its costs) failed: each at its own γ
        warnings.warn(f"requests stepped together at their own γ: {error}", RuntimeWarning, stacklevel=2)
        sized = [outlook.gamma for outlook in outlooks]
    gammas = dict(zip(ready, sized))
    tasks = [functools.partial(_failed, p) if isinstance(p, BaseException) else functools.partial(g.plan, p, gammas[i])
             for i, (g, p) in enumerate(zip(generations, proposals))]
    plans = draft_together(tasks, [g.batches_drafts and gammas.get(i, 0) > 0 and not _free(proposals[i])
                                   for i, g in enumerate(generations)])
    if account is not None:
        account.drafting, account.costs, account.context = time.perf_counter() - started, costs, context
        if costs is not None:
            account.priced_drafting = costs.one_seconds() * sum(map(drafting_cost, outlooks, sized))
    return plans


def _free(proposal: Proposal) -> bool:
    """Whether the step drafts without a draft model's forward (`Hint.free`: prompt lookup): its plan runs on the
    calling thread, not on one of its own waiting to batch forwards it will not make."""
    return proposal.hint is not None and proposal.hint.free


def _costs(generations: list[Generation], ready: list[int]) -> CostModel | None:
    """The measured costs of the first ready request whose policy measured any; None where none did (plain decoding,
    a constant γ)."""
    return next((c for i in ready if (c := getattr(generations[i].policy, "costs", None)) is not None and c.target_seconds),
                None)


def _pass_cost(costs: CostModel | None, rows: int, context: int, riding: int = 0) -> Callable[[int], float]:
    """T(n)/T(1) of the target pass over the requests' n positions and `riding` more, of `rows` rows after `context`
    tokens (1 unpriced: every γ stays)."""
    if costs is None:
        return lambda positions: 1.0
    return lambda positions: costs.pass_cost(positions + riding, rows, context)


def _failed(error: BaseException) -> StepPlan:
    raise error


class Row(NamedTuple):
    """One request's part of a shared target pass: `feed` [n] after `cache`, scored as `logits` says."""

    cache: Cache
    feed: torch.Tensor  # [n]
    positions: torch.Tensor | None = None  # [n] a token tree's (None: a chain)
    tree_mask: torch.Tensor | None = None  # [n, n]
    logits: str = "all"  # "all" | "last" | "none"


def verification_row(generation: Generation, plan: StepPlan) -> Row:
    """A step's verification: the last committed token and the draft, every position scored."""
    return Row(generation.cache, plan.feed, plan.positions, plan.tree_mask)


def prompt_row(generation: Generation, chunk: PromptChunk) -> Row:
    """A piece of a prompt (`Generation.prompt_chunk`) riding in other requests' pass: at most its last position scored."""
    return Row(generation.cache, chunk.tokens, logits=chunk.logits)


def mixes_prompts(runner: Runner) -> bool:
    """Whether a prompt chunk may share a pass with verification rows and leave every request's output as it is alone:
    the runner computes each row whatever else the pass holds (`batch_invariant`) and a prompt's cache however it is cut
    (`prefix_invariant`). On a memory-bound CPU the chunk then costs the pass little more than its arithmetic
    (`benchmarks/probes/prompt_riding.py`)."""
    return runner.batch_invariant and runner.prefix_invariant


def forward_rows(runner: Runner, rows: list[Row]) -> list[torch.Tensor | None | BaseException]:
    """ONE `forward_ragged` pass over every row: per row its logits ([n, vocab], [1, vocab] or None). If the pass fails,
    each row alone, so that only the faulty request fails (a cache moves only when its forward succeeds)."""
    try:
        return runner.forward_ragged([r.cache for r in rows], [r.feed for r in rows], [r.positions for r in rows],
                                     [r.tree_mask for r in rows], [r.logits for r in rows])
    except Exception:  # noqa: BLE001 - each alone below
        out: list[torch.Tensor | None | BaseException] = []
        for row in rows:
            try:
                out.append(runner.forward(row.cache, row.feed, row.positions, row.tree_mask, logits=row.logits))
            except Exception as error:  # noqa: BLE001
                out.append(error)
        return out


def step_together(generations: list[Generation], account: StepAccount | None = None) -> list[list[TokenEvent] | BaseException]:
    """One step of every generation (each prefilled, not done): draft, verify in one pass, commit. Per generation the
    events it emitted, or the exception that ended its step (the others go on). `account`: given, it is kept."""
    started = time.perf_counter()
    outcomes: list[list[TokenEvent] | BaseException] = list(draft_plans(generations, account))
    ready = [i for i, plan in enumerate(outcomes) if not isinstance(plan, BaseException)]
    if not ready:
        return outcomes
    rows = [verification_row(generations[i], outcomes[i]) for i in ready]
    target_started = time.perf_counter()
    logits_rows = forward_rows(generations[0].target.runner, rows)
    seconds = time.perf_counter() - target_started
    for i, logits in zip(ready, logits_rows):
        if isinstance(logits, BaseException):
            outcomes[i] = logits
            continue
        try:
            outcomes[i] = generations[i].commit(outcomes[i], logits, seconds)
        except Exception as error:  # noqa: BLE001
            outcomes[i] = error
    if account is not None:
        account.passed(seconds, rows)
        account.total = time.perf_counter() - started
    return outcomes


def generate_together(engine: Engine, prompt_ids: list[list[int]], configs: list[GenerationConfig], max_batch: int,
                      on_result: Callable[[int, GenerationResult], None] | None = None) -> list[GenerationResult]:
    """`Engine.generate_batch` after its checks: the requests, up to `max_batch` at once, stepped together until each
    is done (a waiting one starts, prefilled whole, as another finishes); their `GenerationResult`s in order, each
    also given to `on_result(i, result)` as it finishes. The first exception of any request (or of `on_result`) ends
    the call (every request's caches released)."""
    results: list[GenerationResult | None] = [None] * len(prompt_ids)
    waiting, running = deque(range(len(prompt_ids))), {}
    try:
        while waiting or running:
            while waiting and len(running) < max_batch:
                i = waiting.popleft()
                generation = running[i] = Generation(engine, prompt_ids[i], configs[i])  # the target's prefill
                while not generation.prefill_step():  # the draft's own
                    pass
                generation.take_held()  # the first token's events: a result needs none
            live = [i for i, generation in running.items() if not generation.done]
            for outcome in step_together([running[i] for i in live]):
                if isinstance(outcome, BaseException):
                    raise outcome
            for i in [i for i, generation in running.items() if generation.done]:
                results[i] = running.pop(i).result()
                if on_result is not None:
                    on_result(i, results[i])
    finally:
        for generation in running.values():
            generation.close()
    return results
