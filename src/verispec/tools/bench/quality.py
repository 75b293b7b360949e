"""How close a model in one precision is to the same model in another: `verispec quality`.

Speculative decoding on the int8 path is exact with respect to the int8 model; this command says how
far that model is from the float32 one it was quantized from (the GGUF dequantized to float32). For
every prompt of the chosen set (the `own` development prompts by default, chat-templated):

  1. greedy plain decoding of both models, --max-new-tokens tokens each;
  2. the reference's greedy continuation fed to both models in one forward pass (teacher forcing),
     giving both next-token distributions at every generated position.

Reported, per category and overall:
  identical_outputs   share of prompts whose greedy outputs are token-identical;
  common_prefix       mean share of the reference's output both greedy outputs share from the start;
  top1_agreement      share of teacher-forced positions where both models' argmax tokens agree;
  mean_kl             mean KL(reference ‖ tested) in nats over teacher-forced positions
                      (also its median and max).

    verispec quality --target qwen2.5-coder-1.5b-instruct --dtype int8 --reference float32 --json q.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from verispec.tools.bench.prompts import Prompt
from verispec.tools.bench.questions import load_sources, select
from verispec.engine import Engine, GenerationConfig
from verispec.errors import InvalidParameterError
from verispec.models.loading import PRECISIONS, load_model
from verispec.models.runner import LoadedModel
from verispec.models.registry import DEFAULT_TARGET
from verispec.paths import cpu_summary

__all__ = ["PromptQuality", "compare_prompt", "summarize_quality", "add_arguments", "run"]


@dataclass
class PromptQuality:
    prompt: str
    category: str
    new_tokens: int  # length of the reference's greedy output
    identical: bool
    common_prefix: int  # tokens both greedy outputs share from the start
    top1_agreement: float
    kl: list[float]  # KL(reference ‖ tested) per teacher-forced position, nats


def _teacher_forced_log_probs(model: LoadedModel, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """log-softmax of the next-token logits at each output position: [len(output_ids), vocab]."""
    sequence = torch.tensor(prompt_ids + output_ids[:-1])  # the last output token predicts nothing we compare
    logits = model.runner.forward(model.runner.new_cache(len(sequence) + 1), sequence, logits="all")  # [L, vocab]
    return logits[len(prompt_ids) - 1 :].float().log_softmax(dim=-1)


def compare_prompt(reference: LoadedModel, tested: LoadedModel, prompt: Prompt, prompt_ids: list[int],
                   max_new_tokens: int) -> PromptQuality:
    config = GenerationConfig(max_new_tokens=max_new_tokens)
    ref_out = list(Engine(reference, None).generate(prompt_ids, config).token_ids)
    test_out = list(Engine(tested, None).generate(prompt_ids, config).token_ids)
    prefix = 0
    for a, b in zip(ref_out, test_out):
        if a != b:
            break
        prefix += 1
    ref_logp = _teacher_forced_log_probs(reference, prompt_ids, ref_out)  # [n, vocab]
    test_logp = _teacher_forced_log_probs(tested, prompt_ids, ref_out)  # [n, vocab]
    kl = (ref_logp.exp() * (ref_logp - test_logp)).sum(dim=-1)  # [n]
    agree = (ref_logp.argmax(dim=-1) == test_logp.argmax(dim=-1)).float().mean()
    return PromptQuality(prompt.name, prompt.category, len(ref_out), ref_out == test_out, prefix,
                         float(agree), [round(float(v), 6) for v in kl])


def _aggregate(items: list[PromptQuality]) -> dict:
    kls = [v for item in items for v in item.kl]
    positions = sum(len(item.kl) for item in items)
    return {
        "prompts": len(items),
        "positions": positions,
        "identical_outputs": sum(item.identical for item in items) / len(items),
        "common_prefix": statistics.mean(item.common_prefix / max(item.new_tokens, 1) for item in items),
        "top1_agreement": sum(item.top1_agreement * len(item.kl) for item in items) / max(positions, 1),
        "mean_kl": statistics.mean(kls) if kls else 0.0,
        "median_kl": statistics.median(kls) if kls else 0.0,
        "max_kl": max(kls) if kls else 0.0,
    }


def summarize_quality(items: list[PromptQuality]) -> dict:
    """Overall and per-category aggregates of `compare_prompt` results."""
    categories = list(dict.fromkeys(item.category for item in items))
    return {"overall": _aggregate(items),
            "per_category": {c: _aggregate([i for i in items if i.category == c]) for c in categories}}


def markdown(summary: dict, reference: str, tested: str) -> str:
    lines = [f"quality of {tested} against {reference} (greedy; KL(reference ‖ tested) in nats, teacher-forced)", "",
             "| group | prompts | positions | identical outputs | common prefix | top-1 agreement | mean KL | median KL | max KL |",
             "|---|---|---|---|---|---|---|---|---|"]
    rows = [("overall", summary["overall"]), *summary["per_category"].items()]
    for name, s in rows:
        lines.append(f"| {name} | {s['prompts']} | {s['positions']} | {s['identical_outputs']:.2f} | {s['common_prefix']:.2f} | "
                     f"{s['top1_agreement']:.3f} | {s['mean_kl']:.4f} | {s['median_kl']:.4f} | {s['max_kl']:.3f} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=DEFAULT_TARGET, help="shipped model name, HF folder or .gguf path")
    parser.add_argument("--dtype", default="int8", choices=PRECISIONS, help="the precision tested (default int8)")
    parser.add_argument("--reference", default="float32", choices=PRECISIONS, help="the precision compared against")
    parser.add_argument("--questions", default="own", metavar="SOURCES", help="prompt sources as in `verispec bench`")
    parser.add_argument("--per-category", type=int, default=None, help="first N prompts of each category")
    parser.add_argument("--categories", default=None, help="comma list of categories to keep")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--raw", action="store_true", help="do not apply the chat template (tiny test models)")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the summary and per-prompt results")


def run(args: argparse.Namespace) -> int:
    if args.dtype == args.reference:
        raise InvalidParameterError(f"--dtype and --reference are both {args.dtype}: compare two different precisions")
    if args.max_new_tokens < 1:
        raise InvalidParameterError("--max-new-tokens must be ≥ 1")
    categories = [c.strip() for c in args.categories.split(",")] if args.categories else None
    prompts = select(load_sources(args.questions), categories, args.per_category)
    reference = load_model(args.target, args.reference)
    tested = load_model(args.target, args.dtype)
    items = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = reference.encode_prompt(prompt.text, chat=not args.raw)
            items.append(compare_prompt(reference, tested, prompt, ids, args.max_new_tokens))
    summary = summarize_quality(items)
    print(f"on {cpu_summary()}")
    print(markdown(summary, f"{args.target} {args.reference}", f"{args.target} {args.dtype}"))
    if args.json:
        config = {"target": args.target, "dtype": args.dtype, "reference": args.reference, "questions": args.questions,
                  "max_new_tokens": args.max_new_tokens, "threads": torch.get_num_threads(), "torch": torch.__version__,
                  "cpu": cpu_summary()}
        args.json.write_text(json.dumps({"config": config, "summary": summary, "prompts": [asdict(i) for i in items]}, indent=1))
    return 0
