"""Chains and token trees in a step: what differs between them, in two small classes chosen once per draft.

A chain is fed at consecutive positions under the causal mask, its rows see the committed text plus
the drafts before them, and after verification the cache is cut back to the accepted prefix. A token
tree is fed at position prefix + depth under a tree attention mask, each row sees the committed text
plus the node's ancestors, and the accepted path's keys/values are packed right after the prefix (no
recompute). A tree whose parents form a chain is a chain.
"""

from __future__ import annotations

import functools

import torch

from verispec.models.runner import Cache
from verispec.sampling.processors import Scores
from verispec.tokentree import check_parents, depths, is_chain, keep_nodes, tree_attention_mask
from verispec.types import Draft, Verdict
from verispec.verify import verify_greedy, verify_sampled, verify_tree_greedy, verify_tree_sampled

__all__ = ["Chain", "Tree", "shape_of"]


class Chain:
    """A chain of n draft tokens (possibly none)."""

    def __init__(self, draft: Draft):
        self.draft = draft if not draft.is_tree else Draft(draft.tokens, draft.probs)

    def cut(self, gamma: int, most: int | None) -> Chain:
        """The first min(γ, most) tokens (most None: no bound)."""
        keep = gamma if most is None else min(gamma, most)
        tokens, probs = self.draft.tokens, self.draft.probs
        return Chain(Draft(tokens[:keep], None if probs is None else probs[:keep]))

    @property
    def depth(self) -> int:
        return len(self.draft)

    def layout(self, last: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(positions [n+1], attention mask [n+1, n+1]) of the block after position `last`: None, None
        (consecutive positions, causal mask)."""
        return None, None

    @property
    def parent_list(self) -> list[int] | None:
        """The parents for a grammar's per-row masks; None: a chain."""
        return None

    def verify(self, scores: Scores, generator: torch.Generator) -> Verdict:
        """The accepted prefix and the next token, from the target's `scores` over the block [n+1]."""
        if scores.greedy is not None:
            return verify_greedy(self.draft.tokens, scores.greedy)
        return verify_sampled(self.draft.tokens, self.draft.probs, scores.probs, generator)

    def keep(self, cache: Cache, start: int, rows: torch.Tensor) -> None:
        """Keep the accepted rows' keys/values (rows [k]: 0 = the last committed token at `start`)."""
        cache.truncate(start + len(rows))


class Tree(Chain):
    """A token tree of n nodes (`draft.parents`, topological order)."""

    def __init__(self, draft: Draft):
        self.draft = draft

    @functools.cached_property
    def node_depths(self) -> torch.Tensor:
        """[n] each node's depth (1: a child of the last committed token), worked out once a step."""
        return depths(self.draft.parents)

    def cut(self, gamma: int, most: int | None) -> Tree:
        """The nodes at depth ≤ γ, and of those the first `most` (parents come first: a subtree)."""
        check_parents(self.draft.parents)
        keep = self.node_depths <= gamma  # [n]
        if most is not None:
            keep &= keep.cumsum(0) <= most
        index, parents = keep_nodes(self.draft.parents, keep)
        probs = self.draft.probs
        return Tree(Draft(self.draft.tokens[index], None if probs is None else probs[index], parents))

    @property
    def depth(self) -> int:
        return int(self.node_depths.max()) if len(self.draft) else 0

    def layout(self, last: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        positions = last + torch.cat([torch.zeros(1, dtype=torch.long), self.node_depths])  # [n+1]
        return positions, tree_attention_mask(self.draft.parents)  # [n+1], [n+1, n+1]

    @property
    def parent_list(self) -> list[int] | None:
        return self.draft.parents.tolist()

    def verify(self, scores: Scores, generator: torch.Generator) -> Verdict:
        """The accepted path and the next token (`Verdict.path`: node indices, root first)."""
        if scores.greedy is not None:
            return verify_tree_greedy(self.draft.tokens, self.draft.parents, scores.greedy)
        return verify_tree_sampled(self.draft.tokens, self.draft.parents, self.draft.probs, scores.probs, generator)

    def keep(self, cache: Cache, start: int, rows: torch.Tensor) -> None:
        cache.keep(start, rows)


def shape_of(draft: Draft) -> Chain:
    """The draft as a `Chain` or a `Tree` (a tree whose parents form a chain is a chain)."""
    return Tree(draft) if draft.is_tree and not is_chain(draft.parents) else Chain(draft)
