"""`verispec analyze`: what speedup to expect, from α and c given or measured on a real pair.

    verispec analyze --alpha 0.8 --c 0.1                 # table over γ: E[tokens], speedup, optimum
    verispec analyze --alpha 0.8 --c 0.1 --verify-cost 1,1.07,2,2,2,3   # with measured T(n)/T(1)
    verispec analyze --plots plots/                      # the theory's figures
    verispec analyze --measure --target NAME --draft NAME --questions own --per-category 1
    verispec analyze --flips --target NAME --dtype bfloat16 --width 5   # 1-wide vs 5-wide argmax flips
    verispec analyze --flips --target NAME --dtype bfloat16 --device cuda   # the same on a GPU (cuBLAS by shape)
    verispec analyze --profile --dtype gguf --methods none,ngram,model   # where a step's milliseconds go

The measurement (see `verispec.tools.measure`) reports α (probability overlap at --temperature), the greedy
α (argmax agreement), c and the target's T(n), then the same table for each α.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from verispec.engine.spec import EngineSpec

__all__ = ["add_arguments", "run", "format_table"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--alpha", type=float, help="acceptance rate α in [0, 1]")
    parser.add_argument("--c", type=float, help="cost ratio c: one draft forward / one target forward")
    parser.add_argument("--verify-cost", metavar="T1,T2,…",
                        help="target forward cost over n = 1, 2, … positions (seconds or ratios); default: free")
    parser.add_argument("--max-gamma", type=int, default=12)
    parser.add_argument("--plots", type=Path, metavar="DIR", help="write expected_tokens.png and optimal_gamma.png")
    parser.add_argument("--measure", action="store_true", help="measure α and c of --target and --draft on prompts")
    parser.add_argument("--flips", action="store_true",
                        help="count the positions where --target's argmax differs between 1 and --width positions per forward")
    parser.add_argument("--profile", action="store_true",
                        help="decode with each of --methods and split every step's time into its phases (verispec.tools.profile)")
    parser.add_argument("--methods", default="none,ngram,model",
                        help="--profile: drafter specs, comma-separated; plain decoding (none) always comes first")
    parser.add_argument("--gamma", type=int, default=4, help="--profile: the starting draft length")
    parser.add_argument("--gamma-policy", default="analytic", help="--profile: constant, heuristic, analytic or auto")
    parser.add_argument("--width", type=int, default=5, help="positions per forward for --flips (γ + 1; default 5)")
    parser.add_argument("--target", default=None, help="target model (shipped name, HF folder or .gguf)")
    parser.add_argument("--draft", default=None, help="draft model (shipped name, HF folder or .gguf)")
    parser.add_argument("--questions", "--prompts", dest="questions", default="own",
                        help="prompt sources as for `verispec bench`: own, humaneval, JSONL files (default own)")
    parser.add_argument("--per-category", type=int, default=1, help="prompts per category to measure on (default 1)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    EngineSpec.add_arguments(parser, EngineSpec(dtype="float32"), names=("dtype", "device"))
    parser.add_argument("--temperature", type=float, default=1.0, help="softmax temperature for α (0 = greedy α)")


def format_table(alpha: float, c: float, max_gamma: int, verify_cost: Callable[[int], float] | None = None) -> str:
    """A Markdown table over γ: expected tokens per step, speedup (free and, if given, measured verification)."""
    from verispec.control.theory import speedup_table

    free = speedup_table(alpha, c, max_gamma)
    measured = speedup_table(alpha, c, max_gamma, verify_cost) if verify_cost else None
    headers = ["γ", "E[tokens]", "speedup (free verify)"] + (["speedup (measured verify)"] if measured else [])
    lines = [f"α = {alpha:.4f}, c = {c:.4f}", "", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for i, row in enumerate(free):
        cells = [str(row["gamma"]), f"{row['expected_tokens']:.4f}", f"{row['speedup']:.3f}×" + (" ★" if row["optimal"] else "")]
        if measured:
            cells.append(f"{measured[i]['speedup']:.3f}×" + (" ★" if measured[i]["optimal"] else ""))
        lines.append("| " + " | ".join(cells) + " |")
    best = [r["gamma"] for r in free if r["optimal"]][0]
    summary = f"optimal γ = {best}"
    if measured:
        summary += f" (free verification); {[r['gamma'] for r in measured if r['optimal']][0]} with the measured verification cost"
    return "\n".join(lines + ["", summary])


def _prompts_ids(args: argparse.Namespace, model) -> list[list[int]]:
    """The token ids of the chosen prompts (`--questions`, `--per-category`), chat template applied."""
    from verispec.tools.bench.questions import encoded_prompts

    return encoded_prompts(model, args.questions, args.per_category)


def _measure(args: argparse.Namespace) -> tuple[float, float, list[float]]:
    from verispec.errors import InvalidParameterError
    from verispec.tools.measure import measure_pair
    from verispec.models.loading import load_model

    if not args.target or not args.draft:
        raise InvalidParameterError("--measure needs --target and --draft")
    if args.max_new_tokens < 1:
        raise InvalidParameterError("--max-new-tokens must be ≥ 1")
    target = load_model(args.target, args.dtype, device=args.device)
    draft = load_model(args.draft, args.dtype, pack_rows=1, device=args.device)
    prompts_ids = _prompts_ids(args, target)
    m = measure_pair(target, draft, prompts_ids, args.max_new_tokens, args.temperature, args.max_gamma)
    print(f"measured on {len(prompts_ids)} prompts, {len(m.alphas)} positions: α = {m.alpha:.4f} "
          f"(temperature {args.temperature}), greedy α = {m.greedy_alpha:.4f}, c = {m.c:.4f} "
          f"(draft {m.draft_seconds * 1e3:.1f} ms, target {m.target_curve[0] * 1e3:.1f} ms per token)")
    print("target T(n)/T(1): " + " ".join(f"{t / m.target_curve[0]:.2f}" for t in m.target_curve) + "\n")
    print("greedy decoding:\n" + format_table(m.greedy_alpha, m.c, args.max_gamma, _curve(m.target_curve)) + "\n")
    return m.alpha, m.c, m.target_curve


def _flips(args: argparse.Namespace) -> None:
    from verispec.errors import InvalidParameterError
    from verispec.tools.measure import width_flips
    from verispec.models.loading import load_model

    if not args.target:
        raise InvalidParameterError("--flips needs --target")
    target = load_model(args.target, args.dtype, device=args.device)
    prompts_ids = _prompts_ids(args, target)
    f = width_flips(target, prompts_ids, args.max_new_tokens, args.width)
    gaps = ", ".join(f"{g:.3f}" for g in f.flip_margins) or "–"
    print(f"{args.target} in {args.dtype} on {target.device}, {len(prompts_ids)} prompts, {f.positions} positions: the argmax differs "
          f"between 1 and {args.width} positions per forward at {f.flips} ({f.rate:.2%}); top-2 logit gap at those "
          f"positions: {gaps} (median over all positions {f.median_margin:.3f})")


def _curve(values: list[float]):
    from verispec.control.theory import curve_verify_cost

    return curve_verify_cost(values)


def run(args: argparse.Namespace) -> int:
    from verispec.errors import InvalidParameterError

    verify_cost = None
    if args.verify_cost:
        try:
            verify_cost = _curve([float(x) for x in args.verify_cost.split(",") if x.strip()])
        except ValueError:
            raise InvalidParameterError(f"--verify-cost must be comma-separated numbers, got {args.verify_cost!r}") from None
    if args.flips:
        _flips(args)
        return 0
    if args.profile:
        from verispec.tools.profile import run_profile

        return run_profile(args)
    if args.measure:
        alpha, c, curve = _measure(args)
        verify_cost = verify_cost or _curve(curve)
        print(f"sampling at temperature {args.temperature}:")
    elif args.alpha is not None and args.c is not None:
        alpha, c = args.alpha, args.c
    elif args.alpha is not None or args.c is not None:
        raise InvalidParameterError("give both --alpha and --c (or --measure with --target and --draft)")
    else:
        alpha = c = None
        if not args.plots:
            raise InvalidParameterError("nothing to do: give --alpha and --c, --measure, or --plots DIR")
    if alpha is not None:
        print(format_table(alpha, c, args.max_gamma, verify_cost))
    if args.plots:
        from verispec.tools.bench.plots import write_theory_plots

        for path in write_theory_plots(args.plots, verify_cost):
            print(f"wrote {path}")
    return 0
