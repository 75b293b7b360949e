"""What one prompt-lookup draft costs as the context grows: verispec's index against HF's scan.

`python -m verispec.tools.bench.lookup --lengths 1024,4096,16384` builds a long document (the long-context
task text of `verispec.tools.bench.longctx`, under the target's tokenizer) and, at each length, times
`steps` decoding steps of each drafter: one committed token more, then a proposal of `gamma` tokens.
verispec's n-gram session checks that the sequence still extends the indexed one (a C-speed list
comparison: what makes rollbacks safe, and the one part linear in the length), indexes the new token
and looks the suffix up in a dict; Hugging Face's
`PromptLookupCandidateGenerator.get_candidates` (what `generate(prompt_lookup_num_tokens=…)` calls
each step) scans the whole sequence for the suffix. Prints the median and 99th percentile in µs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from verispec.tools.bench.longctx import make_document
from verispec.drafters import NgramDrafter
from verispec.models.loading import load_tokenizer, resolve_folder
from verispec.models.registry import DEFAULT_TARGET
from verispec.sampling.processors import SamplingParams
from verispec.paths import cpu_summary

__all__ = ["time_lookups", "main"]


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def _ngram_step(ids: list[int], gamma: int, steps: int):
    """A timer per step for a verispec n-gram session already indexed up to `ids[:len(ids) - steps]`."""
    session = NgramDrafter().start(ids)
    params, start = SamplingParams(), len(ids) - steps
    session.propose(ids[:start], gamma, params, None)  # index the prompt: once per request, not per step
    sequences = [ids[: start + i + 1] for i in range(steps)]  # sliced before timing (the engine keeps a list)
    return lambda i: session.propose(sequences[i], gamma, params, None)


def _hf_step(ids: list[int], gamma: int, steps: int):
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    generator = PromptLookupCandidateGenerator(num_output_tokens=gamma, max_matching_ngram_size=3, max_length=len(ids) + gamma + 2)
    tensor, start = torch.tensor([ids]), len(ids) - steps  # [1, length]
    return lambda i: generator.get_candidates(tensor[:, : start + i + 1])


def time_lookups(ids: list[int], lengths: list[int], steps: int = 200, gamma: int = 10) -> list[dict]:
    """Per length and method: median and p99 µs of one step (a committed token, then a proposal)."""
    rows = []
    for length in lengths:
        context = ids[:length]
        for method, make in (("verispec ngram (index)", _ngram_step), ("HF prompt lookup (scan)", _hf_step)):
            step, seconds = make(context, gamma, steps), []
            for i in range(steps):
                began = time.perf_counter()
                step(i)
                seconds.append(time.perf_counter() - began)
            rows.append({"length": len(context), "method": method, "median_us": statistics.median(seconds) * 1e6,
                         "p99_us": _percentile(seconds, 0.99) * 1e6})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,4096,16384", help="context lengths in tokens (comma list)")
    parser.add_argument("--steps", type=int, default=200, help="decoding steps timed per length and method")
    parser.add_argument("--gamma", type=int, default=10, help="tokens per proposal (HF's default is 10)")
    parser.add_argument("--target", default=DEFAULT_TARGET, help="whose tokenizer encodes the document")
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.steps < 1 or min(lengths) <= args.steps:
        parser.error("need --steps ≥ 1 and every length above --steps")

    tokenizer = load_tokenizer(resolve_folder(args.target))
    document, _ = make_document(max(lengths) + 64, tokenizer)
    ids = tokenizer(document)["input_ids"]
    table = Table("context tokens", "method", "median µs/step", "p99 µs/step")
    for row in time_lookups(ids, lengths, args.steps, args.gamma):
        table.add_row(str(row["length"]), row["method"], f"{row['median_us']:.1f}", f"{row['p99_us']:.1f}")
    Console().print(f"on {cpu_summary()}")
    Console().print(table)


if __name__ == "__main__":
    main()
