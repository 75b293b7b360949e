"""A short table of what `measure.py`, `linear_widths.py` and `step_kernels.py` wrote (JSON lines), for the end of a
device call's output: each T(n) curve's T(1) and T(n)/T(1) at a few widths, each run's tok/s, τ and agreement with
plain decoding, each layer's cuBLAS against row-invariant kernel time at a few row counts, and each profiled step's
wall time, idle time and largest kernel families.
    python benchmarks/gpu/summary.py OUT/*.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

WIDTHS = (2, 5, 9, 13, 16, 32, 64)
ROWS = (1, 2, 5, 13, 16)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _cost(record: dict) -> str:
    at = dict(zip(record["widths"], record["ratio"]))
    ratios = " ".join(f"{n}:{at[n]:.2f}" for n in WIDTHS if n in at)
    return f"  T {record['role']:<6} {record['mode']:<5} T(1) {record['seconds'][0] * 1e3:6.2f} ms  {ratios}"


def _speed(record: dict) -> str:
    same = f" = plain {record['same_as_plain']}/{record['prompts']}" if record.get("same_as_plain") is not None else ""
    where = {True: " (device steps)", False: " (host steps)"}.get(record.get("device_steps")) if record.get("graphs") else ""
    return (f"  {record['system']} {record['method'] + where:<42} {record['tok_s']:8.1f} tok/s  τ {record.get('tau') or 1:.2f}"
            f"{same}  = cold {record.get('same_as_cold', '-')}{'  (again)' if record.get('again') else ''}")


def _batch(record: dict) -> str:
    same = f" = alone {record['same_as_alone']}/{record['requests']}" if record.get("same_as_alone") is not None else ""
    return f"  batch of {record['requests']:>3} {record['method']:<33} {record['tok_s']:8.1f} tok/s{same}"


def _linear(record: dict) -> str:
    rows = record.get("rows_kernel_seconds")
    kernel = f"  rows {rows * 1e6:7.1f} µs same bits {record['rows_kernel_same_bits']}" if rows else ""
    return (f"  {record['name']:<8} m {record['m']:>2}  cuBLAS {record['seconds'] * 1e6:7.1f} µs same bits "
            f"{record['same_bits']}{kernel}")


def _step(record: dict) -> str:
    families = " ".join(f"{name} {us:.0f}" for name, us in list(record["families_us"].items())[:5])
    return (f"  step {record['mode']:<5} n {record['n']:>2}  wall {record['wall_us']:7.1f} µs  idle {record['idle_us']:6.1f}  "
            f"kernels: {families}")


def main(paths: list[str]) -> int:
    for path in map(Path, paths):
        if not path.exists():  # a step that ran out of time, or a shell pattern that matched nothing
            continue
        print(path.name)
        for record in _records(path):
            kind = record.get("kind")
            if kind == "env":
                print("  " + ", ".join(f"{k} {record[k]}" for k in ("gpu", "driver", "torch", "cublas_workspace_config")
                                       if k in record))
            elif kind == "cost":
                print(_cost(record))
            elif kind == "speed":
                print(_speed(record))
            elif kind == "batch":
                print(_batch(record))
            elif kind == "linear" and record["m"] in ROWS:
                print(_linear(record))
            elif kind == "step_kernels":
                print(_step(record))
            elif kind in ("error", "flips"):
                print(f"  {kind}: {json.dumps(record)[:300]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
