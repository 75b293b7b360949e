"""Seconds to the first token on long public prompts, and what the next step costs (a draft model's prefill and a step).

Loads an engine (`--draft`, `--dtype`; the plan's defaults where omitted: `load()`), warms it on a short prompt, then
for each prompt of --questions / --categories times `engine.start` (the prefill: the first token is known when it
returns) and the first two `step()` calls (the first hands the first token out; the second reads the prompt into a
draft model, where there is one, then drafts and verifies). The API it uses is older than this probe, so the file
runs on earlier revisions of the repository too (to time a change to the first token).

    python benchmarks/probes/first_token.py --questions question.jsonl --categories summarization,rag --per-category 2 \
        --draft hybrid:draft=smollm2-135m-instruct --dtype kquant
"""

from __future__ import annotations

import argparse
import time

from verispec import GenerationConfig, load
from verispec.paths import cpu_summary
from verispec.tools.bench.questions import load_sources, select


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", default="own")
    parser.add_argument("--categories", default=None, help="comma list (default all)")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--draft", default="auto")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    categories = args.categories.split(",") if args.categories else None
    prompts = [p.text for p in select(load_sources(args.questions), categories, args.per_category)]
    engine = load(draft=args.draft, dtype=args.dtype, gamma_policy="auto")
    engine.generate("Say hi.", GenerationConfig(max_new_tokens=4))  # warm-up, not counted
    print(f"{cpu_summary()} · draft {args.draft} · {args.dtype} · per prompt: tokens, to the first token, the next "
          "two steps (s)")
    firsts = []
    for prompt in prompts:
        began = time.perf_counter()
        generation = engine.start(prompt, GenerationConfig(max_new_tokens=8))
        first = time.perf_counter() - began
        laps = []
        for _ in range(2):
            lap = time.perf_counter()
            generation.step()
            laps.append(time.perf_counter() - lap)
        generation.close()
        firsts.append(first)
        print(f"{len(generation.ids) - len(generation.output_ids)} tokens: {first:.2f} · {laps[0]:.3f} · {laps[1]:.2f}", flush=True)
    print(f"to the first token, mean {sum(firsts) / len(firsts):.2f} s")


if __name__ == "__main__":
    main()
