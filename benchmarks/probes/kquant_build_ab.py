"""The kquant kernels of this checkout against those of another git revision, in one process: a step's linear layers,
or whole forward passes.

Timings of separate processes move by several per cent on a shared VM, more than a kernel change is worth. Here the
kernels of `--against REV` (kquant.cpp and its headers as that revision has them) are built under another module
name and both builds run the shipped target's linear layers on the same packed weights: every layer of a kind (qkv,
o, gate_up, down), then the head, for `--rows` activation rows (1: a decode step), in `--rounds` rounds, the two
builds' order alternating, the other build's kernel switches (prefetching for few rows, skipping a padded layer's
sub-blocks) set as this one's where it has them. Prints the median milliseconds per kind and build. `--against HEAD`
on a clean checkout is an A/A: two builds of the same source (their code layout alone still moves kinds by a few per
cent). `--model` times another shipped model's layers (a draft's).

`--steps CONTEXT` times whole forward passes instead (what a change to the attention or the decoder stack is worth
inside a step, where the cache and the weights compete for memory): n = 1, 2, 4, 8 new positions (`--widths`; 256: a
prompt's piece) after CONTEXT cached tokens through each build's decoder stack (`Transformer.compiled_stack`), in
rounds as above; and says whether both builds' logits (the last position's past 16) are the same bits. `--attention`
times the exact attention alone (`attend`, one layer of the model's shape over a random cache of 300, 1,024 and 3,000
slots, the same n) and compares its outputs too. `--kernels avx2` runs both builds' AVX2 code (an AVX2-only CPU's) on
an AVX-512 one: an indication, as its memory and clocks are not that CPU's.

    python benchmarks/probes/kquant_build_ab.py --against 9c70245 [--rows 1] [--rounds 12] [--model smollm2-135m-instruct]
    python benchmarks/probes/kquant_build_ab.py --against 5b8cf76 --steps 1024 [--rounds 16]
    python benchmarks/probes/kquant_build_ab.py --against 5b8cf76 --attention [--rounds 30]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from pathlib import Path
from unittest import mock

import torch
from torch.utils.cpp_extension import load

from verispec.models.kernels import FLAGS
from verispec.models.kquant import kquant_kernels
from verispec.models.loading import load_model
from verispec.models.registry import DEFAULT_TARGET
from verispec.models.transformer import Transformer
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


def heading(*parts: str) -> str:
    """The CPU, the code both builds run, then `parts`, in one line."""
    return " · ".join([cpu_summary(), f"{kquant_kernels().kernels_in_use()} code", *parts])


def turns(builds: list[str], rounds: int):
    """The builds' names round after round, their order reversed every other round (a drift of the machine's speed
    then touches both alike)."""
    for round_ in range(rounds):
        yield from (builds if round_ % 2 == 0 else builds[::-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="the git revision whose kernels to time against")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--model", default=DEFAULT_TARGET, help="a shipped model (a draft: smollm2-135m-instruct)")
    parser.add_argument("--steps", type=int, metavar="CONTEXT", help="time whole forward passes after CONTEXT cached tokens")
    parser.add_argument("--attention", action="store_true", help="time the exact attention alone")
    parser.add_argument("--widths", default="1,2,4,8", help="--steps, --attention: new positions a pass (256: a prompt's piece)")
    parser.add_argument("--prefetch", choices=("on", "off"), help="prefetching for few rows in both builds (default: as"
                        " loading left it; a model under 512 MiB of weights does not measure it)")
    parser.add_argument("--kernels", help="the code both builds run (one of this CPU's `kernels_built()`; default the fastest)")
    args = parser.parse_args()
    widths = [int(n) for n in args.widths.split(",")]
    runner = load_model(args.model, "kquant").runner  # this checkout's kernels
    commit, other = build_of(args.against)
    if args.kernels:
        for module in (kquant_kernels(), other):
            module.use_kernels(args.kernels)
    if args.prefetch:
        kquant_kernels().set_prefetch_few_rows(args.prefetch == "on")
    # the other build's switches as this checkout's (`kquant.settle_prefetch`, `settle_padding`) where it has them, so the
    # code alone differs
    if hasattr(other, "set_prefetch_few_rows"):
        other.set_prefetch_few_rows(kquant_kernels().prefetch_few_rows())
    if hasattr(other, "set_skip_padding"):
        other.set_skip_padding(kquant_kernels().skip_padding())
    if args.steps is not None:
        return time_steps(runner, commit, other, args.steps, widths, args.rounds)
    if args.attention:
        return time_attention(runner.config, commit, other, widths, args.rounds)
    kinds = {name: [getattr(layer, name) for layer in runner.layers] for name in ("qkv", "o", "gate_up", "down")}
    kinds["head"] = [runner.lm_head]
    builds = {"this checkout": runner.lm_head._linear, commit: other.linear}
    # each build's switches (the other's as this checkout's where it has them): printed, as a timing compares both together
    settings = {name: [getattr(module, name, lambda: None)() for module in (kquant_kernels(), other)]
                for name in ("prefetch_few_rows", "skip_padding")}
    said = lambda name: " / ".join("n/a" if on is None else "on" if on else "off" for on in settings[name])  # noqa: E731
    seconds = {(kind, build): [] for kind in kinds for build in builds}
    for build in turns(list(builds), args.rounds):
        for kind, linears in kinds.items():
            x = torch.randn(args.rows, linears[0].in_features)  # [rows, in]
            began = time.perf_counter()
            for linear in linears:
                builds[build](x, linear.packed, linear.kinds, linear.columns, linear.bias)
            seconds[kind, build].append(time.perf_counter() - began)
    print(heading(f"{args.rows} row(s)", f"median of {args.rounds} rounds", f"ms: this checkout / {commit}",
                  f"prefetching for few rows: {said('prefetch_few_rows')}", f"skipping padded sub-blocks: {said('skip_padding')}"))
    totals = dict.fromkeys(builds, 0.0)
    for kind in kinds:
        mine, theirs = (statistics.median(seconds[kind, build]) for build in builds)
        totals["this checkout"] += mine
        totals[commit] += theirs
        print(f"  {kind}: {mine * 1e3:.2f} / {theirs * 1e3:.2f} (×{mine / theirs:.3f})")
    mine, theirs = totals.values()
    print(f"  all: {mine * 1e3:.2f} / {theirs * 1e3:.2f} (×{mine / theirs:.3f})")


def time_steps(runner, commit: str, other, context: int, widths: list[int], rounds: int) -> None:
    """Forward passes of n in `widths` positions after `context` cached tokens through each build's decoder stack."""
    stacks = {"this checkout": runner.compiled_stack(kquant_kernels()), commit: runner.compiled_stack(other)}
    cache = runner.new_cache(context + max(widths))
    runner.forward(cache, torch.arange(100, 100 + context) % runner.config.vocab_size, logits="none")
    seconds = {(build, n): [] for build in stacks for n in widths}
    logits = {}
    for build in turns(list(stacks), rounds):
        with mock.patch.object(Transformer, "_compiled_layers", lambda self, stack=stacks[build]: stack):
            for n in widths:
                cache.truncate(context)
                began = time.perf_counter()
                logits[build, n] = runner.forward(cache, torch.arange(200, 200 + n), logits="all" if n <= 16 else "last")
                seconds[build, n].append(time.perf_counter() - began)
    same = all(torch.equal(logits["this checkout", n], logits[commit, n]) for n in widths)
    print(heading(f"{runner.config.num_layers} layers", f"{context} cached tokens", f"median of {rounds} rounds",
                  f"ms: this checkout / {commit}", f"the same logits: {'yes' if same else 'NO'}"))
    for n in widths:
        mine, theirs = (statistics.median(seconds[build, n]) for build in stacks)
        print(f"  {n} new: {mine * 1e3:.2f} / {theirs * 1e3:.2f} (×{mine / theirs:.3f})")


