"""A stream of same-domain requests through a frozen draft and an online (distilling) one, side by side.

`python -m verispec.tools.bench.online --requests 24 --max-new-tokens 64` takes the first N prompts of a
source (HumanEval by default: one domain, different functions), and for each request runs the
frozen draft model and the online drafter (`verispec.drafters.online`) on the same prompt, one right after
the other (so tokens/s are compared on the same machine state). Both must give the same greedy
text as each other (both are the target's). It prints α and tokens/s per request, the online
drafter's version and events, and plots α (raw and running mean) against the request index.
`--passes 2` sends the stream twice (a stream of repeated topics).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.progress import track
from rich.table import Table

from verispec.tools.bench.questions import load_sources
from verispec.engine import Engine, EngineBuilder, GenerationConfig
from verispec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET
from verispec.drafters.online import OnlineDrafter
from verispec.paths import cpu_summary

__all__ = ["run_stream", "plot_stream", "main"]


def run_stream(frozen: Engine, online: Engine, prompts: list[str], max_new_tokens: int) -> list[dict]:
    """One row per request: α, τ and tokens/s of each engine, the online version after it."""
    config = GenerationConfig(max_new_tokens=max_new_tokens)
    drafter: OnlineDrafter = online.drafter
    rows = []
    for index, prompt in enumerate(track(prompts, description="requests")):
        trainings = drafter.trainings
        a, b = frozen.generate(prompt, config), online.generate(prompt, config)
        rows.append({
            "request": index,
            "frozen_alpha": round(a.stats.acceptance_rate, 4), "online_alpha": round(b.stats.acceptance_rate, 4),
            "frozen_tau": round(a.stats.mean_accepted_length, 3), "online_tau": round(b.stats.mean_accepted_length, 3),
            "frozen_tok_s": round(a.stats.tokens_per_second, 3), "online_tok_s": round(b.stats.tokens_per_second, 3),
            # the online drafter trains when a request starts, so its training time is in its prefill
            "frozen_prefill_s": round(a.stats.prefill_seconds, 2), "online_prefill_s": round(b.stats.prefill_seconds, 2),
            "online_version": drafter.version, "same_text": a.token_ids == b.token_ids, "new_tokens": b.stats.new_tokens,
            "trained": drafter.trainings > trainings,  # this request started with an update (kept or not)
        })
    return rows


def _running_mean(values: list[float], window: int) -> list[float]:
    return [sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def plot_stream(rows: list[dict], path: Path, window: int = 6) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(7, 6.5), sharex=True)
    x = [r["request"] for r in rows]
    for ax, metric, label in ((axes[0], "alpha", "α (acceptance rate)"), (axes[1], "tok_s", "tokens/s")):
        for kind, colour in (("frozen", "tab:grey"), ("online", "tab:green")):
            values = [r[f"{kind}_{metric}"] for r in rows]
            ax.plot(x, values, "o", color=colour, alpha=0.35, markersize=4)
            ax.plot(x, _running_mean(values, window), "-", color=colour, label=f"{kind} draft (running mean of {window})")
        ax.set_ylabel(label)
    trained = [r["request"] for r in rows if r["trained"]]
    for request in trained:  # a training makes its request start late (it runs before the prefill)
        axes[1].axvline(request, color="tab:red", alpha=0.25, linewidth=4)
    axes[1].set_xlabel("request" + (" (red: started with a training)" if trained else ""))
    axes[0].set_title("online distillation: α and tokens/s over a stream of requests")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="humaneval", help="prompt source: humaneval, own or a JSONL question file")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--passes", type=int, default=1,
                        help="send the stream this many times (repeated topics: the same requests again)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    parser.add_argument("--online", default="online:rank=16,buffer_size=48,steps=60,eval_requests=3", help="online drafter spec")
    parser.add_argument("--frozen", default=None, help="the frozen drafter it is compared with (default: model:DRAFT; "
                        "for --online online:self_layers=L use self:layers=L)")
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("bench-results/online"))
    args = parser.parse_args(argv)

    builder = EngineBuilder(args.target, default_draft=args.draft)
    frozen = builder.engine(args.frozen or f"model:{args.draft}", args.gamma, "constant")
    online = builder.engine(args.online, args.gamma, "constant")
    if args.passes < 1 or args.requests < 1:
        parser.error("--requests and --passes must be at least 1")
    prompts = [p.text for p in load_sources(args.source)][: args.requests] * args.passes
    rows = run_stream(frozen, online, prompts, args.max_new_tokens)

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "stream.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "cpu": cpu_summary(), "rows": rows,
                                                      "events": online.drafter.events}, indent=1))
    plot = plot_stream(rows, args.out / "online_alpha.png")
    table = Table("requests", "frozen α", "online α", "frozen tok/s", "online tok/s", "online ×")
    half = len(rows) // 2
    for name, part in (("first half", rows[:half]), ("second half", rows[half:]), ("all", rows)):
        if part:
            table.add_row(f"{name} ({len(part)})", f"{_mean(part, 'frozen_alpha'):.3f}", f"{_mean(part, 'online_alpha'):.3f}",
                          f"{_mean(part, 'frozen_tok_s'):.2f}", f"{_mean(part, 'online_tok_s'):.2f}",
                          f"{_mean(part, 'online_tok_s') / _mean(part, 'frozen_tok_s'):.2f}")
    console = Console()
    console.print(f"on {cpu_summary()}")
    console.print(table)
    console.print(f"same text in {sum(r['same_text'] for r in rows)}/{len(rows)} requests; online events:")
    for event in online.drafter.events:
        console.print(f"  {event}")
    console.print(f"plot: {plot}; rows: {args.out / 'stream.json'}")


if __name__ == "__main__":
    main()
