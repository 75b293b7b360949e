"""The host's work for one token-tree step's shape, apart from any model: cut to γ, depth, layout (positions and the
tree attention mask), greedy verification — what every tree step pays on the CPU before and after its forward.

On a GPU, where a replayed step is a few milliseconds (BENCHMARKS.md, "GPU"), this is added to every tree step. Random
trees of --nodes nodes (each node's parent drawn among the earlier ones), µs a step (median of --rounds rounds of --steps).
Another checkout's code: PYTHONPATH=<checkout>/src.

    .venv/bin/python benchmarks/probes/tree_host.py --nodes 16,32,48
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from verispec.engine.shapes import shape_of
from verispec.paths import cpu_summary
from verispec.types import Draft
from verispec.verify import verify_tree_greedy


def random_tree(nodes: int, seed: int) -> Draft:
    rng = random.Random(seed)
    parents = [-1] + [rng.randrange(-1, node) for node in range(1, nodes)]
    return Draft(torch.randint(0, 1000, (nodes,)), None, torch.tensor(parents))


def step(draft: Draft, target: torch.Tensor) -> None:
    """What the engine does with a tree's shape in one step (`engine/loop.py`: plan, commit, record, policy)."""
    shape = shape_of(draft).cut(12, None)
    shape.layout(100)
    verdict = verify_tree_greedy(shape.draft.tokens, shape.draft.parents, target)
    shape.depth, verdict.path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="16,32,48")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(cpu_summary(), flush=True)
    for nodes in map(int, args.nodes.split(",")):
        draft, target = random_tree(nodes, seed=nodes), torch.randint(0, 1000, (nodes + 1,))
        step(draft, target)
        rounds = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            for _ in range(args.steps):
                step(draft, target)
            rounds.append((time.perf_counter() - start) / args.steps * 1e6)
        print(f"{nodes:>3} nodes: {statistics.median(rounds):7.0f} µs a step", flush=True)


if __name__ == "__main__":
    main()
