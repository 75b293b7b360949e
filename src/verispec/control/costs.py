"""Measured costs that the analytic γ policy needs: T(n)/T(1) of the target and c of the drafter.

The target's verification curve T(n) (seconds for a forward over n new positions) is measured once
per (model folder, dtype, threads) and kept in the cache directory, since on a CPU it is far from
flat in some dtypes. The draft cost per token is measured online, as an exponential moving average.
"""

from __future__ import annotations

import json
import time

import torch

from verispec.models.registry import cache_dir
from verispec.models.transformer import Transformer

__all__ = ["CostModel", "measure_verify_curve"]


def measure_verify_curve(runner: Transformer, max_positions: int, context: int = 64, repeats: int = 3) -> list[float]:
    """Seconds of one forward over n = 1..max_positions new positions after `context` cached tokens."""
    cache = runner.new_cache(context + max_positions + 1)
    runner.forward(cache, torch.zeros(context, dtype=torch.long), logits="none")
    times = []
    for n in range(1, max_positions + 1):
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            runner.forward(cache, torch.zeros(n, dtype=torch.long), logits="all")
            best = min(best, time.perf_counter() - start)
            cache.truncate(context)
        times.append(best)
    return times


class CostModel:
    def __init__(self, target_seconds: list[float] | None = None, smoothing: float = 0.2):
        self.target_seconds = target_seconds  # index n-1 -> T(n)
        self.draft_token_seconds: float | None = None
        self.smoothing = smoothing

    @classmethod
    def calibrated(cls, runner: Transformer, folder: str, max_positions: int) -> CostModel:
        """Load the target's T(n) from the cache directory, measuring it first if needed."""
        key = f"{folder}|{runner.dtype}|threads={torch.get_num_threads()}"
        file = cache_dir() / "verify_costs.json"
        table = json.loads(file.read_text()) if file.exists() else {}
        times = table.get(key)
        if times is None or len(times) < max_positions:
            times = measure_verify_curve(runner, max_positions)
            table[key] = times
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_text(json.dumps(table, indent=1))
        return cls(times)

    def verify_cost(self, gamma: int) -> float:
        """T(γ+1) / T(1); 1 (free verification) when unmeasured."""
        if not self.target_seconds:
            return 1.0
        n = min(gamma + 1, len(self.target_seconds))
        return self.target_seconds[n - 1] / self.target_seconds[0]

    def observe_draft(self, seconds: float, tokens: int) -> None:
        if tokens <= 0:
            return
        per_token = seconds / tokens
        if self.draft_token_seconds is None:
            self.draft_token_seconds = per_token
        else:
            self.draft_token_seconds += self.smoothing * (per_token - self.draft_token_seconds)

    def draft_cost_ratio(self) -> float | None:
        """c = seconds per draft token / T(1), or None before both are known."""
        if self.draft_token_seconds is None or not self.target_seconds:
            return None
        return self.draft_token_seconds / self.target_seconds[0]
