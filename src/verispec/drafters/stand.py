"""STAND: model-free tree drafting from an n-gram table of the TARGET's own distributions.

The table maps an n-gram (n = min_n..max_n, default 2..4) to the top-10 next tokens with
probabilities. It is filled after each step from the target's processed distributions at the newly
committed positions (`DraftSession.observe`); the prompt's own continuations enter as point masses.
On a repeat sighting of an n-gram the stored distribution is blended: old × k/(k+1) + new × 1/(k+1)
(k = sightings so far), then pruned to the top 10. Lookup backs off from the longest n-gram to the
shortest. Drafting walks the table from the context, choosing children of every node from the stored
distribution (Gumbel-top-k without replacement under sampling, recorded with their exact draft
rows so verification stays lossless; the top-k under greedy decoding), extending each child's
context by its token. The table lives on the `StandDrafter` and is shared by its sessions, so it
grows across requests; `save`/`load` keep it on disk.

Default shape k=2, depth=5, wide=1: two candidates for the next token, then a chain under each
(10 nodes). `stand:nodes=N` uses the first N nodes of the shape searched by `verispec.tools.tree_search`
(the STAND paper's method: node acceptance measured on a large candidate tree, nodes ranked by it;
`drafters/stand_shape.json` records the command, and the search prints E[tokens per step] for each
prefix of the ranking). The default stays small because, with a fresh table, the expected tokens per
step barely grow past the first few nodes, while every extra position costs verification time on a
CPU where a forward's cost grows with its positions (BENCHMARKS.md#avx2-verification-cost-tn);
the paper's larger shape is `stand:nodes=80`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from verispec.drafters.base import Drafter, DraftSession
from verispec.drafters.branching import RankPath, TreeBuilder, check_paths, choose_children, fanouts, level_paths
from verispec.errors import InvalidParameterError
from verispec.types import Draft

__all__ = ["StandTable", "StandDrafter", "StandSession", "SEARCHED_SHAPE", "searched_shape"]

TOP = 10
SEARCHED_SHAPE = Path(__file__).with_name("stand_shape.json")


def _values(x) -> list:
    """A tensor's or a sequence's values as a list."""
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)


class StandTable:
    """n-gram → (sightings, top tokens [≤10], their probabilities), most probable first.

    Plain Python, not tensors: an entry is at most 20 numbers, and each step updates a few entries per
    committed token right after the target's forward, when every tensor operation runs with cold caches
    (tens of µs each; BENCHMARKS.md, "Where a step's milliseconds go")."""

    def __init__(self, max_n: int = 4, min_n: int = 2):
        if not 1 <= min_n <= max_n:
            raise InvalidParameterError(f"STAND n-gram sizes need 1 ≤ min_n ≤ max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.entries: dict[tuple[int, ...], tuple[int, tuple[int, ...], tuple[float, ...]]] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def update(self, ngram: tuple[int, ...], tokens, probs) -> None:
        """Blend one sighting (tokens [m], probs [m]: tensors or sequences) into the entry for `ngram`; keep
        the top 10 (ties: the smaller token id first)."""
        seen, old_tokens, old_probs = self.entries.get(ngram, (0, (), ()))
        merged: dict[int, float] = {}
        for token, prob in zip(old_tokens, old_probs):
            merged[token] = merged.get(token, 0.0) + prob * seen / (seen + 1)
        for token, prob in zip(_values(tokens), _values(probs)):
            merged[token] = merged.get(token, 0.0) + prob / (seen + 1)
        top = sorted(merged.items(), key=lambda item: (-item[1], item[0]))[:TOP]
        self.entries[ngram] = (seen + 1, tuple(token for token, _ in top), tuple(prob for _, prob in top))

    def observe(self, ids: list[int], target_probs: torch.Tensor) -> None:
        """target_probs [m, vocab]: the target's distribution that produced each of ids[−m:]."""
        top = torch.topk(target_probs, min(TOP, target_probs.shape[-1]), dim=-1)  # [m, 10]
        first = len(ids) - target_probs.shape[0]
        for j, (tokens, probs) in enumerate(zip(top.indices.tolist(), top.values.tolist())):
            self._update_contexts(ids, first + j, tokens, probs)

    def add_sequence(self, ids: list[int]) -> None:
        """Index a sequence's own continuations as point masses (used for prompts)."""
        for position in range(1, len(ids)):
            self._update_contexts(ids, position, (ids[position],), (1.0,))

    def _update_contexts(self, ids: list[int], position: int, tokens, probs) -> None:
        for n in range(self.min_n, min(self.max_n, position) + 1):
            self.update(tuple(ids[position - n : position]), tokens, probs)

    def lookup(self, context: list[int]) -> tuple[tuple[int, ...], tuple[float, ...]] | None:
        """(tokens, probs), most probable first, stored for the longest known suffix n-gram of `context`,
        backing off max_n → min_n."""
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            entry = self.entries.get(tuple(context[-n:]))
            if entry is not None:
                return entry[1], entry[2]
        return None

    def save(self, path: str | Path) -> None:
        rows = [[list(k), seen, list(t), list(p)] for k, (seen, t, p) in self.entries.items()]
        Path(path).write_text(json.dumps({"max_n": self.max_n, "min_n": self.min_n, "entries": rows}))

    @classmethod
    def load(cls, path: str | Path) -> StandTable:
        data = json.loads(Path(path).read_text())
        table = cls(data["max_n"], data["min_n"])
        for key, seen, tokens, probs in data["entries"]:
            table.entries[tuple(key)] = (seen, tuple(tokens), tuple(probs))
        return table


