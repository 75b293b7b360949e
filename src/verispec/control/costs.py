"""Measured costs that the analytic γ policy needs: T(n)/T(1) of the target and c of the drafter.

Both are measured once per (model folder and variant, dtype, threads, CPU kind, whether the C++
decoder stack runs) and kept in the cache directory: the target's verification curve T(n) (seconds for a forward
over n new positions; far from flat on a CPU in some dtypes) and the draft model's seconds per
token. The curve is measured after `SHORT_CONTEXT` cached tokens and again after `LONG_CONTEXT`: each
new position attends the whole context, so verifying n positions costs more, relative to one, as the
context grows (kquant's T(5)/T(1): 1.22 after 64 tokens, 1.64 after 700); `verify_cost` interpolates
the ratio linearly in the context a step attends. To keep a first run short, a runner with its own
static cache is timed after placeholder slots (`Runner.placeholder_cache`) rather than a real prefill of
that context, a curve stops at the width the runner verifies exactly, and a plan comparing backends times
the long context only for the one it keeps (`calibrated(long=)`). A curve is read fitted non-decreasing
(`monotone_curve`): a dip in it is the machine's noise, not a cheaper width. They are not re-measured during a
generation on purpose: γ then depends only on acceptance (and the context), so a seed reproduces an
output exactly. A model-free drafter (n-gram) counts as free (c = 0). Requests stepped together share one pass of
all their positions (`control/batch.py`): what a row adds and T(n) at wider passes are measured the first time a
batch is priced (`measure_batch_costs`, a few seconds once per machine), then kept with the rest.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from verispec.models.device import device_tag, synchronize
from verispec.models.kernels import build_key
from verispec.models.runner import Cache, LoadedModel, Runner
from verispec.paths import cpu_key, read_table, store_in_table
from verispec.progress import status
from verispec.types import StepRecord

__all__ = ["BATCH_ROWS", "BATCH_WIDTHS", "CostModel", "LONG_CONTEXT", "SHORT_CONTEXT", "interleaved_token_seconds",
           "measure_batch_costs", "measure_riding", "measure_verify_curve", "monotone_curve", "prefill_seconds_per_token",
           "riding_seconds"]

COSTS_TABLE = "verify_costs.json"  # measured seconds, per runner key (`_runner_key`), in the cache directory
SHORT_CONTEXT, LONG_CONTEXT = 64, 1024  # cached tokens before the two measured verification curves
# a batch's pass (`pass_cost`): what a row adds, timed with BATCH_ROWS rows, and T(n) at these widths past the curve
BATCH_ROWS, BATCH_WIDTHS = 8, (16, 17, 24, 32, 48, 64)


def _best_seconds(runner: Runner, cache, positions: int, logits: str, repeats: int) -> float:
    """The fastest of `repeats` forwards over `positions` new positions, each rolled back after."""
    kept, best = cache.length, float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        runner.forward(cache, torch.zeros(positions, dtype=torch.long), logits=logits)
        synchronize(runner.device)  # a GPU's forward returns before it is done
        best = min(best, time.perf_counter() - start)
        cache.truncate(kept)
    return best


def _context_cache(runner: Runner, context: int, room: int) -> Cache:
    """A cache holding `context` positions to time forwards after, with `room` more: placeholder slots where the
    runner has them, else a prefill (a backend that must be fed the context it is timed after)."""
    cache = runner.placeholder_cache(context, context + room)
    if cache is None:
        cache = runner.new_cache(context + room)
        runner.forward(cache, torch.zeros(context, dtype=torch.long), logits="none")
    return cache


def _plausible(times: list[float]) -> bool:
    """No forward over more positions took under half the time of one: a curve that breaks this was
    measured while something else held the cores (it is cached, so it must not steer later plans)."""
    return all(t >= 0.5 * times[0] for t in times[1:])


def measure_verify_curve(runner: Runner, max_positions: int, context: int = SHORT_CONTEXT, repeats: int = 3,
                         attempts: int = 3) -> list[float]:
    """Seconds of one forward over n = 1..max_positions new positions after `context` cached tokens.

    Each of `repeats` rounds times every n right after a forward of one position, so each ratio T(n)/T(1) comes
    from a pair timed a tenth of a second apart: a shared CPU's speed drifts over seconds, and a curve of
    separate bests (T(1) from a quiet moment, T(2) from a busy one) once made a plan decode plain where prompt
    lookup paid (BENCHMARKS.md, AVX-512, 2026-11-28). T(n) is the fastest T(1) of all rounds times the median
    ratio of n's pairs; measured again (rounds added) while the curve is implausible."""
    cache = _context_cache(runner, context, max_positions + 1)
    ones: list[float] = []
    ratios: list[list[float]] = [[] for _ in range(max_positions)]
    times: list[float] = []
    for _ in range(attempts):
        for _ in range(repeats):
            for n in range(1, max_positions + 1):
                one = _best_seconds(runner, cache, 1, "all", 1)
                ones.append(one)
                ratios[n - 1].append(_best_seconds(runner, cache, n, "all", 1) / one if n > 1 else 1.0)
        times = [min(ones) * statistics.median(pairs) for pairs in ratios]
        if _plausible(times):
            break
    cache.release()
    return times


