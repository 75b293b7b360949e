"""C++ extensions for the CPU hot paths, compiled once per machine on first use and cached.

`extension(name)` builds `<name>.cpp` next to this file with PyTorch's `cpp_extension` (a C++
compiler and ninja, the latter a verispec dependency) into `cache_dir()/kernels/`, and returns the
module. The build folder is keyed by what the binary depends on: the source and the headers beside it, the compiler flags, the
CPU's instruction sets (`-march=native`), the torch release and the Python ABI. A finished build is
imported directly, so every virtual environment with the same torch and Python shares one compile.
When it cannot be built (no compiler, an unusual platform) or `VERISPEC_KERNELS=0` is set, it
returns None and callers run their plain torch code, which computes the same bits, only slower.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import sysconfig
import warnings
from pathlib import Path
from types import ModuleType

import torch

from verispec.paths import cache_dir, cpu_flags

__all__ = ["build_key", "extension"]

# -march=native: this machine's vector instructions (rounding inlined; VERISPEC_KERNELS_MARCH=haswell builds
# what an AVX2-only CPU runs, its 16 vector registers included, to time that code here); -ffp-contract=off:
# no fused multiply-add, so the same float operations as the torch code; -fopenmp: `at::parallel_for` is a
# header that runs serially unless OpenMP is on (in the process the loaded libgomp is torch's own, one pool)
FLAGS = ["-O3", f"-march={os.environ.get('VERISPEC_KERNELS_MARCH', 'native')}", "-ffp-contract=off", "-fopenmp"]
READY = "ready"  # written into a build folder once its module has compiled and loaded


@functools.cache
def extension(name: str) -> ModuleType | None:
    """The compiled extension `name` (source `<name>.cpp` here), or None when it is unavailable."""
    if os.environ.get("VERISPEC_KERNELS", "1") == "0":
        return None
    try:  # any failure (no compiler, a read-only cache directory, …) means: use the torch code
        from verispec.progress import status

        source = Path(__file__).with_name(f"{name}.cpp")
        build = _build_folder(name, source)
        with status(f"loading the {name} kernels (compiled on first use)"):
            if (build / READY).exists():
                return _import(f"verispec_{name}", build / f"verispec_{name}.so")
            return _compile(name, source, build)
    except Exception as error:  # noqa: BLE001
        warnings.warn(f"could not build verispec's {name} kernels ({type(error).__name__}: {str(error)[:300]}); "
                      "using the slower torch code, which gives the same results", stacklevel=2)
        return None


def build_key(name: str) -> str:
    """A short digest of what extension `name`'s binary is built from (source, headers, flags, CPU, torch):
    measured costs and choices that depend on the kernels are kept under it, so a new kernel is measured anew."""
    return _build_folder(name, Path(__file__).with_name(f"{name}.cpp")).name.rsplit("-", 1)[-1]


def _build_folder(name: str, source: Path) -> Path:
    """The cache folder of this source built with these flags for this CPU, torch release and Python ABI
    (not for a torch path: its build file names one venv's headers, but the binary fits them all)."""
    key = " ".join([*FLAGS, cpu_flags(), torch.__version__, sysconfig.get_config_var("EXT_SUFFIX") or ""])
    headers = b"".join(header.read_bytes() for header in sorted(source.parent.glob("*.h")))
    digest = hashlib.sha256(source.read_bytes() + headers + key.encode()).hexdigest()[:12]
    return cache_dir() / "kernels" / f"{name}-torch{torch.__version__}-{digest}"


def _compile(name: str, source: Path, build: Path) -> ModuleType:
    """Compile into `build` (cpp_extension locks the folder, so concurrent first uses build once) and
    mark it ready for direct imports."""
    from torch.utils.cpp_extension import load

    build.mkdir(parents=True, exist_ok=True)
    module = load(f"verispec_{name}", [str(source)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], build_directory=str(build))
    (build / READY).touch()
    return module


def _import(module_name: str, library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(module_name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
