"""τ of prompt lookup as a chain against as a token tree (`ngram:nodes=N`), through the engine on real prompts.

Acceptance does not depend on the device, so τ measured here on a CPU, times the T(n)/T(1) a GPU measured
(`benchmarks/gpu/measure.py`), predicts what the tree gains there. Greedy, constant γ, the same prompts for every
method; prints τ, the mean depth and size of a step's draft and how many outputs equal plain decoding's.

    .venv/bin/python benchmarks/probes/ngram_tree.py --target smollm2-135m-instruct --questions question.jsonl,humaneval

With VERISPEC_CUDA_GRAPHS=everywhere the runner replays its steps (eagerly on a CPU), so greedy prompt lookup takes
the device's steps (`engine/device_steps.py`: `ngram:nodes=N` a tree of N // γ unmerged branches); a method written
`host:SPEC` runs through the host's steps (its merged tree) in the same process:

    VERISPEC_CUDA_GRAPHS=everywhere .venv/bin/python benchmarks/probes/ngram_tree.py \
        --methods none,ngram,host:ngram:nodes=32,ngram:nodes=32,ngram:nodes=48,ngram:nodes=63
"""

from __future__ import annotations

import argparse
import os

from verispec.drafters.specs import split_specs
from verispec.engine.build import EngineBuilder
from verispec.engine.loop import GenerationConfig
from verispec.paths import cpu_summary
from verispec.tools.bench.questions import encoded_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32", help="a precision whose runner verifies token trees")
    parser.add_argument("--questions", default="question.jsonl,humaneval")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--gamma", type=int, default=12)
    parser.add_argument("--methods", default="none,ngram,ngram:nodes=16,ngram:nodes=32")
    args = parser.parse_args()
    print(cpu_summary(), flush=True)
    builder = EngineBuilder(args.target, args.dtype)
    prompts = encoded_prompts(builder.target(), args.questions, args.per_category)
    config, plain = GenerationConfig(max_new_tokens=args.max_new_tokens), None
    for method in split_specs(args.methods):
        host = method.startswith("host:")
        engine = builder.engine(method.removeprefix("host:"), args.gamma, "constant")
        os.environ["VERISPEC_DEVICE_STEPS"] = "0" if host else "1"
        results = [engine.generate(prompt, config) for prompt in prompts]
        tokens, steps = (sum(getattr(r.stats, field) for r in results) for field in ("new_tokens", "steps"))
        records = [record for r in results for record in r.stats.records]
        depth = sum(record.proposed for record in records)  # a tree's: its longest path
        width = sum(record.proposed if record.width is None else record.width for record in records)  # a tree's: nodes
        outputs = [r.token_ids for r in results]
        plain = plain or outputs
        same = sum(a == b for a, b in zip(outputs, plain))
        print(f"{method:<16} τ {tokens / steps:.3f}  mean depth {depth / steps:.1f}, drafted {width / steps:.1f}"
              f"  = plain {same}/{len(prompts)}", flush=True)


if __name__ == "__main__":
    main()