def measure_batch_costs(runner: Runner, rows: int = BATCH_ROWS, widths: Sequence[int] = BATCH_WIDTHS,
                        context: int = SHORT_CONTEXT, repeats: int = 3) -> list[float]:
    """[ρ, T(w)/T(1) for each of `widths`] after `context` cached tokens: ρ what a row more adds to one pass, in T(1)
    (`rows` rows of one position in one `forward_ragged` against one row of `rows` positions: each row attends its
    own cache), and one row's pass at widths past the verification curve (AMX's tiles of 16 rows make it a staircase).
    Each ratio is the median of `repeats` pairs timed together, as in `measure_verify_curve`."""
    cache = _context_cache(runner, context, max(widths) + 1)
    caches = [_context_cache(runner, context, 2) for _ in range(rows)]
    ratios: list[list[float]] = [[] for _ in range(len(widths) + 1)]
    for _ in range(repeats):
        start = time.perf_counter()
        runner.forward_ragged(caches, [torch.zeros(1, dtype=torch.long)] * rows, logits="all")
        synchronize(runner.device)
        ragged = time.perf_counter() - start
        for row in caches:
            row.truncate(context)
        one, chain = _best_seconds(runner, cache, 1, "all", 1), _best_seconds(runner, cache, rows, "all", 1)
        ratios[0].append(max(ragged - chain, 0.0) / (rows - 1) / one)
        for i, width in enumerate(widths, 1):
            one = _best_seconds(runner, cache, 1, "all", 1)
            ratios[i].append(_best_seconds(runner, cache, width, "all", 1) / one)
    for held in [cache, *caches]:
        held.release()
    return [statistics.median(pairs) for pairs in ratios]


def interleaved_token_seconds(runners: Sequence[Runner], rounds: int = 7,
                              context: int = SHORT_CONTEXT) -> list[float]:
    """Each runner's T(1) after `context` cached tokens, timed in turns (runner 1, 2, …, 1, 2, …; each the best of
    its `rounds`), so that the machine's drift touches them alike: what a choice between backends compares. Their
    curves are measured a minute apart, while a shared CPU's speed can move by a fifth, enough to flip the choice."""
    caches = [_context_cache(runner, context, 2) for runner in runners]
    best = [float("inf")] * len(runners)
    for _ in range(rounds):
        for i, (runner, cache) in enumerate(zip(runners, caches)):
            best[i] = min(best[i], _best_seconds(runner, cache, 1, "all", 1))
    for cache in caches:
        cache.release()
    return best


def _cached(key: str, needed: int, measure: Callable[[], list[float]], what: str = "verification costs") -> list[float]:
    """The timings stored under `key` in the cache directory, measured now (with a spinner saying `what`)
    when missing or too short."""
    times = read_table(COSTS_TABLE).get(key)
    if times is None or len(times) < needed:
        with status(f"measuring {what} (once per model, dtype and thread count)"):
            times = measure()
        store_in_table(COSTS_TABLE, key, times)
    return times


def _runner_key(runner: Runner, folder: str) -> str:
    """What a runner's timings depend on: model, variant, device, dtype, the build of its C++ kernels (a changed kernel
    is timed anew: a kquant runner's variant names its build, as its prompt caches need; int8's is added here),
    threads and CPU kind."""
    variant = runner.variant + device_tag(runner.device)  # a derived draft (fewer layers, int8, …) is timed on its own
    if runner.compiled:  # the C++ decoder stack changes the curve: timed apart
        variant += ",compiled"
    built = f"|kernels={build_key('int8')}" if runner.precision == "int8" else ""
    return f"{folder}{variant}|{runner.dtype}{built}|threads={torch.get_num_threads()}|cpu={cpu_key()}"