class StandDrafter(Drafter):
    """STAND drafting; the tree shape is k children at the first `wide` of `depth` levels, or the
    `nodes` most useful nodes of the searched shape (`SEARCHED_SHAPE`, see `verispec.tools.tree_search`)."""

    def __init__(self, vocab_size: int, max_n: int = 4, min_n: int = 2, k: int = 2, depth: int = 5, wide: int = 1,
                 nodes: int = 0, table: StandTable | None = None, paths=None):
        if k < 1 or depth < 1 or not 0 <= wide <= depth or nodes < 0:
            raise InvalidParameterError(f"STAND needs k ≥ 1, depth ≥ 1, 0 ≤ wide ≤ depth, nodes ≥ 0; got k={k}, "
                                        f"depth={depth}, wide={wide}, nodes={nodes}")
        self.vocab_size = vocab_size
        self.table = table if table is not None else StandTable(max_n, min_n)
        if paths is None:
            paths = searched_shape(nodes) if nodes else level_paths(k, depth, wide)
        self.paths = check_paths(paths)
        self.fanout = fanouts(self.paths)
        self.drafts_trees = any(children > 1 for children in self.fanout.values())
        shape = f"nodes={len(self.paths)}" if nodes or paths is not None else f"k={k},depth={depth}"
        self.name = f"stand:max_n={self.table.max_n},{shape}"

    def save(self, path: str | Path) -> None:
        self.table.save(path)

    def load(self, path: str | Path) -> None:
        self.table = StandTable.load(path)

    def start(self, prompt_ids: list[int]) -> StandSession:
        self.table.add_sequence(prompt_ids)
        return StandSession(self)


def searched_shape(nodes: int) -> tuple[RankPath, ...]:
    """The first `nodes` rank paths of the searched ranking (every prefix of it is a valid shape)."""
    ranking = json.loads(SEARCHED_SHAPE.read_text())["ranking"]
    if not 1 <= nodes <= len(ranking):
        raise InvalidParameterError(f"stand option nodes={nodes}: the searched shape ranks {len(ranking)} nodes; use 1…{len(ranking)}")
    return tuple(tuple(path) for path in ranking[:nodes])


class StandSession(DraftSession):
    observes_target = True

    def __init__(self, drafter: StandDrafter):
        self.drafter = drafter

    def _row(self, context: list[int]) -> torch.Tensor | None:
        """The stored distribution after `context` as a dense row [vocab], or None if unknown."""
        found = self.drafter.table.lookup(context)
        if found is None:
            return None
        row = torch.zeros(self.drafter.vocab_size).index_put_((torch.tensor(found[0]),), torch.tensor(found[1]))
        return row / row.sum()

    def _children(self, context: list[int], k: int, greedy: bool, generator) -> tuple[list[int], torch.Tensor | None]:
        """Up to k children after `context` (and their draft rows when sampling); none if the table has no entry."""
        if greedy:  # the k most probable stored tokens (stored most probable first); no dense row needed
            found = self.drafter.table.lookup(context)
            if found is None:
                return [], None
            return [token for token, prob in zip(*found) if prob > 0][:k], None
        row = self._row(context)
        return ([], None) if row is None else choose_children(row, k, False, generator)

    def grow(self, ids, gamma, params, generator) -> tuple[TreeBuilder, list[RankPath]]:
        """The draft tree, level by level down to depth γ, and each node's rank path."""
        tail, fanout = self.drafter.table.max_n, self.drafter.fanout
        builder, paths = TreeBuilder(), []
        frontier = [(-1, (), ids[-tail:])]  # (node, its rank path, its context: the last max_n tokens suffice)
        while frontier:
            grown = []
            for parent, path, context in frontier:
                k = fanout.get(path, 0) if len(path) < gamma else 0
                tokens, rows = self._children(context, k, params.greedy, generator) if k else ([], None)
                for rank, token in enumerate(tokens):
                    node = builder.add(token, parent, rows[rank] if rows is not None else None)
                    paths.append(path + (rank,))
                    grown.append((node, path + (rank,), (context + [token])[-tail:]))
            frontier = grown
        return builder, paths

    def propose(self, ids, gamma, params, generator):
        builder, _ = self.grow(ids, gamma, params, generator)
        if not len(builder):
            return Draft.empty()
        return builder.build(self.drafter.vocab_size)

    def observe(self, ids, target_probs):
        self.drafter.table.observe(ids, target_probs)
