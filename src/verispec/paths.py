"""Where verispec keeps what it makes once and reuses: converted weights, int8 layers, kernels, costs."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """$VERISPEC_CACHE, else $XDG_CACHE_HOME/verispec, else ~/.cache/verispec."""
    if env := os.environ.get("VERISPEC_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "verispec"
