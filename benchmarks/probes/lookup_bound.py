"""How far prompt lookup could go: it replayed on a benchmark's plain greedy outputs, with free verification.

Greedy output does not depend on what was drafted, so replaying a drafter over the plain output gives its exact
acceptance at every step. Prints τ (tokens per target forward, = the speedup over plain decoding if verifying and
drafting cost nothing) overall and per task group for: the chain verispec drafts (`ngram`, latest longest match, up
to γ tokens) and a token tree of the continuations of every earlier match of the last 3, 2, 1 tokens (up to
`--nodes` nodes, `--depth` deep), an upper bound for any tree built from the sequence. Then, per length of the
suffix the lookup matched (1, 2, ≥ 3: the classes prompt lookup hints to the γ policy), how often the first j
drafted tokens were all right: where `drafters/ngram.py`'s MATCH_PRIORS come from.

    python benchmarks/probes/lookup_bound.py bench.json --questions question.jsonl,humaneval   # a `verispec bench --json` run
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

from verispec.drafters.ngram import NgramDrafter
from verispec.models.loading import load_model
from verispec.tools.bench.questions import encoded_prompts


def replay(prompt: list[int], output: list[int], draft) -> int:
    """Target forwards to produce `output` when each step verifies draft(ids, k) (a set of token paths)."""
    done = steps = 0
    while done < len(output):
        paths = draft(prompt + output[:done], len(output) - done - 1)
        accepted = 0
        while accepted < len(output) - done - 1 and tuple(output[done : done + accepted + 1]) in paths:
            accepted += 1
        done, steps = done + accepted + 1, steps + 1
    return steps


def chain(gamma: int):
    session = NgramDrafter().start([])  # verispec's `ngram`

    def draft(ids: list[int], room: int) -> set[tuple[int, ...]]:
        tokens, _ = session.lookup(ids, min(gamma, room))
        return {tuple(tokens[: i + 1]) for i in range(len(tokens))}
    return draft


def tree(nodes: int, depth: int):
    def draft(ids: list[int], room: int) -> set[tuple[int, ...]]:
        paths: set[tuple[int, ...]] = set()
        for n in (3, 2, 1):
            suffix = ids[-n:]
            for i in range(len(ids) - n - 1, -1, -1):  # every earlier match, latest first
                if ids[i : i + n] == suffix:
                    for j in range(1, min(depth, room) + 1):
                        if len(paths) >= nodes:
                            return paths
                        paths.add(tuple(ids[i + n : i + n + j]))
        return paths
    return draft


def by_match_length(cases: list[tuple[str, list[int], list[int]]], longest: int = 4) -> dict[int, list[int]]:
    """Per matched suffix length (capped at 3): [positions, positions whose first 1 … `longest` drafted tokens were right]."""
    counts: dict[int, list[int]] = defaultdict(lambda: [0] * (longest + 1))
    for _, prompt, output in cases:
        session = NgramDrafter().start([])
        for done in range(len(output) - 1):
            tokens, matched = session.lookup(prompt + output[:done], longest)
            if matched:
                right = next((j for j, (a, b) in enumerate(zip(tokens, output[done:])) if a != b), min(len(tokens), len(output) - done))
                row = counts[min(matched, 3)]
                row[0] += 1
                for j in range(1, right + 1):
                    row[j] += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench", help="a `verispec bench --json` file with a plain method's runs")
    parser.add_argument("--questions", default="question.jsonl,humaneval", help="the run's --questions")
    parser.add_argument("--method", default="vs:none[kquant]", help="the plain method whose outputs to replay")
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--depth", type=int, default=12)
    args = parser.parse_args()
    run = json.load(open(args.bench))
    target = load_model(run["config"]["target"], "gguf")  # its tokenizer and chat template: the ids the run fed
    prompts = dict(zip(run["config"]["prompts"], encoded_prompts(target, args.questions, run["config"]["per_category"])))
    cases = []
    for record in (r for r in run["runs"] if r["method"] == args.method):
        output = record["token_ids"] if isinstance(record["token_ids"], list) else json.loads(record["token_ids"])
        cases.append((record["category"], prompts[record["prompt"]], output))
    rules = {f"chain γ ≤ {g}": lambda g=g: chain(g) for g in (1, 4, 8, 12)}
    rules[f"tree ≤ {args.nodes} nodes"] = lambda: tree(args.nodes, args.depth)
    for name, make in rules.items():
        tokens, steps = defaultdict(int), defaultdict(int)
        for category, prompt, output in cases:
            tokens[category] += len(output)
            steps[category] += replay(prompt, output, make())
        groups = " ".join(f"{c} {tokens[c] / steps[c]:.2f}" for c in tokens)
        print(f"{name}: τ {sum(tokens.values()) / sum(steps.values()):.3f} ({groups})", flush=True)
    for matched, (positions, *right) in sorted(by_match_length(cases).items()):
        shares = " ".join(f"{count / positions:.2f}" for count in right)
        print(f"matched {matched}{'+' if matched == 3 else ''} tokens: {positions} positions, first 1…{len(right)} drafted right: {shares}")


if __name__ == "__main__":
    main()
