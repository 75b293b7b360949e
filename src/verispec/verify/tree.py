"""Tree verification: pick the accepted root-to-node path of a token tree, then one target token.

Rows: `target_probs` / `target_tokens` have n+1 rows; row 0 is the target after the last committed
token, row i+1 the target after draft node i (its distribution over node i's children).

Greedy: a node is accepted when its token is the target's argmax after its parent and its parent is
accepted; the deepest accepted node wins (the first one on ties), then the target's argmax after it.

Sampling, one rule for every kind of draft (SpecInfer's multi-step speculative sampling, generalised
as recursive rejection sampling). Walk down from the root; at the current node let `residual` be the
target's distribution there and try the children in draft order. Child x, drawn from draft_probs[x]
(the exact distribution it was drawn from given its earlier siblings, see `types.Draft`), is accepted
with probability min(1, residual(x) / draft(x)); on rejection residual ← norm(max(residual − draft, 0))
and the next child is tried; if every child is rejected the next token is sampled from the residual.
Why it is lossless: one try is a speculative-sampling step whose own target is `residual`, so
"accept x, else sample from the new residual" has distribution `residual`; the later children are
drawn from their stated distribution whatever x was, so they reproduce the new residual by induction.
Special cases: children drawn i.i.d. from q (rows all q); deterministic candidates (draft_probs None:
rows are point masses, so x is accepted with probability residual(x) and the residual is the old one
with x zeroed); candidates drawn without replacement (rows are q with the earlier siblings removed,
so after each rejection both the residual and the next row change). Verifiers never see drafters.
"""

from __future__ import annotations

import torch

from verispec.sampling.samplers import multinomial, uniform
from verispec.tokentree import children_of, depths, path_to
from verispec.types import Origin, Verdict
from verispec.verify.chain import residual_distribution

__all__ = ["verify_tree_greedy", "verify_tree_sampled"]


def _verdict(parents: torch.Tensor, last: int, next_token: int, has_children: bool) -> Verdict:
    path = tuple(path_to(parents, last))
    return Verdict(len(path), next_token, Origin.RECOVERED if has_children else Origin.BONUS, path)


def verify_tree_greedy(draft_tokens: torch.Tensor, parents: torch.Tensor, target_tokens: torch.Tensor) -> Verdict:
    """draft_tokens [n]; parents [n]; target_tokens [n+1] = the target's argmax at the root and after each node."""
    matches = (draft_tokens.to(target_tokens.device) == target_tokens[parents + 1]).tolist()  # [n]: agrees after its parent
    accepted = [False] * len(matches)
    for node, parent in enumerate(parents.tolist()):
        accepted[node] = matches[node] and (parent < 0 or accepted[parent])
    node_depths = depths(parents).tolist()
    best, best_depth = -1, 0
    for node, ok in enumerate(accepted):
        if ok and node_depths[node] > best_depth:
            best, best_depth = node, node_depths[node]
    children = children_of(parents)
    return _verdict(parents, best, int(target_tokens[best + 1]), best in children)


def verify_tree_sampled(
    draft_tokens: torch.Tensor,
    parents: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> Verdict:
    """draft_tokens [n]; parents [n]; draft_probs [n, vocab] or None (point masses); target_probs [n+1, vocab]."""
    children = children_of(parents)
    tokens = draft_tokens.tolist()
    node = -1
    while True:
        residual = target_probs[node + 1]  # [vocab]
        for child in children.get(node, []):
            token = tokens[child]
            draft_row = draft_probs[child] if draft_probs is not None else None  # [vocab]
            draft_at_token = float(draft_row[token]) if draft_row is not None else 1.0
            draw = float(uniform(1, generator, target_probs.device))
            if draw * draft_at_token < float(residual[token]):
                node = child
                break
            residual = residual_distribution(residual, draft_row, token)
        else:
            next_token = int(multinomial(residual[None], generator))
            return _verdict(parents, node, next_token, node in children)
