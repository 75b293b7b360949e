"""Where verispec keeps what it makes once and reuses (converted weights, int8 layers, kernels, costs), and
the CPU identity that machine-specific entries are keyed by."""

from __future__ import annotations

import os
import platform
from functools import cache
from pathlib import Path

__all__ = ["cache_dir", "cpu_flags"]


def cache_dir() -> Path:
    """$VERISPEC_CACHE, else $XDG_CACHE_HOME/verispec, else ~/.cache/verispec."""
    if env := os.environ.get("VERISPEC_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "verispec"


@cache
def cpu_flags() -> str:
    """The CPU's instruction-set flags: what a -march=native build and a measured kernel cost depend on
    (a cache shared by machines of different CPU kinds keeps one entry per kind)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next((line for line in lines if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor()