def time_attention(config, commit: str, other, widths: list[int], rounds: int) -> None:
    """`attend` of each build: one layer of the model's shape for n in `widths` new positions over random caches."""
    builds = {"this checkout": kquant_kernels().attend, commit: other.attend}
    heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
    print(heading(f"attention of one layer ({heads} query heads, {kv_heads} KV heads, d {head_dim})", f"median of {rounds} rounds",
                  f"µs: this checkout / {commit}"))
    for context in (300, 1024, 3000):
        keys, values = (torch.randn(kv_heads, context + max(widths), head_dim) for _ in range(2))  # [kv_heads, capacity, d]
        line = []
        for n in widths:
            q = torch.randn(heads, n, head_dim)  # [heads, n, d]
            seconds, outputs = {build: [] for build in builds}, {}
            for build in turns(list(builds), rounds):
                began = time.perf_counter()
                outputs[build] = builds[build](q, keys, values, context, None, head_dim**-0.5)
                seconds[build].append(time.perf_counter() - began)
            mine, theirs = (statistics.median(seconds[build]) for build in builds)
            same = torch.equal(*outputs.values())
            line.append(f"{n} new {mine * 1e6:.0f} / {theirs * 1e6:.0f} (×{mine / theirs:.3f}{'' if same else ', NOT the same bits'})")
        print(f"  {context} slots: " + "; ".join(line))


if __name__ == "__main__":
    main()
