"""Where `hybrid`'s steps come from and what its draft costs: the numbers the plan's hybrid candidate rests on.

For each drafter spec in --specs the shipped target (kquant) generates every prompt of --questions /
--categories (greedy, `auto` γ policy) and the probe prints tok/s, steps, prefill / target / draft seconds, and
for a `hybrid` its steps and draft tokens by source (prompt lookup or its draft model; `min_rate` shutting
lookup out shows as few lookup steps). For `ngram` it prints the share of steps that drafted nothing: what
`plan.LOOKUP_EMPTY` gives to hybrid's draft. Then the draft model of the first hybrid spec: its single-token
forward timed alone, and in turns with the target (`interleaved_token_seconds`: c as the plan times it), and its
prefill per token over a 700-token prompt.

    python benchmarks/probes/hybrid_sources.py --questions question.jsonl,humaneval --categories summarization \
        --specs ngram,hybrid:draft=smollm2-135m-instruct,hybrid:draft=smollm2-135m-instruct,min_rate=30
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

from verispec import GenerationConfig, load
from verispec.control.costs import interleaved_token_seconds
from verispec.drafters import hybrid
from verispec.paths import cpu_summary
from verispec.tools.bench.questions import load_sources, select

sources: Counter = Counter()  # (source, "steps" | "tokens" | "seconds") -> total, over the timed prompts


def counted(propose):
    """`_HybridSession.propose`, its steps, tokens and seconds added up by the source it took."""
    def wrapper(self, ids, gamma, params, generator):
        start = time.perf_counter()
        draft = propose(self, ids, gamma, params, generator)
        source = self.last[0]
        sources[source, "steps"] += 1
        sources[source, "tokens"] += len(draft.tokens)
        sources[source, "seconds"] += time.perf_counter() - start
        return draft
    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", default="own")
    parser.add_argument("--categories", default=None, help="comma list (default all)")
    parser.add_argument("--per-category", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--specs", default="ngram,hybrid:draft=smollm2-135m-instruct")
    args = parser.parse_args()
    categories = args.categories.split(",") if args.categories else None
    prompts = [p.text for p in select(load_sources(args.questions), categories, args.per_category)]
    print(f"{cpu_summary()} · {len(prompts)} prompts · {args.max_new_tokens} new tokens, greedy, kquant")
    hybrid._HybridSession.propose = counted(hybrid._HybridSession.propose)
    # specs hold commas of their own: a new spec starts at a drafter kind
    specs = []
    for part in args.specs.split(","):
        if specs and "=" in part and ":" not in part:
            specs[-1] += "," + part
        else:
            specs.append(part)
    draft_engine = None
    for spec in specs:
        engine = load(draft=spec, dtype="kquant", gamma_policy="auto")
        engine.generate("Say hi.", GenerationConfig(max_new_tokens=8))  # warm-up, not counted
        sources.clear()
        total, offered = Counter(), 0
        for prompt in prompts:
            stats = engine.generate(prompt, GenerationConfig(max_new_tokens=args.max_new_tokens)).stats
            for name in ("wall_seconds", "new_tokens", "steps", "prefill_seconds", "target_seconds", "draft_seconds"):
                total[name] += getattr(stats, name)
            offered += sum(record.proposed > 0 for record in stats.records)
        line = (f"{spec}: {total['new_tokens'] / total['wall_seconds']:.2f} tok/s · {total['steps']} steps · prefill "
                f"{total['prefill_seconds']:.2f} s, target {total['target_seconds']:.2f} s, draft {total['draft_seconds']:.2f} s")
        if spec.startswith("ngram"):
            line += f" · steps drafting nothing {1 - offered / total['steps']:.2f}"
        for source in ("ngram", "model"):
            if sources[source, "steps"]:
                line += (f" · {source}: {sources[source, 'steps']} steps, {sources[source, 'tokens']} tokens, "
                         f"{sources[source, 'seconds']:.2f} s")
        print(line, flush=True)
        if spec.startswith("hybrid") and draft_engine is None:
            draft_engine = engine
    if draft_engine is not None:
        target, draft = draft_engine.target.runner, draft_engine.drafter.model.runner
        alone = interleaved_token_seconds([draft])[0]
        turns = interleaved_token_seconds([target, draft])
        start = time.perf_counter()
        draft.prefilled_cache(list(range(100, 800))).release()
        prefill = (time.perf_counter() - start) / 700
        print(f"draft {draft_engine.drafter.model.name}: a token {alone * 1e3:.2f} ms alone, {turns[1] * 1e3:.2f} ms in turns "
              f"with the target's {turns[0] * 1e3:.2f} (c {turns[1] / turns[0]:.3f}); prefill {prefill * 1e3:.3f} ms a token")


if __name__ == "__main__":
    main()
