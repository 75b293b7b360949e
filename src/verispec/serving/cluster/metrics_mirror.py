"""Copies a replica's server metrics into Ray's metrics system, labelled by replica, for Prometheus.

Each replica of `verispec serve --ray` keeps the `/metrics` of `verispec.serving.http` (requests,
speculative statistics, queue). An HTTP scrape of `/metrics` through Serve's proxy reaches one
replica at random, so this mirror also copies every series, once a second, into `ray.serve.metrics`:
Ray exports them from each node's metrics port (`ray_` prefix, tags `deployment`, `replica`,
`application` added by Serve). Counters stay counters (incremented by what changed); gauges and the
histograms' `_bucket`/`_sum`/`_count` series become gauges holding the replica's current value.

Totals are sums over the `replica` tag in PromQL; τ and α of the whole deployment come from the
summed counters (README "Running on a Ray cluster").

The mirror parses the replica's own Prometheus text: one source of truth for what is reported.
"""

from __future__ import annotations

import re
import threading

from verispec.serving.http.metrics import Metrics

__all__ = ["MetricsMirror", "parse_prometheus"]

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, str, dict[str, str], float]]:
    """(kind, sample name, labels, value) for every sample; kind comes from the family's # TYPE line."""
    kinds: dict[str, str] = {}
    samples = []
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            kinds[name] = kind
            continue
        if not line or line.startswith("#") or not (match := _SAMPLE.match(line)):
            continue
        name, labels, value = match.groups()
        family = next((f for f in (name, re.sub(r"_(bucket|sum|count)$", "", name)) if f in kinds), name)
        samples.append((kinds.get(family, "gauge"), name, dict(_LABEL.findall(labels or "")), float(value)))
    return samples


class MetricsMirror:
    """A daemon thread that copies `metrics` into `ray.serve.metrics` every `interval` seconds."""

    def __init__(self, metrics: Metrics, interval: float = 1.0):
        self.metrics, self.interval = metrics, interval
        self._instruments: dict[str, object] = {}
        self._last: dict[tuple[str, tuple], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="verispec-metrics-mirror", daemon=True)

    def start(self) -> MetricsMirror:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.interval * 5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sync()
        self.sync()

    def sync(self) -> None:
        """Copy the current values once."""
        for kind, name, labels, value in parse_prometheus(self.metrics.render()):
            instrument = self._instrument(kind, name, tuple(sorted(labels)))
            if kind == "counter":
                key = (name, tuple(sorted(labels.items())))
                delta = value - self._last.get(key, 0.0)
                if delta > 0:
                    instrument.inc(delta, tags=labels)
                    self._last[key] = value
            else:
                instrument.set(value, tags=labels)

    def _instrument(self, kind: str, name: str, tag_keys: tuple[str, ...]):
        if name not in self._instruments:
            from ray.serve import metrics as serve_metrics

            cls = serve_metrics.Counter if kind == "counter" else serve_metrics.Gauge
            self._instruments[name] = cls(name, description=f"verispec {kind} {name}, per replica", tag_keys=tag_keys)
        return self._instruments[name]
