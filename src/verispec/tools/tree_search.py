"""Search STAND's static tree shape from measured acceptance (as the STAND paper does: a large candidate tree, the best nodes kept).

Under greedy decoding a node of the draft tree is accepted exactly when its token path equals the
target's own next tokens, so node acceptance can be measured without running the target on the big
tree: take the target's greedy continuation of each prompt and its distributions at every position
(one teacher-forced forward), then replay STAND step by step with the large candidate shape — draft
the tree from the committed text, walk it along the target's continuation, commit the accepted
path plus one token, feed the table the target's distributions there — and count, per rank path,
how often the node was on the accepted path. E[tokens per step] of any sub-shape is then
1 + Σ P(node accepted) over its nodes, so the most useful shape of N nodes is the N nodes with the
highest acceptance, taken in an order that keeps every prefix a valid tree (a node only after its
parent and its lower-ranked sibling). The ranking is written to `drafters/stand_shape.json`;
`stand:nodes=N` drafts with its first N nodes.

    python -m verispec.tools.tree_search --questions own --per-category 2 --max-new-tokens 96
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch
from rich.progress import track

from verispec.tools.bench.questions import load_sources, select
from verispec.drafters import NgramDrafter
from verispec.drafters.branching import RankPath, level_paths
from verispec.drafters.stand import SEARCHED_SHAPE, StandDrafter
from verispec.engine import Engine, GenerationConfig
from verispec.tools.measure import teacher_forced_logits
from verispec.models.loading import load_model
from verispec.models.runner import LoadedModel
from verispec.models.registry import DEFAULT_TARGET
from verispec.sampling.processors import SamplingParams

__all__ = ["replay", "rank_nodes", "expected_tokens_by_size", "search", "main"]

GREEDY = SamplingParams(temperature=0.0)


def _accepted(tokens: list[int], parents: list[int], continuation: list[int]) -> list[int]:
    """Nodes on the path that follows `continuation` down the tree (greedy tree verification)."""
    path, parent = [], -1
    for token in continuation:
        child = next((i for i, (t, p) in enumerate(zip(tokens, parents)) if p == parent and t == token), None)
        if child is None:
            break
        path.append(child)
        parent = child
    return path


def replay(drafter: StandDrafter, prompt: list[int], continuation: list[int], probs: torch.Tensor, depth: int) -> tuple[Counter, int]:
    """Replay greedy STAND over the target's `continuation` of `prompt`; probs [len(continuation), vocab]
    is the target's distribution that produced each continuation token. Returns (accepted count per
    rank path, steps)."""
    ids = prompt + continuation
    session = drafter.start(prompt)
    counts: Counter = Counter()
    steps, committed = 0, len(prompt)
    while committed < len(ids):
        builder, paths = session.grow(ids[:committed], depth, GREEDY, None)
        accepted = _accepted(builder.tokens, builder.parents, ids[committed : committed + depth])
        counts.update(paths[node] for node in accepted)
        new = min(len(accepted) + 1, len(ids) - committed)
        committed += new
        steps += 1
        offset = committed - len(prompt)
        session.observe(ids[:committed], probs[offset - new : offset])  # [new, vocab]
    return counts, steps


def rank_nodes(counts: Counter, candidates: Sequence[RankPath]) -> list[RankPath]:
    """Candidate paths, most accepted first, each after its parent and its lower-ranked sibling."""
    chosen: list[RankPath] = []
    present = {()}
    remaining = set(candidates)
    while remaining:
        ready = [p for p in remaining if p[:-1] in present and (p[-1] == 0 or p[:-1] + (p[-1] - 1,) in present)]
        best = max(ready, key=lambda p: (counts[p], -len(p), [-r for r in p]))
        chosen.append(best)
        present.add(best)
        remaining.remove(best)
    return chosen


def expected_tokens_by_size(ranking: Sequence[RankPath], counts: Counter, steps: int) -> list[float]:
    """E[tokens per step] of the shape made of the first N ranked nodes, for N = 0 … len(ranking)."""
    totals = [1.0]
    for path in ranking:
        totals.append(totals[-1] + counts[path] / steps)
    return totals


def search(target: LoadedModel, prompts_ids: Sequence[list[int]], max_new_tokens: int, k: int, depth: int,
           max_n: int = 4) -> dict:
    """Measure node acceptance of the k-ary, depth-`depth` candidate tree and rank its nodes."""
    candidates = level_paths(k, depth, depth)
    engine = Engine(target, NgramDrafter(), gamma=4, gamma_policy="constant")  # greedy: the target's own text
    drafter = StandDrafter(target.vocab_size, max_n=max_n, paths=candidates)  # one table across prompts, as in a session
    counts: Counter = Counter()
    steps = 0
    for prompt in track(list(prompts_ids), description="replaying STAND on the target's continuations"):
        continuation = engine.generate(prompt, GenerationConfig(max_new_tokens=max_new_tokens)).token_ids
        logits = teacher_forced_logits(target, prompt + continuation, len(prompt))  # [len(continuation), vocab]
        more, more_steps = replay(drafter, list(prompt), continuation, torch.softmax(logits.float(), dim=-1), depth)
        counts.update(more)
        steps += more_steps
    ranking = rank_nodes(counts, candidates)
    return {
        "ranking": [list(p) for p in ranking],
        "acceptance": [round(counts[p] / steps, 5) for p in ranking],
        "expected_tokens_by_size": [round(t, 4) for t in expected_tokens_by_size(ranking, counts, steps)],
        "candidate": {"k": k, "depth": depth, "nodes": len(candidates)},
        "steps": steps,
        "prompts": len(prompts_ids),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--questions", default="own", help="prompt sources as for `verispec bench`")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=5, help="children per node in the candidate tree")
    parser.add_argument("--depth", type=int, default=4, help="depth of the candidate tree (5 and 4: 780 nodes)")
    parser.add_argument("--out", type=Path, default=SEARCHED_SHAPE)
    args = parser.parse_args(argv)

    target = load_model(args.target)
    plain = Engine(target, None)
    prompts = select(load_sources(args.questions), per_category=args.per_category)
    prompts_ids = [plain.prompt_ids(p.text) for p in prompts]
    result = search(target, prompts_ids, args.max_new_tokens, args.k, args.depth)
    result["how"] = {"command": "python -m verispec.tools.tree_search " + shlex.join(sys.argv[1:] if argv is None else argv),
                     "target": args.target, "date": datetime.date.today().isoformat(),
                     "categories": sorted({p.category for p in prompts})}
    args.out.write_text(json.dumps(result) + "\n")
    sizes = result["expected_tokens_by_size"]
    for n in (1, 2, 4, 8, 10, 16, 24, 32, 48, 64, 80, 120, len(sizes) - 1):
        if n < len(sizes):
            print(f"{n:4d} nodes: E[tokens per step] {sizes[n]:.3f}")
    print(f"{result['steps']} steps over {result['prompts']} prompts; ranking written to {args.out}")


if __name__ == "__main__":
    main()
