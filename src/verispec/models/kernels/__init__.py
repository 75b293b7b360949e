"""C++ extensions for the CPU hot paths, compiled once per machine on first use and cached.

`extension(name)` builds `<name>.cpp` next to this file with PyTorch's `cpp_extension` (a C++
compiler and ninja, the latter a verispec dependency) into `cache_dir()/kernels/`, and returns the
module; later loads reuse the build (one compile per machine, CPU kind and torch installation, then a load).
When it cannot be built (no compiler, an unusual platform) or `VERISPEC_KERNELS=0` is set, it
returns None and callers run their plain torch code, which computes the same bits, only slower.
"""

from __future__ import annotations

import functools
import hashlib
import os
import warnings
from pathlib import Path
from types import ModuleType

import torch

from verispec.paths import cache_dir, cpu_flags

__all__ = ["extension"]

# -march=native: this machine's vector instructions (rounding inlined); -ffp-contract=off: no fused
# multiply-add, so the same float operations as the torch code
FLAGS = ["-O3", "-march=native", "-ffp-contract=off"]


@functools.cache
def extension(name: str) -> ModuleType | None:
    """The compiled extension `name` (source `<name>.cpp` here), or None when it is unavailable."""
    if os.environ.get("VERISPEC_KERNELS", "1") == "0":
        return None
    try:  # any failure (no compiler, a read-only cache directory, …) means: use the torch code
        from torch.utils.cpp_extension import load

        from verispec.progress import status

        source = Path(__file__).with_name(f"{name}.cpp")
        # keyed by the torch installation too: its headers' path is in the build file, so two virtual
        # environments sharing one folder would rebuild each other's extension on every switch
        digest = hashlib.sha256(source.read_bytes() + " ".join([*FLAGS, cpu_flags(), torch.__file__]).encode()).hexdigest()[:12]
        build = cache_dir() / "kernels" / f"{name}-torch{torch.__version__}-{digest}"
        build.mkdir(parents=True, exist_ok=True)
        with status(f"loading the {name} kernels (compiled on first use)"):
            return load(f"verispec_{name}", [str(source)], extra_cflags=FLAGS, build_directory=str(build))
    except Exception as error:  # noqa: BLE001
        warnings.warn(f"could not build verispec's {name} kernels ({type(error).__name__}: {str(error)[:300]}); "
                      "using the slower torch code, which gives the same results", stacklevel=2)
        return None
