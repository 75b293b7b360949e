"""PNG figures (matplotlib, no display needed) for `verispec bench --plots` and `verispec analyze --plots`.

Benchmark figures, from a summary of `verispec.tools.bench.report.summarize`:
  speedup_by_category.png    grouped bars: speedup vs the baseline (hf-plain, else llama-cpp) per category
                             (tokens/s instead when neither ran);
  acceptance_by_position.png one line per verispec method: share of steps keeping draft position i;
  speedup_vs_gamma.png       per drafting method, the theory's speedup against γ from its measured α
                             and c (optimum marked) and the measured speedup at the run's mean γ.
Long-context figure, from the rows of `python -m verispec.tools.bench.longctx`:
  longctx-<task>.png         decode tokens/s and extra peak memory against the prompt length, per method.
Theory figures:
  expected_tokens.png        E[tokens per step] against γ for several α;
  optimal_gamma.png          the optimal γ over the (α, c) plane, as a heatmap.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from verispec.control.theory import expected_speedup, expected_tokens, optimal_gamma
from verispec.errors import InvalidParameterError

__all__ = ["require_matplotlib", "write_bench_plots", "write_theory_plots", "long_context_plot"]

MAX_GAMMA = 12


def require_matplotlib() -> None:
    """Fail now, with one line, where matplotlib is missing: before a run whose figures it would draw."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise InvalidParameterError("--plots needs matplotlib: pip install matplotlib (or verispec[bench])") from None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")  # keeps a legend placed outside the axes
    _pyplot().close(fig)
    return path


def _colours(count: int) -> list:
    """`count` distinct colours: matplotlib's 10-colour cycle repeats, so more methods take tab20."""
    plt = _pyplot()
    return [plt.get_cmap("tab10" if count <= 10 else "tab20")(i) for i in range(count)]


def _legend_outside(ax, fontsize: str = "small") -> None:
    ax.legend(fontsize=fontsize, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def category_bars(summary: dict[str, dict]) -> tuple[str, list[str], dict[str, list[float]]]:
    """What `speedup_by_category` draws: (the metric, the categories + "overall", one value per category
    for each method). The metric is the speedup over the baseline, or tokens/s when no method has one."""
    categories = list(dict.fromkeys(c for m in summary.values() for c in m["per_category"])) + ["overall"]
    has_baseline = any(m.get("speedup") for m in summary.values())
    metric = "speedup" if has_baseline else "tokens_per_second"
    values = {}
    for name, method in summary.items():
        groups = method["per_category"] | {"overall": method}
        values[name] = [(groups.get(c) or {}).get(metric) or 0.0 for c in categories]
    return metric, categories, values


def speedup_by_category(summary: dict[str, dict], path: Path) -> Path:
    plt = _pyplot()
    metric, categories, values = category_bars(summary)
    width = 0.8 / max(len(values), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(categories)), 4))
    for i, (name, colour) in enumerate(zip(values, _colours(len(values)))):
        ax.bar([x + i * width for x in range(len(categories))], values[name], width, label=name, color=colour)
    ax.set_xticks([x + width * (len(values) - 1) / 2 for x in range(len(categories))], categories, rotation=20)
    if metric == "speedup":
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        baseline = next((m.get("baseline") for m in summary.values() if m.get("baseline")), "baseline")
        ax.set_ylabel(f"speedup vs {baseline} (×)")
        ax.set_title("Speedup per category")
    else:
        ax.set_ylabel("tokens/s (mean over prompts)")
        ax.set_title("Tokens/s per category (no baseline in this run)")
    _legend_outside(ax)
    return _save(fig, path)


def acceptance_by_position(summary: dict[str, dict], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for (name, metrics), colour in zip(summary.items(), _colours(len(summary))):
        rates = metrics.get("per_position_acceptance") or []
        if rates:
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=name, color=colour)
    ax.set_xlabel("draft position i")
    ax.set_ylabel("share of steps keeping position i")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance per draft position")
    if ax.get_legend_handles_labels()[0]:
        _legend_outside(ax)
    return _save(fig, path)


