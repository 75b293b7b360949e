"""OpenMP's thread pools: a thread that hands the models to another lets its pool go.

torch's kernels and verispec's own (`at::parallel_for`) run on OpenMP, and libgomp (GCC's runtime, torch's on Linux)
keeps a pool of worker threads for every thread that has started parallel work. While a process's pools hold more
threads than it has CPUs, libgomp stops letting idle workers spin (a throttled spin count of 100): every parallel
region then wakes its workers through the kernel. So a thread that loaded the models and measured their costs, its
pool alive, slows the one thread that decodes, and a draft model's many short regions most (BENCHMARKS.md, "AMX":
serving against llama.cpp's server). `release_thread_pool()` frees the calling thread's pool (`omp_pause_resource_all`,
OpenMP 5.0): `load` and the engine's `prepare` (where it built something), `generate`, `stream` and `generate_batch`
call it as they return, and the server's scheduler for the thread that started it and for its own whenever it falls
idle. `serial_thread()` keeps a thread from ever starting a pool: the drafting threads of `drafters/batching.py`, whose
sampling work is small and runs while the one thread that runs the models waits, pushed the process past its CPUs at
every sampled step otherwise (BENCHMARKS.md, "AMX": sampled traffic under load).
"""

from __future__ import annotations

import ctypes
import functools
import os

__all__ = ["release_thread_pool", "serial_thread"]

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep what a later parallel region can start again from


@functools.cache
def _libgomp():
    """libgomp where the process has loaded it (torch's runtime), else None."""
    try:
        import torch  # noqa: F401 - the OpenMP runtime comes with torch
        return ctypes.CDLL("libgomp.so.1", mode=getattr(os, "RTLD_NOLOAD", 0))  # the loaded one, never another
    except OSError:  # no libgomp (LLVM's or Intel's runtime, macOS, Windows)
        return None


def _pause_resource_all():
    """libgomp's `omp_pause_resource_all`, or None (no libgomp, or an old one)."""
    return getattr(_libgomp(), "omp_pause_resource_all", None)


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP worker threads (a later parallel region on this thread starts new ones).
    False where there is nothing to call (another OpenMP runtime) or the runtime refused (inside a parallel region)."""
    pause = _pause_resource_all()
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0


def serial_thread() -> bool:
    """Run the calling thread's parallel regions on it alone from now on: it starts no OpenMP pool (and frees any it
    has). For threads doing small host work beside the one thread that runs the models. False where there is no
    libgomp to tell."""
    runtime = _libgomp()
    if runtime is None:
        return False
    import torch
    torch.get_num_threads()  # torch sets a thread's count on its first parallel call: let it do so now, not after ours
    release_thread_pool()
    runtime.omp_set_num_threads(1)
    return True
