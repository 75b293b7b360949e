"""Where verispec keeps what it makes once and reuses (converted weights, int8 layers, kernels, costs), and
the CPU identity that machine-specific entries are keyed by and that every benchmark prints beside its
numbers (a number measured on one CPU kind says nothing about another)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import threading
from functools import cache
from pathlib import Path

__all__ = ["cache_dir", "cpu_flags", "cpu_summary", "files_stamp", "keyed_file", "read_table", "store_in_table",
           "write_whole"]

# The vector-instruction flags that decide which kernels run (x86: AVX2, AVX-512 with VNNI/BF16, AMX;
# Arm: NEON, SVE): the part of the flags a reader compares.
VECTOR_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8",
                "amx_bf16", "asimd", "sve")


def cache_dir() -> Path:
    """$VERISPEC_CACHE, else $XDG_CACHE_HOME/verispec, else ~/.cache/verispec."""
    if env := os.environ.get("VERISPEC_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "verispec"


def keyed_file(kind: str, name: str, key: str, suffix: str) -> Path:
    """`cache_dir()/kind/<name>-<digest of key><suffix>`: one entry per key (a full path, a stamp) under a readable name."""
    return cache_dir() / kind / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}{suffix}"


def files_stamp(*parts, files: list[Path]) -> str:
    """What something made from `files` depends on: `parts` (a format, versions, a build) and each file's name, size
    and modification time (a rewritten file gets another stamp)."""
    return json.dumps([*parts] + [[file.name, file.stat().st_size, file.stat().st_mtime_ns] for file in files])


def write_whole(file: Path, write) -> bool:
    """`write(path)` into a file of this process beside `file`, which then replaces `file`: a reader never sees
    half a file, and two processes writing at once each write their own. False (and nothing left behind) when
    the cache directory cannot take it: what was cached is made again next time."""
    partial = file.with_name(f".{file.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        write(partial)
        os.replace(partial, file)
        return True
    except OSError:
        with contextlib.suppress(OSError):
            partial.unlink()
        return False


def read_table(name: str) -> dict:
    """The JSON table `name` of the cache directory (measured costs, exact widths, backend choices); {} when
    there is none yet or it cannot be read."""
    try:
        return json.loads((cache_dir() / name).read_text())
    except (OSError, json.JSONDecodeError):  # none yet, or a cache directory that is not one
        return {}


def store_in_table(name: str, key: str, value) -> None:
    """table[key] = value in the cache directory's JSON table `name`: under a lock on the table, read again
    and written whole to a file of this process that then replaces it, so processes that measure at once
    (test workers, server replicas) each keep their entries and a reader never sees a half-written table."""
    file = cache_dir() / name
    file.parent.mkdir(parents=True, exist_ok=True)
    with open(file.with_name(f".{file.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        table = read_table(name) | {key: value}
        partial = file.with_name(f".{file.name}.{os.getpid()}.{threading.get_ident()}")
        partial.write_text(json.dumps(table, indent=1))
        os.replace(partial, file)


CPUINFO = Path("/proc/cpuinfo")  # what the kernel says of the CPU (Linux)


@cache
def cpu_flags() -> str:
    """The CPU's instruction-set flags: what a -march=native build and a measured kernel cost depend on
    (a cache shared by machines of different CPU kinds keeps one entry per kind)."""
    try:
        lines = CPUINFO.read_text().splitlines()
        return next((line for line in lines if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor()


def cpu_key() -> str:
    """A short name for this CPU kind (a digest of its flags): what a measured cost or choice is kept under."""
    return hashlib.sha256(cpu_flags().encode()).hexdigest()[:12]


@cache
def cpu_summary() -> str:
    """The CPU's model name with its x86 family and model numbers, logical CPU count and vector-instruction flags, e.g.
    "AMD EPYC (family 26 model 2), 2 CPUs, avx2 fma f16c avx512f": a virtual machine's name ("AMD EPYC") does not
    say which generation runs it, and two generations with the same flags measure differently."""
    flags = set(cpu_flags().split(":", 1)[-1].split())
    try:
        first = CPUINFO.read_text().split("\n\n")[0]  # the first processor's fields
    except OSError:
        first = ""
    fields = {key.strip(): value.strip() for key, value in (line.split(":", 1) for line in first.splitlines() if ":" in line)}
    model = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        model += f" (family {fields['cpu family']} model {fields['model']})"
    vector = " ".join(flag for flag in VECTOR_FLAGS if flag in flags) or "no AVX2/AVX-512/AMX/NEON flags"
    return f"{model}, {os.cpu_count()} CPUs, {vector}"