def speedup_vs_gamma(summary: dict[str, dict], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    gammas = range(1, MAX_GAMMA + 1)
    for (name, m), colour in zip(summary.items(), _colours(len(summary))):
        alpha, c, mean_gamma = m.get("acceptance_rate"), m.get("cost_ratio"), m.get("mean_gamma")
        if alpha is None or c is None or not mean_gamma:
            continue  # not a drafting method
        alpha = min(alpha, 1.0)
        (line,) = ax.plot(gammas, [expected_speedup(alpha, g, c) for g in gammas], color=colour,
                          label=f"{name} theory (α={alpha:.2f}, c={c:.3f})")
        best = optimal_gamma(alpha, c, MAX_GAMMA)
        ax.plot([best], [expected_speedup(alpha, best, c)], marker="*", markersize=14, color=line.get_color())
        if m.get("speedup") is not None:
            ax.plot([mean_gamma], [m["speedup"]], marker="o", linestyle="none", color=line.get_color(),
                    label=f"{name} measured at γ̄={mean_gamma:.1f}")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xlabel("γ (draft length)")
    ax.set_ylabel("speedup (×)")
    ax.set_title("Measured vs theoretical speedup (★ = optimal γ)")
    if ax.get_legend_handles_labels()[0]:
        _legend_outside(ax, "x-small")
    return _save(fig, path)


def write_bench_plots(summary: dict[str, dict], folder: Path) -> list[Path]:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return [
        speedup_by_category(summary, folder / "speedup_by_category.png"),
        acceptance_by_position(summary, folder / "acceptance_by_position.png"),
        speedup_vs_gamma(summary, folder / "speedup_vs_gamma.png"),
    ]


# --- theory -----------------------------------------------------------------------------------------


def long_context_plot(rows: list[dict], path: Path) -> Path:
    """Rows with `method`, `prompt_tokens`, `decode_tok_s`, `peak_extra_mib`, one line per method."""
    fig, (speed, memory) = _pyplot().subplots(1, 2, figsize=(10, 4))
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["prompt_tokens"])
        x = [r["prompt_tokens"] for r in mine]
        speed.plot(x, [r["decode_tok_s"] for r in mine], "o-", label=method)
        memory.plot(x, [r["peak_extra_mib"] or 0 for r in mine], "o-", label=method)
    speed.set(xlabel="prompt tokens", ylabel="decode tokens/s", title="decode speed as the context grows")
    memory.set(xlabel="prompt tokens", ylabel="MiB", title="peak memory above the loaded models")
    for ax in (speed, memory):
        ax.set_xscale("log", base=2)
        ax.legend()
    return _save(fig, path)


def expected_tokens_plot(path: Path, alphas: tuple[float, ...] = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    gammas = range(0, MAX_GAMMA + 1)
    for alpha in alphas:
        ax.plot(gammas, [expected_tokens(alpha, g) for g in gammas], marker=".", label=f"α = {alpha}")
    ax.set_xlabel("γ (draft length)")
    ax.set_ylabel("E[tokens per step] = (1−α^(γ+1))/(1−α)")
    ax.set_title("Expected tokens per target forward")
    ax.legend(fontsize="small")
    return _save(fig, path)


def optimal_gamma_heatmap(path: Path, verify_cost: Callable[[int], float] | None = None, steps: int = 60) -> Path:
    plt = _pyplot()
    alphas = [0.3 + 0.69 * i / (steps - 1) for i in range(steps)]
    costs = [0.005 + 0.495 * j / (steps - 1) for j in range(steps)]
    grid = [[optimal_gamma(a, c, MAX_GAMMA, verify_cost) for a in alphas] for c in costs]  # rows: c
    fig, ax = plt.subplots(figsize=(6, 4.5))
    image = ax.imshow(grid, origin="lower", aspect="auto", cmap="viridis",
                      extent=(alphas[0], alphas[-1], costs[0], costs[-1]))
    fig.colorbar(image, ax=ax, label="optimal γ")
    ax.set_xlabel("α (acceptance rate)")
    ax.set_ylabel("c (draft / target cost)")
    ax.set_title("Optimal γ" + (" (measured verification cost)" if verify_cost else ""))
    return _save(fig, path)


def write_theory_plots(folder: Path, verify_cost: Callable[[int], float] | None = None) -> list[Path]:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return [expected_tokens_plot(folder / "expected_tokens.png"), optimal_gamma_heatmap(folder / "optimal_gamma.png", verify_cost)]