def _cached_curve(runner: Runner, folder: str, max_positions: int, context: int = SHORT_CONTEXT) -> list[float]:
    """T(1…max_positions) as measured (cached), fitted non-decreasing (`monotone_curve`)."""
    # "paired": measured by `measure_verify_curve`'s pairs (a curve of separate bests, stored before, is measured again)
    key = _runner_key(runner, folder) + "|paired" + ("" if context == SHORT_CONTEXT else f"|context={context}")
    what = f"{Path(folder).name} on {runner.precision}: T(1…{max_positions}) after {context} tokens"  # the spinner's
    return monotone_curve(_cached(key, max_positions, lambda: measure_verify_curve(runner, max_positions, context), what))


def monotone_curve(times: Sequence[float]) -> list[float]:
    """The non-decreasing curve nearest `times` in least squares (pool adjacent violators), never below T(1).

    A forward over more positions does no less work, so a measured dip (T(6) below T(4)) is noise; read as it is,
    it prices γ 5 below γ 3 and steers the γ policy into the dip. T(1), the best of many forwards, is kept as
    measured: the points after it are pooled, then held at least at T(1)."""
    blocks: list[tuple[float, int]] = []  # (sum, count) of each pooled run of points, their means ascending
    for total, count in ((t, 1) for t in times[1:]):
        while blocks and blocks[-1][0] / blocks[-1][1] > total / count:
            earlier, n = blocks.pop()
            total, count = total + earlier, count + n
        blocks.append((total, count))
    return list(times[:1]) + [max(total / count, times[0]) for total, count in blocks for _ in range(count)]


def _cached_cost_ratio(target: LoadedModel, draft: LoadedModel) -> float:
    """c = T_d(1) / T(1), the draft's and the target's single-token forwards timed in turns
    (`interleaved_token_seconds`): from two curves measured a minute apart it moved by a third on a shared CPU
    (0.10–0.16 for SmolLM2 beside the 1.5B), enough to flip a plan between two drafters predicted a few per cent
    apart."""
    key = f"c|{_runner_key(draft.runner, str(draft.folder))}|over|{_runner_key(target.runner, str(target.folder))}"

    def measure() -> list[float]:
        target_seconds, draft_seconds = interleaved_token_seconds([target.runner, draft.runner])
        return [draft_seconds / target_seconds]
    return _cached(key, 1, measure, f"{Path(str(draft.folder)).name} against {Path(str(target.folder)).name}, in turns")[0]


def measure_prefill(runner: Runner, chunk: int, repeats: int = 2) -> float:
    """Seconds of one prefill forward over `chunk` prompt tokens after `chunk` cached ones (best of `repeats`)."""
    cache = _context_cache(runner, chunk, chunk + 1)
    seconds = _best_seconds(runner, cache, chunk, "none", repeats)
    cache.release()
    return seconds


def prefill_seconds_per_token(model: LoadedModel, chunk: int = 64) -> float:
    """The target's prefill time per prompt token in chunks of `chunk`, from the cache or measured now."""
    key = f"prefill{chunk}|{_runner_key(model.runner, str(model.folder))}"
    return _cached(key, 1, lambda: [measure_prefill(model.runner, chunk) / chunk], "prefill speed")[0]


def measure_riding(runner: Runner, chunk: int, repeats: int = 3) -> float:
    """Seconds a prompt chunk of `chunk` tokens adds to a pass of one decoding row when it rides in it (the server's
    `Turn.mixed`): the pass with the chunk less the pass without, both after `chunk` cached positions, in turns, the
    fastest of `repeats` each."""
    caches = [_context_cache(runner, chunk, chunk + 1) for _ in range(2)]
    feeds = [torch.zeros(1, dtype=torch.long), torch.zeros(chunk, dtype=torch.long)]
    best = [float("inf"), float("inf")]  # [the row alone, the row and the chunk]
    for _ in range(repeats):
        for rows in (1, 2):
            start = time.perf_counter()
            runner.forward_ragged(caches[:rows], feeds[:rows], logits=["all", "none"][:rows])
            synchronize(runner.device)
            best[rows - 1] = min(best[rows - 1], time.perf_counter() - start)
            for cache in caches:
                cache.truncate(chunk)
    for cache in caches:
        cache.release()
    return max(best[1] - best[0], 0.0)


def riding_seconds(model: LoadedModel, chunk: int) -> float:
    """What a `chunk`-token prompt chunk adds to the pass it rides in (`measure_riding`), from the cache or measured now."""
    key = f"riding{chunk}|{_runner_key(model.runner, str(model.folder))}"
    return _cached(key, 1, lambda: [measure_riding(model.runner, chunk)], "what a prompt chunk adds to a step")[0]


