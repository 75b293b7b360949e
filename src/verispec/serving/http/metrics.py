"""Server metrics in the Prometheus text format (hand-written: counters, gauges, histograms).

The scheduler's worker thread records steps and finished generations; request handlers record
requests and latencies; `/metrics` renders everything. One lock guards all of it.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from collections.abc import Callable

from verispec.engine.together import StepAccount
from verispec.types import AcceptanceStats

__all__ = ["Metrics", "LATENCY_BUCKETS"]

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
RATE_WINDOW_SECONDS = 10.0
COST_WINDOW_STEPS = 256  # the latest priced steps the cost ratio is taken over
STEP_PARTS = ("drafting", "target_pass", "rest")  # `StepAccount`'s parts; the rest: verification, commits, the loop


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last slot is +Inf
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def render(self, name: str, labels: str = "") -> list[str]:
        lines, cumulative = [], 0
        sep = "," if labels else ""
        for bound, count in zip([*map(str, self.buckets), "+Inf"], self.counts):
            cumulative += count
            lines.append(f'{name}_bucket{{{labels}{sep}le="{bound}"}} {cumulative}')
        suffix = f"{{{labels}}}" if labels else ""
        lines += [f"{name}_sum{suffix} {self.total:.6f}", f"{name}_count{suffix} {self.n}"]
        return lines


class Metrics:
    """Everything `/metrics` reports. Gauges for the queue are read from callbacks at render time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}  # (endpoint, status) -> count
        self.prompt_tokens = self.generated_tokens = 0
        self.cached_prompt_tokens = 0  # prompt positions copied from a cache instead of prefilled
        self.riding_prompt_tokens = 0  # prompt positions prefilled in the decoding requests' pass
        self.acceptance = AcceptanceStats()  # every verified row of every step
        self.finished: dict[str, int] = {}  # finish reason (stop / length / cancelled / timeout / error) -> count
        self.request_latency: dict[str, _Histogram] = {}
        self.time_to_first_token = _Histogram(LATENCY_BUCKETS)
        self.step_seconds = _Histogram(LATENCY_BUCKETS)
        self.batch_rows = _Histogram(BATCH_BUCKETS)
        self.step_parts = dict.fromkeys(STEP_PARTS, 0.0)  # seconds of every step, by part
        # steps the cost model priced: (part, "measured" | "priced") → seconds; the latest ones' parts, priced and measured
        self.priced_parts = {(part, kind): 0.0 for part in STEP_PARTS[:2] for kind in ("measured", "priced")}
        self._recent_priced: deque[tuple[float, float, float, float]] = deque(maxlen=COST_WINDOW_STEPS)
        self._recent_tokens: deque[tuple[float, int]] = deque()
        self.gauges: dict[str, tuple[str, Callable[[], float]]] = {}

    def add_gauge(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        self.gauges[name] = (help_text, read)

    def record_request(self, endpoint: str, status: int, seconds: float | None = None) -> None:
        with self._lock:
            self.requests[(endpoint, status)] = self.requests.get((endpoint, status), 0) + 1
            if seconds is not None:
                self.request_latency.setdefault(endpoint, _Histogram(LATENCY_BUCKETS)).observe(seconds)

    def record_first_token(self, seconds: float) -> None:
        with self._lock:
            self.time_to_first_token.observe(seconds)

    def record_step(self, rows: int, account: StepAccount) -> None:
        """One step of `rows` requests, its seconds by part and, where the cost model priced it, its price."""
        parts = (account.drafting, account.target_pass, account.total - account.drafting - account.target_pass)
        with self._lock:
            self.batch_rows.observe(rows)
            self.step_seconds.observe(account.total)
            for part, seconds in zip(STEP_PARTS, parts):
                self.step_parts[part] += seconds
            if account.priced_drafting is not None and account.priced_pass is not None:
                recent = (account.drafting, account.priced_drafting, account.target_pass, account.priced_pass)
                self._recent_priced.append(recent)
                for key, seconds in zip(self.priced_parts, recent):  # the keys in the same order
                    self.priced_parts[key] += seconds

    def cost_ratios(self) -> dict[str, float]:
        """{part: measured ÷ priced seconds} over the latest COST_WINDOW_STEPS priced steps (a part priced at 0 left out)."""
        with self._lock:
            recent = list(self._recent_priced)
        sums = [sum(column) for column in zip(*recent)] if recent else []
        return {part: sums[2 * i] / sums[2 * i + 1] for i, part in enumerate(STEP_PARTS[:2]) if sums and sums[2 * i + 1] > 0}

    def summary(self) -> str:
        """One line of what the server did, for its stop: requests, tokens, τ and α, the steps' seconds by part, and
        measured over priced where its cost model priced them."""
        with self._lock:
            served = sum(n for (_, status), n in self.requests.items() if status == 200)
            failed = sum(self.requests.values()) - served
            parts = " · ".join(f"{part.replace('_', ' ')} {seconds:.1f} s" for part, seconds in self.step_parts.items())
            measured, priced = (sum(self.priced_parts[(part, kind)] for part in STEP_PARTS[:2]) for kind in ("measured", "priced"))
            line = (f"served {served} requests{f' ({failed} not)' if failed else ''}, {self.generated_tokens} tokens in "
                    f"{self.acceptance.steps} steps · τ {self.acceptance.tau:.2f} · α {self.acceptance.alpha:.2f} · steps: {parts}")
        return line + (f" · {measured / priced:.2f}× priced" if priced > 0 else "")

    def record_verification(self, proposed: int, accepted: int, emitted: int) -> None:
        """One row of one step: `proposed` draft tokens, `accepted` kept, `emitted` tokens streamed."""
        now = time.monotonic()
        with self._lock:
            self.acceptance.add(proposed, accepted)
            self.generated_tokens += emitted
            self._recent_tokens.append((now, emitted))
            self._forget_before(now - RATE_WINDOW_SECONDS)

    def record_admitted(self, prompt_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens

    def record_cached(self, prompt_tokens: int) -> None:
        with self._lock:
            self.cached_prompt_tokens += prompt_tokens

    def record_riding(self, prompt_tokens: int) -> None:
        with self._lock:
            self.riding_prompt_tokens += prompt_tokens

    def record_finished(self, reason: str) -> None:
        with self._lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1

    def _forget_before(self, cutoff: float) -> None:
        while self._recent_tokens and self._recent_tokens[0][0] < cutoff:
            self._recent_tokens.popleft()

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._forget_before(now - RATE_WINDOW_SECONDS)
            return sum(n for _, n in self._recent_tokens) / RATE_WINDOW_SECONDS

    def render(self) -> str:
        tokens_per_second, cost_ratios = self.tokens_per_second(), self.cost_ratios()
        out: list[str] = []

        def metric(name: str, kind: str, help_text: str, lines: list[str]) -> None:
            out.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *lines])

        with self._lock:
            acceptance = self.acceptance
            metric("verispec_requests_total", "counter", "HTTP requests by endpoint and status code.",
                   [f'verispec_requests_total{{endpoint="{e}",status="{s}"}} {n}' for (e, s), n in sorted(self.requests.items())])
            metric("verispec_generations_finished_total", "counter", "Generations by how they ended.",
                   [f'verispec_generations_finished_total{{reason="{r}"}} {n}' for r, n in sorted(self.finished.items())])
            metric("verispec_prompt_tokens_total", "counter", "Prompt tokens admitted.", [f"verispec_prompt_tokens_total {self.prompt_tokens}"])
            metric("verispec_prompt_tokens_cached_total", "counter", "Prompt tokens copied from the prompt cache or a running "
                   "request's cache instead of prefilled.", [f"verispec_prompt_tokens_cached_total {self.cached_prompt_tokens}"])
            metric("verispec_prompt_tokens_riding_total", "counter", "Prompt tokens prefilled in the decoding requests' "
                   "target pass instead of a pass of their own.", [f"verispec_prompt_tokens_riding_total {self.riding_prompt_tokens}"])
            metric("verispec_generated_tokens_total", "counter", "Tokens generated.", [f"verispec_generated_tokens_total {self.generated_tokens}"])
            metric("verispec_steps_total", "counter", "Verification steps (one per request per target pass).", [f"verispec_steps_total {acceptance.steps}"])
            metric("verispec_draft_tokens_proposed_total", "counter", "Draft tokens proposed.", [f"verispec_draft_tokens_proposed_total {acceptance.proposed}"])
            metric("verispec_draft_tokens_accepted_total", "counter", "Draft tokens accepted.", [f"verispec_draft_tokens_accepted_total {acceptance.accepted}"])
            metric("verispec_draft_tokens_judged_total", "counter", "Draft tokens the rejection rule decided on (accepted + first rejected per step): α = accepted / judged.",
                   [f"verispec_draft_tokens_judged_total {acceptance.judged}"])
            metric("verispec_tokens_per_second", "gauge", f"Tokens generated per second over the last {RATE_WINDOW_SECONDS:.0f} s.",
                   [f"verispec_tokens_per_second {tokens_per_second:.4f}"])
            metric("verispec_acceptance_rate", "gauge", "α: accepted / judged draft tokens since start.", [f"verispec_acceptance_rate {acceptance.alpha:.4f}"])
            metric("verispec_mean_accepted_length", "gauge", "τ: tokens emitted per verification step since start.",
                   [f"verispec_mean_accepted_length {acceptance.tau:.4f}"])
            metric("verispec_position_acceptance_rate", "gauge", "Share of steps whose draft reached and kept position i.",
                   [f'verispec_position_acceptance_rate{{position="{i}"}} {rate:.4f}' for i, rate in enumerate(acceptance.per_position)])
            for name, (help_text, read) in self.gauges.items():
                metric(name, "gauge", help_text, [f"{name} {read()}"])
            metric("verispec_request_latency_seconds", "histogram", "Request latency, end to end.",
                   [line for e, h in sorted(self.request_latency.items()) for line in h.render("verispec_request_latency_seconds", f'endpoint="{e}"')])
            metric("verispec_time_to_first_token_seconds", "histogram", "Time from request to its first streamed token.",
                   self.time_to_first_token.render("verispec_time_to_first_token_seconds"))
            metric("verispec_step_seconds", "histogram", "One batched step: drafts, one target pass, verification.",
                   self.step_seconds.render("verispec_step_seconds"))
            metric("verispec_step_part_seconds_total", "counter", "Seconds of the batched steps by part: the drafts, the shared "
                   "target pass, the rest (verification, commits).",
                   [f'verispec_step_part_seconds_total{{part="{p}"}} {t:.6f}' for p, t in self.step_parts.items()])
            metric("verispec_step_priced_seconds_total", "counter", "The steps the cost model priced (a drafting policy's): "
                   "seconds measured and priced by part.",
                   [f'verispec_step_priced_seconds_total{{part="{p}",value="{k}"}} {t:.6f}' for (p, k), t in self.priced_parts.items()])
            metric("verispec_step_cost_ratio", "gauge", f"Measured over priced seconds of the latest {COST_WINDOW_STEPS} priced "
                   "steps, by part: far from 1, the machine runs other than when its costs were measured.",
                   [f'verispec_step_cost_ratio{{part="{p}"}} {r:.4f}' for p, r in cost_ratios.items()])
            metric("verispec_batch_rows", "histogram", "Requests verified together in one target pass.", self.batch_rows.render("verispec_batch_rows"))
        return "\n".join(out) + "\n"
