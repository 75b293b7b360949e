"""Building draft trees: choose a node's children, assemble nodes into a `Draft`, static tree shapes.

Children of a node come from its draft distribution [vocab]: the top-k under greedy decoding
(deterministic, no probabilities), k distinct Gumbel-top-k draws under sampling, each recorded with
the exact distribution it was drawn from (the node's distribution minus the earlier siblings), which
is what tree verification needs to stay lossless. A static tree shape is either a child count per
depth (`static_shape`) or any prefix-closed set of rank paths (`fanouts` reads it), such as the one
`verispec.tools.tree_search` keeps from measured acceptance.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from verispec.errors import InvalidParameterError
from verispec.sampling.processors import Penalties, SamplingParams, adjusted, to_probs
from verispec.sampling.samplers import gumbel_topk, without_replacement_probs
from verispec.types import Draft

__all__ = ["MAX_TREE_NODES", "choose_children", "node_distributions", "TreeBuilder", "static_shape", "RankPath",
           "level_paths", "fanouts", "check_paths"]

MAX_TREE_NODES = 256  # draft tokens one token tree may hold (the target scores them all in one pass)

RankPath = tuple[int, ...]  # a node by the ranks of the children taken from the root: (0, 1) = best, then second best


def node_distributions(
    logits: torch.Tensor, params: SamplingParams, seen: Penalties | None, vocab_size: int
) -> torch.Tensor:
    """logits [n, draft_vocab] -> [n, vocab_size] distributions to choose children from: the sampling
    distribution (same processing as the target) or, under greedy decoding, the softmax after the logit
    bias and the penalties (only its order matters there). Padded with zeros to the target's vocabulary."""
    if params.greedy:
        probs = torch.softmax(adjusted(logits, params, seen).float(), dim=-1)
    else:
        probs = to_probs(logits, params, seen)
    return F.pad(probs, (0, vocab_size - probs.shape[-1])) if probs.shape[-1] < vocab_size else probs


def static_shape(k: int, depth: int, wide: int) -> tuple[int, ...]:
    """Children per node at each depth: k for the first `wide` depths, then 1 (chains under a bush)."""
    return tuple(k if level < wide else 1 for level in range(depth))


def level_paths(k: int, depth: int, wide: int) -> tuple[RankPath, ...]:
    """Every node of `static_shape(k, depth, wide)` as a rank path, level by level."""
    paths: list[RankPath] = []
    frontier: list[RankPath] = [()]
    for children in static_shape(k, depth, wide):
        frontier = [path + (rank,) for path in frontier for rank in range(children)]
        paths += frontier
    return tuple(paths)


def check_paths(paths) -> tuple[RankPath, ...]:
    """`paths` as rank-path tuples, refused unless every node's parent and lower-ranked siblings are in it."""
    shape = tuple(tuple(int(r) for r in path) for path in paths)
    present = set(shape) | {()}
    for path in shape:
        if not path or min(path) < 0 or path[:-1] not in present or (path[-1] and path[:-1] + (path[-1] - 1,) not in present):
            raise InvalidParameterError(f"tree shape node {list(path)} lacks its parent or a lower-ranked sibling")
    return shape


def fanouts(paths) -> dict[RankPath, int]:
    """How many children to draw below each node (the root is ()), from a checked set of rank paths."""
    children: dict[RankPath, int] = {}
    for path in paths:
        children[path[:-1]] = max(children.get(path[:-1], 0), path[-1] + 1)
    return children


def choose_children(
    draft_probs: torch.Tensor, k: int, greedy: bool, generator: torch.Generator | None
) -> tuple[list[int], torch.Tensor | None]:
    """draft_probs [vocab] -> (up to k distinct tokens, their draft rows [k', vocab] or None when greedy)."""
    k = min(k, int((draft_probs > 0).sum()))
    if k == 0:
        return [], None
    if greedy:
        return torch.topk(draft_probs, k).indices.tolist(), None
    tokens = gumbel_topk(draft_probs.log()[None], k, generator)[0]  # [k]
    return tokens.tolist(), without_replacement_probs(draft_probs, tokens)


class TreeBuilder:
    """Collects nodes (token, parent, draft row or None) in topological order and makes a `Draft`.

    A node added with no row is deterministic; in a tree that mixes both kinds it becomes a one-hot row.
    `find(parent, token)` returns an existing deterministic child, for merging chains by shared prefix.
    """

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.rows: list[torch.Tensor | None] = []
        self._deterministic: dict[tuple[int, int], int] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, row: torch.Tensor | None = None) -> int:
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.rows.append(row)
        node = len(self.tokens) - 1
        if row is None:
            self._deterministic.setdefault((parent, int(token)), node)
        return node

    def find(self, parent: int, token: int) -> int | None:
        return self._deterministic.get((parent, int(token)))

    def add_chain(self, tokens: list[int], rows: torch.Tensor | None = None, parent: int = -1) -> None:
        """Append a chain below `parent`; deterministic nodes reuse an existing identical path."""
        for i, token in enumerate(tokens):
            row = rows[i] if rows is not None else None
            existing = self.find(parent, token) if row is None else None
            parent = existing if existing is not None else self.add(token, parent, row)

    def add_draft(self, draft: Draft, gamma: int) -> None:
        """Append a drafter's proposal below the root: a chain's first `gamma` tokens, or a whole tree (its parents
        mapped to this builder's nodes). A deterministic node reuses an identical existing child of its parent; a
        sampled one never merges (its row is the distribution it was drawn from, given its own earlier siblings)."""
        if not draft.is_tree:
            self.add_chain(draft.tokens[:gamma].tolist(), None if draft.probs is None else draft.probs[:gamma])
            return
        placed: list[int] = []  # this builder's node for each of the draft's nodes (parents come first)
        for i, (token, parent) in enumerate(zip(draft.tokens.tolist(), draft.parents.tolist())):
            parent = -1 if parent < 0 else placed[parent]
            row = None if draft.probs is None else draft.probs[i]
            existing = self.find(parent, token) if row is None else None
            placed.append(existing if existing is not None else self.add(token, parent, row))

    def build(self, vocab_size: int) -> Draft:
        tokens = torch.tensor(self.tokens, dtype=torch.long)  # [n]
        parents = torch.tensor(self.parents, dtype=torch.long)  # [n]
        if all(row is None for row in self.rows):
            return Draft(tokens, None, parents)
        device = next(row.device for row in self.rows if row is not None)  # the draft model's
        one_hot = torch.nn.functional.one_hot(tokens.to(device), vocab_size).float()  # [n, vocab]
        probs = torch.stack([row if row is not None else one_hot[i] for i, row in enumerate(self.rows)])
        return Draft(tokens, probs, parents)