def _in_context(short: float, long: float, context: int) -> float:
    """A cost measured after SHORT_CONTEXT (`short`) and LONG_CONTEXT (`long`) cached tokens, after `context`: linear
    between the two and beyond the long one (an attention's cost grows linearly with the context), `short` before."""
    return short + (long - short) / (LONG_CONTEXT - SHORT_CONTEXT) * (max(context, SHORT_CONTEXT) - SHORT_CONTEXT)


class CostModel:
    def __init__(self, target_seconds: list[float] | None = None, draft_token_seconds: float | None = None,
                 draft_catch_up: float = 1.0, long_target_seconds: list[float] | None = None,
                 batch: Callable[[], list[float]] | None = None):
        self.target_seconds = target_seconds  # index n-1 -> T(n) after SHORT_CONTEXT cached tokens
        self.long_target_seconds = long_target_seconds  # the same after LONG_CONTEXT (None: unmeasured)
        # `measure_batch_costs`' [ρ, T(w)/T(1) at BATCH_WIDTHS], measured (or read) the first time a batch is priced
        self._batch, self._batch_costs = batch, None
        self.draft_token_seconds = draft_token_seconds
        self.draft_catch_up = draft_catch_up  # the draft model's T_d(2)/T_d(1) (`theory.draft_step_cost`); 1 model-free

    @classmethod
    def calibrated(cls, target: LoadedModel, max_positions: int, draft: LoadedModel | None = None,
                   long: bool = True) -> CostModel:
        """T(n) of the target for n up to `max_positions` (no wider than the runner verifies exactly), the draft
        model's seconds per token (its c, timed in turns with the target: `_cached_cost_ratio`, times the curve's
        T(1)) and its T_d(2)/T_d(1), from the cache or measured now; a model-free drafter costs 0. `long`: the
        curve after LONG_CONTEXT tokens too, which only the γ policy reads inside a request (a plan compares
        backends on the short curve, so one it does not keep is never timed there)."""
        max_positions = min(max_positions, target.runner.exact_positions or max_positions)
        target_seconds = _cached_curve(target.runner, str(target.folder), max_positions)
        long_seconds = None  # after LONG_CONTEXT tokens, where the target holds them
        if long and target.context_length > LONG_CONTEXT + max_positions:
            long_seconds = _cached_curve(target.runner, str(target.folder), max_positions, LONG_CONTEXT)
        batch = lambda: _cached_batch_costs(target.runner, str(target.folder))  # noqa: E731 - only when batches run
        if draft is None:
            return cls(target_seconds, 0.0, long_target_seconds=long_seconds, batch=batch)
        draft_curve = _cached_curve(draft.runner, str(draft.folder), 2)
        c = _cached_cost_ratio(target, draft)
        return cls(target_seconds, c * target_seconds[0], draft_curve[1] / draft_curve[0], long_seconds, batch)

    def verify_cost(self, gamma: int, context: int | None = None) -> float:
        """T(γ+1) / T(1) for a step after `context` cached tokens (None: SHORT_CONTEXT): between the two
        measured curves the ratio is interpolated linearly in the context, beyond LONG_CONTEXT extrapolated
        (an attention's cost grows linearly with it); 1 (free verification) when unmeasured."""
        if not self.target_seconds:
            return 1.0
        short = _ratio(self.target_seconds, gamma)
        if context is None or not self.long_target_seconds:
            return short
        return max(1.0, _in_context(short, _ratio(self.long_target_seconds, gamma), context))

    def one_seconds(self, context: int | None = None) -> float | None:
        """T(1) in seconds after `context` cached tokens (None: SHORT_CONTEXT), linear in the context between and beyond
        the two measured curves (as `verify_cost`); None when unmeasured. What a price in T(1)s is in seconds."""
        if not self.target_seconds:
            return None
        short = self.target_seconds[0]
        if context is None or not self.long_target_seconds:
            return short
        return max(short, _in_context(short, self.long_target_seconds[0], context))

    def prepare_batches(self) -> None:
        """Measure (or read) what a batch's pass costs, if not yet: a server does at its start, not in its first step
        taken together. Once: a measurement that fails is not tried again (`pass_cost` extrapolates the curve)."""
        if self._batch is not None:
            measure, self._batch = self._batch, None
            self._batch_costs = measure()

    def pass_cost(self, positions: int, rows: int = 1, context: int | None = None) -> float:
        """T/T(1) of one pass over `positions` positions of `rows` requests (a batch's, `control/batch.py`): the
        curve's ratio (past it, the batch widths' measured ratios, linearly between them and beyond the last), plus ρ
        a row after the first. Without batch costs: past the curve extrapolated from its second half, no ρ."""
        measured = len(self.target_seconds or ())
        if measured < 4:
            return self.verify_cost(positions - 1, context)
        self.prepare_batches()
        end = self.verify_cost(measured - 1, context)
        points = [(measured // 2, self.verify_cost(measured // 2 - 1, context)), (measured, end)]
        row = 0.0
        if self._batch_costs is not None:  # the wide points measured after SHORT_CONTEXT, lifted as the curve's end is
            row = self._batch_costs[0]
            lift = end - self.verify_cost(measured - 1)
            points += [(w, ratio + lift) for w, ratio in zip(BATCH_WIDTHS, self._batch_costs[1:]) if w > measured]
        cost = self.verify_cost(positions - 1, context) if positions <= measured else _along(points, positions)
        return cost + row * (rows - 1)

    def step_prices(self, steps: Sequence[StepRecord], context: int) -> list[tuple[float, float, int]] | None:
        """Each step a generation took (after `context` prompt tokens) as this model prices it: (its drafting, its
        verification, in T(1); the context it verified after). Drafting: draft depth · c (0 for a step proposed by no
        draft model's forward: prompt lookup), a model-drafted step after one that kept its whole draft paying its draft
        model's catching-up forward (`draft_catch_up`, as `theory.draft_step_cost`); verification: T(n)/T(1) at the
        step's context, n the positions it verified (its draft tokens, a tree's nodes, + 1). None without a cost ratio."""
        c = self.draft_cost_ratio()
        if c is None:
            return None
        prices, whole = [], False  # whole: the previous step kept every draft token
        for step in steps:
            width = step.proposed if step.width is None else step.width
            paid = 0.0 if step.free else c
            catching_up = paid * (self.draft_catch_up - 1.0) if whole and step.proposed else 0.0
            prices.append((step.proposed * paid + catching_up, self.verify_cost(width, context), context))
            context += step.accepted + 1
            whole = step.proposed > 0 and step.accepted == step.proposed
        return prices

    def speedup_of_steps(self, steps: Sequence[StepRecord], context: int) -> float | None:
        """The speedup over plain decoding that this model predicts for the steps a generation took (after `context`
        prompt tokens): its tokens over Σ of the steps' prices in T(1) (`step_prices`). What a measured speedup is held
        against: acceptance as it happened, costs as measured. None without a cost ratio."""
        prices = self.step_prices(steps, context)
        if not prices:
            return None
        return sum(step.accepted + 1 for step in steps) / sum(drafting + verification for drafting, verification, _ in prices)

    def priced_seconds(self, steps: Sequence[StepRecord], context: int) -> tuple[float, float] | None:
        """(drafting, verification) seconds this model prices the steps a generation took at (`step_prices`, each
        verification at T(1) after its context): what their measured `draft_seconds` and `target_seconds` are held
        against. None without a cost ratio."""
        prices = self.step_prices(steps, context)
        if not prices:
            return None
        drafting = sum(price[0] for price in prices) * self.one_seconds()
        return drafting, sum(verification * self.one_seconds(at) for _, verification, at in prices)

    def draft_cost_ratio(self) -> float | None:
        """c = seconds per draft token / T(1), or None before both are known."""
        if self.draft_token_seconds is None or not self.target_seconds:
            return None
        return self.draft_token_seconds / self.target_seconds[0]


def _along(points: list[tuple[int, float]], x: int) -> float:
    """The piecewise-linear line through `points` (x ascending) at `x` ≥ the first; past the last, its last piece's slope."""
    for i in range(1, len(points)):
        (x0, y0), (x1, y1) = points[i - 1], points[i]
        if x <= x1 or i == len(points) - 1:
            return y0 + (y1 - y0) / (x1 - x0) * (x - x0)
    return points[-1][1]


def _cached_batch_costs(runner: Runner, folder: str) -> list[float]:
    key = _runner_key(runner, folder) + f"|batch{BATCH_ROWS}|" + ",".join(map(str, BATCH_WIDTHS))
    what = f"{Path(folder).name} on {runner.precision}: a batch's pass, {BATCH_ROWS} rows and {max(BATCH_WIDTHS)} positions"
    return _cached(key, len(BATCH_WIDTHS) + 1, lambda: measure_batch_costs(runner), what)


def _ratio(curve: list[float], gamma: int) -> float:
    """T(γ+1) / T(1) on a measured curve, its last entry standing in for longer verifications."""
    return curve[min(gamma + 1, len(curve)) - 1] / curve[0]
