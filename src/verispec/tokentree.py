"""Token-tree structure: a draft tree is a `parents` vector ([n] int, −1 = child of the last committed
token, nodes in topological order: every parent comes before its children).

Everything here is about shape only (no tokens, no probabilities): depths, the ancestor mask that
becomes the tree attention mask, paths, chains, and pruning by depth. Loops run over nodes (tens),
never over the vocabulary, and on Python lists or numpy rows, one tensor made at the end: a tensor
element written or read per node costs microseconds, which every tree step paid several times over (on a
GPU a large share of a step: BENCHMARKS.md, "GPU").
"""

from __future__ import annotations

import numpy as np
import torch

from verispec.errors import InvalidParameterError

__all__ = [
    "chain_parents", "is_chain", "check_parents", "depths", "ancestor_mask", "path_to", "children_of",
    "keep_nodes", "tree_attention_mask",
]


def chain_parents(n: int) -> torch.Tensor:
    """The parents vector of a chain of n tokens: [-1, 0, 1, …, n−2]."""
    return torch.arange(-1, n - 1, dtype=torch.long)


def is_chain(parents: torch.Tensor | None) -> bool:
    return parents is None or bool(torch.equal(parents, chain_parents(parents.shape[0])))


def check_parents(parents: torch.Tensor) -> None:
    """Raise unless every node's parent is −1 or an earlier node."""
    index = torch.arange(parents.shape[0])
    if parents.dim() != 1 or bool(((parents < -1) | (parents >= index)).any()):
        raise InvalidParameterError(
            f"a draft tree's parents must be −1 or the index of an earlier node (topological order), got {parents.tolist()}"
        )


def depths(parents: torch.Tensor) -> torch.Tensor:
    """[n] depth of each node, 1 for children of the last committed token."""
    out: list[int] = []
    for parent in parents.tolist():
        out.append(1 if parent < 0 else out[parent] + 1)
    return torch.tensor(out, dtype=torch.long)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[n, n] bool: True where node j is node i or one of its ancestors (row i = what node i attends to)."""
    mask = np.eye(parents.shape[0], dtype=bool)
    for node, parent in enumerate(parents.tolist()):
        if parent >= 0:
            mask[node] |= mask[parent]
    return torch.from_numpy(mask)


def path_to(parents: torch.Tensor, node: int) -> list[int]:
    """Node indices from the root's child down to `node` (empty for node −1)."""
    up, path = parents.tolist(), []
    while node >= 0:
        path.append(node)
        node = up[node]
    return path[::-1]


def children_of(parents: torch.Tensor) -> dict[int, list[int]]:
    """Children of each node (−1 for the root) in draft order."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents.tolist()):
        children.setdefault(parent, []).append(node)
    return children


def keep_nodes(parents: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Restrict a tree to the nodes where `keep` [n] bool is True (a kept node's parent must be kept).

    Returns (index [m] of the kept nodes in the old tree, parents [m] renumbered).
    """
    index = keep.nonzero().flatten()
    new_number = torch.full((parents.shape[0] + 1,), -1, dtype=torch.long)  # slot 0 stands for parent −1
    new_number[index + 1] = torch.arange(index.shape[0])
    return index, new_number[parents[index] + 1]


def tree_attention_mask(parents: torch.Tensor) -> torch.Tensor:
    """[n+1, n+1] bool over the fed tokens (the last committed token, then the n nodes): each sees
    the last committed token, its ancestors and itself (the committed prefix before it is always seen)."""
    n = parents.shape[0]
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[:, 0] = True
    mask[1:, 1:] = ancestor_mask(parents)
    return mask
