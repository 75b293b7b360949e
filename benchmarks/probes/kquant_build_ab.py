"""The kquant kernels of this checkout against those of another git revision, in one process: a step's linear layers.

Timings of separate processes move by several per cent on a shared VM, more than a kernel change is worth. Here the
kernels of `--against REV` (kquant.cpp and its headers as that revision has them) are built under another module
name and both builds run the shipped target's linear layers on the same packed weights: every layer of a kind (qkv,
o, gate_up, down), then the head, for `--rows` activation rows (1: a decode step), in `--rounds` rounds, the two
builds' order alternating. Prints the median milliseconds per kind and build. `--against HEAD` on a clean checkout is
an A/A: two builds of the same source (their code layout alone still moves kinds by a few per cent). `--model`
times another shipped model's layers (a draft's).

    python benchmarks/probes/kquant_build_ab.py --against 9c70245 [--rows 1] [--rounds 12] [--model smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from verispec.models.kernels import FLAGS
from verispec.models.kquant import kquant_kernels
from verispec.models.loading import load_model
from verispec.models.registry import DEFAULT_TARGET
from verispec.paths import cache_dir, cpu_summary

KERNELS = "src/verispec/models/kernels"


def build_of(revision: str):
    """The kquant extension of `revision`, built once into the cache directory under its own module name."""
    root = Path(subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True).strip())
    commit = subprocess.check_output(["git", "rev-parse", "--short", revision], text=True, cwd=root).strip()
    folder = cache_dir() / "kernels" / f"kquant-ab-{commit}"
    (folder / "build").mkdir(parents=True, exist_ok=True)
    for name in subprocess.check_output(["git", "ls-tree", "--name-only", f"{commit}:{KERNELS}"], text=True, cwd=root).split():
        if name.endswith((".cpp", ".h")):
            (folder / name).write_bytes(subprocess.check_output(["git", "show", f"{commit}:{KERNELS}/{name}"], cwd=root))
    return commit, load(f"verispec_kquant_ab_{commit}", [str(folder / "kquant.cpp")], extra_cflags=FLAGS,
                        extra_ldflags=["-fopenmp"], build_directory=str(folder / "build"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="the git revision whose kernels to time against")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--model", default=DEFAULT_TARGET, help="a shipped model (a draft: smollm2-135m-instruct)")
    args = parser.parse_args()
    runner = load_model(args.model, "kquant").runner  # this checkout's kernels
    commit, other = build_of(args.against)
    kinds = {name: [getattr(layer, name) for layer in runner.layers] for name in ("qkv", "o", "gate_up", "down")}
    kinds["head"] = [runner.lm_head]
    builds = {"this checkout": runner.lm_head._linear, commit: other.linear}
    # each build's prefetching for one and two rows as loading left it (`kquant.settle_prefetch`: this checkout's as
    # measured on this CPU; off in another build; none before the switch): printed, as a timing compares both together
    settings = [getattr(module, "prefetch_few_rows", lambda: None)() for module in (kquant_kernels(), other)]
    seconds = {(kind, build): [] for kind in kinds for build in builds}
    for round_ in range(args.rounds):
        for build in (list(builds) if round_ % 2 == 0 else list(builds)[::-1]):
            for kind, linears in kinds.items():
                x = torch.randn(args.rows, linears[0].in_features)  # [rows, in]
                began = time.perf_counter()
                for linear in linears:
                    builds[build](x, linear.packed, linear.kinds, linear.columns, linear.bias)
                seconds[kind, build].append(time.perf_counter() - began)
    print(f"{cpu_summary()} · {args.rows} row(s) · median of {args.rounds} rounds · ms: this checkout / {commit}"
          f" · prefetching for few rows: {' / '.join('n/a' if on is None else 'on' if on else 'off' for on in settings)}")
    totals = dict.fromkeys(builds, 0.0)
    for kind in kinds:
        mine, theirs = (statistics.median(seconds[kind, build]) for build in builds)
        totals["this checkout"] += mine
        totals[commit] += theirs
        print(f"  {kind}: {mine * 1e3:.2f} / {theirs * 1e3:.2f} (×{mine / theirs:.3f})")
    mine, theirs = totals.values()
    print(f"  all: {mine * 1e3:.2f} / {theirs * 1e3:.2f} (×{mine / theirs:.3f})")


if __name__ == "__main__":
    main()
