"""Tree drafters (SpecInfer): top-k expansion by a draft model, and merging several drafters' chains.

Expansion: the draft model scores the committed sequence once, then grows the tree one depth at a
time, choosing k children per node (top-k under greedy decoding, Gumbel-top-k without replacement
under sampling). Each depth is one draft forward over all nodes so far with their tree attention
mask; the draft cache is cut back to the committed sequence afterwards, so it only ever holds
committed tokens (the runner's forward sees its whole cache, which is why the partial tree is fed
again each depth rather than kept). Shape: k children at each of the first `wide` depths, one below.

Merge: several drafters' proposals in one tree — the draft model's chain and the n-gram continuation
(`merge`), or, with no draft model, prompt lookup's tree of the text's continuations and STAND's tree of
the target's own n-gram table (`lookup`: where verifying many positions costs little, a GPU, the two find
different tokens). Deterministic nodes share prefixes; a sampled node never merges into a deterministic
one (that would change the distribution it was drawn from), so in sampling mode they are separate branches.
"""

from __future__ import annotations

import torch

from verispec.drafters.base import ComposedSession, Drafter, DraftSession, ModelSession
from verispec.drafters.branching import TreeBuilder, choose_children, node_distributions, static_shape
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.ngram import NgramDrafter
from verispec.drafters.stand import StandDrafter
from verispec.errors import InvalidParameterError
from verispec.models.runner import LoadedModel
from verispec.sampling.processors import penalties
from verispec.tokentree import ancestor_mask, depths
from verispec.types import Draft

__all__ = ["ExpansionDrafter", "MergeDrafter"]


class ExpansionDrafter(Drafter):
    def __init__(self, model: LoadedModel, target_vocab_size: int, k: int = 2, depth: int = 4, wide: int = 1):
        if k < 1 or depth < 1 or not 0 <= wide <= depth:
            raise InvalidParameterError(f"tree drafter needs k ≥ 1, depth ≥ 1, 0 ≤ wide ≤ depth; got k={k}, depth={depth}, wide={wide}")
        self.model, self.target_vocab_size = model, target_vocab_size
        self.shape = static_shape(k, depth, wide)
        self.name = f"tree:k={k},depth={depth},wide={wide}"
        self.drafts_trees = any(children > 1 for children in self.shape)
        if not model.runner.supports_trees:  # each depth is one tree-masked forward of the draft model
            raise InvalidParameterError(
                f"the tree drafter expands a token tree with its draft model, and {model.name}'s runner ({model.precision}, "
                f"model type {model.runner.config.model_type!r}) scores chains only: use another draft model or a chain drafter"
            )

    def start(self, prompt_ids: list[int]) -> DraftSession:
        return _ExpansionSession(self, prompt_ids)

    def start_chunked(self, prompt_ids: list[int]) -> DraftSession:
        return _ExpansionSession(self, prompt_ids, prefill=False)


class _ExpansionSession(ModelSession):
    def __init__(self, drafter: ExpansionDrafter, prompt_ids: list[int], prefill: bool = True):
        super().__init__(drafter.model, prompt_ids, prefill)
        self.drafter = drafter

    def _distributions(self, ids, builder: TreeBuilder, logits: torch.Tensor, params) -> torch.Tensor:
        """Distributions [rows, vocab] after the root (row 0) and after each node (rows 1..)."""
        tokens, parents = torch.tensor(builder.tokens, dtype=torch.long), torch.tensor(builder.parents, dtype=torch.long)
        vocab = self.runner.config.vocab_size
        seen = penalties(params, vocab, ids, tokens, parents, logits.device, output_start=self.output_start)  # n+1 rows, or None
        seen = None if seen is None else seen.rows(logits.shape[0])
        return node_distributions(logits, params, seen, self.drafter.target_vocab_size)

    def propose(self, ids, gamma, params, generator):
        shape = self.drafter.shape[:gamma]
        if not shape:
            return Draft.empty()
        committed = len(ids)
        root_logits = self._catch_up(ids)  # [1, vocab]
        builder = TreeBuilder()
        dists = self._distributions(ids, builder, root_logits, params)  # [1, vocab]
        frontier = {-1: dists[0]}
        for level, k in enumerate(shape):
            added = []
            for parent, row in frontier.items():
                tokens, rows = choose_children(row, k, params.greedy, generator)
                added += [builder.add(t, parent, rows[i] if rows is not None else None) for i, t in enumerate(tokens)]
            if level + 1 == len(shape) or not added:
                break
            tokens = torch.tensor(builder.tokens, dtype=torch.long)
            parents = torch.tensor(builder.parents, dtype=torch.long)
            logits = self.runner.forward(
                self.cache, tokens, positions=committed + depths(parents) - 1, tree_mask=ancestor_mask(parents)
            )  # [nodes, vocab]
            self._rollback(committed)  # the cache holds committed tokens only
            dists = self._distributions(ids, builder, torch.cat([root_logits, logits]), params)  # [nodes+1, vocab]
            frontier = {node: dists[node + 1] for node in added}
        return builder.build(self.drafter.target_vocab_size)


class MergeDrafter(Drafter):
    """Several drafters' chains and trees merged into one token tree (`model_and_ngram`, `lookup`)."""

    drafts_trees = True

    def __init__(self, drafters: list[Drafter], target_vocab_size: int):
        if not drafters:
            raise InvalidParameterError("a merge drafter needs at least one drafter to merge")
        self.drafters, self.target_vocab_size = drafters, target_vocab_size
        self.name = "merge:" + "+".join(d.name for d in drafters)

    @classmethod
    def model_and_ngram(cls, model: LoadedModel, target_vocab_size: int, max_n: int = 3) -> MergeDrafter:
        return cls([DraftModelDrafter(model, target_vocab_size), NgramDrafter(max_n=max_n)], target_vocab_size)

    @classmethod
    def lookup(cls, target_vocab_size: int, nodes: int = 16, table_nodes: int = 16, max_n: int = 3) -> MergeDrafter:
        """Prompt lookup's tree of up to `nodes` nodes beside STAND's tree of `table_nodes` (its searched shape): two
        model-free drafters in one step, no draft forward."""
        drafter = cls([NgramDrafter(max_n=max_n, nodes=nodes), StandDrafter(target_vocab_size, nodes=table_nodes)],
                      target_vocab_size)
        drafter.name = f"lookup:nodes={nodes},table_nodes={table_nodes},max_n={max_n}"
        return drafter

    @property
    def model(self) -> LoadedModel | None:
        """The draft model, if one of the merged drafters has one (the engine calibrates its cost)."""
        return next((d.model for d in self.drafters if d.model is not None), None)

    def start(self, prompt_ids: list[int]) -> DraftSession:
        return _MergeSession([d.start(prompt_ids) for d in self.drafters], self.target_vocab_size)

    def start_chunked(self, prompt_ids: list[int]) -> DraftSession:
        return _MergeSession([d.start_chunked(prompt_ids) for d in self.drafters], self.target_vocab_size)


class _MergeSession(ComposedSession):
    def __init__(self, sessions: list[DraftSession], vocab_size: int):
        super().__init__(sessions)
        self.vocab_size = vocab_size

    def propose(self, ids, gamma, params, generator):
        builder = TreeBuilder()
        for session in self.sessions:
            builder.add_draft(session.propose(ids, gamma, params, generator), gamma)
        return builder.build(self.vocab_size)
