"""Prompt-lookup (n-gram) drafting: continue the text the way it continued last time.

The suffix of the sequence (n tokens, n from `max_n` down to `min_n`) is looked up in an index of
every earlier n-gram; the most recent earlier occurrence of the longest matching suffix wins, and
the tokens that followed it are the draft. Hugging Face's prompt lookup scans left to right and
takes the first (oldest) match; `oldest=1` does the same, so the two rules can be measured on one
engine (BENCHMARKS.md). The index is a dict updated incrementally with the committed tokens,
so a lookup costs microseconds whatever the context length. Deterministic: no draft probabilities.
The sequence may also shrink or change at its end between calls (a cascade drafts after speculative
tokens that are later rolled back): the entries of n-grams that no longer occur are undone.

How long a suffix matched says how likely its continuation is right (far more often after three tokens than
after one: BENCHMARKS.md), so each step tells the γ policy its match length (`hint`, capped at
`HINT_CLASSES`, with `MATCH_PRIORS` as priors), and the policy sizes each class of step by its own measured
acceptance: a short draft or none after a weak match, a long one after a strong match. `hints=0` turns this off.

`lookup_on_device` is the same rule over a device buffer of token ids, in tensor operations of fixed shapes that
read nothing back to the host, so that a whole step can be captured as a CUDA graph (`engine/device_steps.py`):
a chain, or several distinct continuations for a token tree of that many branches.

`nodes=N` drafts a token tree instead of one continuation: the continuations of every earlier match of the last
`max_n` … `min_n` tokens (longest suffix first, latest match first), merged where they agree, up to N nodes and γ
deep. Where verifying more positions costs almost nothing (a GPU) more of the output is found in the text this way
(`benchmarks/probes/lookup_bound.py` measures how much on public prompts).
"""

from __future__ import annotations

import torch

from verispec.drafters.base import Drafter, DraftSession
from verispec.drafters.branching import MAX_TREE_NODES, TreeBuilder
from verispec.drafters.prefix import common_prefix_length
from verispec.errors import InvalidParameterError
from verispec.types import Draft, Hint

__all__ = ["NgramDrafter", "MATCH_PRIORS", "lookup_on_device", "match_hint"]

# acceptance of the first drafted token by matched suffix length (1, 2, ≥ 3), measured on public prompts (Spec-Bench's
# groups and HumanEval, the 1.5B target's greedy outputs: `benchmarks/probes/lookup_bound.py`): the classes' priors
MATCH_PRIORS = {1: 0.25, 2: 0.45, 3: 0.8}
HINT_CLASSES = max(MATCH_PRIORS)
MATCHES_PER_NODE = 4  # a tree reads at most this many matches a node (a frequent token's matches repeat one text)


class NgramDrafter(Drafter):
    def __init__(self, max_n: int = 3, min_n: int = 1, oldest: int = 0, hints: int = 1, nodes: int = 0):
        if not 1 <= min_n <= max_n:
            raise InvalidParameterError(f"n-gram sizes need 1 ≤ min_n ≤ max_n, got min_n={min_n}, max_n={max_n}")
        for option, value in (("oldest", oldest), ("hints", hints)):
            if value not in (0, 1):
                raise InvalidParameterError(f"ngram option {option} must be 0 or 1, got {value}")
        if not 0 <= nodes <= MAX_TREE_NODES:
            raise InvalidParameterError(f"ngram option nodes must be 0 (a chain) … {MAX_TREE_NODES}, got {nodes}")
        self.max_n, self.min_n, self.oldest, self.hints, self.nodes = max_n, min_n, bool(oldest), bool(hints), nodes
        self.drafts_trees = nodes > 0
        self.name = (f"ngram:max_n={max_n}" + (",oldest=1" if oldest else "") + ("" if hints else ",hints=0")
                     + (f",nodes={nodes}" if nodes else ""))

    def start(self, prompt_ids: list[int]) -> DraftSession:
        return _NgramSession(self.max_n, self.min_n, self.oldest, self.hints, self.nodes)


def lookup_on_device(ids: torch.Tensor, length: torch.Tensor, gamma: int, max_n: int, min_n: int,
                     chains: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """`_NgramSession.lookup`'s rule on the device: the sequence is ids[:length] (ids [capacity] long, length [1]
    long, both on the device); returns drafts [chains, γ] and the first draft's matched suffix length n [1] (0: no
    match).

    The first draft is the γ tokens after the most recent earlier occurrence of the longest suffix of n ≤ max_n
    tokens (n ≥ min_n) that occurred before, as the host's lookup drafts them, except that it always holds γ
    tokens: where the host's draft stops at the end of the sequence (or is empty, without a match) this one goes on
    with whatever the buffer holds there. Each further draft is the next match in the same order (longer suffix
    first, then later) whose γ tokens differ from every draft before it: a token tree of `chains` branches, not
    merged where they agree (`engine/device_steps.py`). A draft is only a guess, so what the buffer holds past the
    sequence costs acceptance, never exactness."""
    capacity = ids.shape[0]
    ends = torch.arange(capacity, device=ids.device)  # [capacity]: where an earlier n-gram ends
    last = length - 1  # [1]: where the suffix ends
    agree = ends < last  # [capacity]: an earlier n-gram with a token after it, agreeing with the suffix so far
    matched = torch.zeros_like(ends)  # [capacity]: the longest n ≥ min_n whose n-gram ending there is the suffix's
    for n in range(1, max_n + 1):
        back = n - 1  # the n-gram's first token lies `back` before its end
        agree = agree & (ends >= back) & (ids[(ends - back).clamp(min=0)] == ids[(last - back).clamp(min=0)])
        if n >= min_n:
            matched = torch.where(agree & (last >= back), n, matched)
    rank = torch.where(matched > 0, matched * capacity + ends, -1)  # [capacity]: longer suffix first, then later
    best = rank.argmax(0, keepdim=True)  # [1] (without a match: 0, and the draft is a guess)
    steps = torch.arange(gamma, device=ids.device)  # [γ]
    if chains == 1:
        return ids[(best + 1 + steps).clamp(max=capacity - 1)][None], matched[best]  # [1, γ], [1]
    following = ids[(ends[:, None] + 1 + steps).clamp(max=capacity - 1)]  # [capacity, γ]: the tokens after each end
    first, drafts = best, []
    for _ in range(chains):
        draft = following[best]  # [1, γ]
        drafts.append(draft)
        rank = torch.where((following == draft).all(1), -1, rank)  # a match that would draft the same is passed over
        best = rank.argmax(0, keepdim=True)
    return torch.cat(drafts), matched[first]  # [chains, γ], [1]


def match_hint(matched: int) -> Hint:
    """The class of a step drafted after a suffix of `matched` ≥ 1 tokens matched: its length (up to HINT_CLASSES),
    its prior, and free (a lookup costs no forward)."""
    return Hint(min(matched, HINT_CLASSES), MATCH_PRIORS[min(matched, HINT_CLASSES)], free=True)


class _NgramSession(DraftSession):
    def __init__(self, max_n: int, min_n: int, oldest: bool = False, hints: bool = True, nodes: int = 0):
        self.max_n, self.min_n, self.oldest, self.hints, self.nodes = max_n, min_n, oldest, hints, nodes
        self.index: dict[tuple[int, ...], list[int]] = {}  # n-gram -> the positions right after its occurrences, in order
        self.indexed_until = 0  # n-grams ending before this position are indexed
        self.indexed_ids: list[int] = []  # the sequence they were read from
        self.undo: list[list[tuple[int, ...]]] = []  # per end position: the n-grams it added an occurrence of

    def _rollback(self, ids: list[int]) -> None:
        """Make `ids` the indexed sequence: undo the entries of n-grams ending where the two part."""
        same = common_prefix_length(self.indexed_ids, ids)
        del self.indexed_ids[same:]
        self.indexed_ids += ids[same:]  # now equal to ids, copying only the tail
        valid = min(same, len(ids) - 1)  # n-grams ending before: still valid
        while self.indexed_until > valid:
            self.indexed_until -= 1
            for key in self.undo.pop():
                self.index[key].pop()
                if not self.index[key]:
                    del self.index[key]

    def _index(self, ids: list[int]) -> None:
        self._rollback(ids)
        # Index n-grams ending at positions < len(ids) - 1, so each has a continuation
        # and the current suffix never matches itself.
        for end in range(self.indexed_until, len(ids) - 1):
            added = [tuple(ids[end - n + 1 : end + 1]) for n in range(self.min_n, self.max_n + 1) if end - n + 1 >= 0]
            for key in added:
                self.index.setdefault(key, []).append(end + 1)
            self.undo.append(added)
        self.indexed_until = max(self.indexed_until, len(ids) - 1)

    def lookup(self, ids: list[int], gamma: int) -> tuple[list[int], int]:
        """(up to γ continuation tokens, length n of the matched suffix); ([], 0) without a match."""
        self._index(ids)
        if gamma > 0:
            for n in range(min(self.max_n, len(ids)), self.min_n - 1, -1):
                starts = self.index.get(tuple(ids[-n:]))
                if starts:
                    start = starts[0] if self.oldest else starts[-1]
                    return ids[start : start + gamma], n
        return [], 0

    def tree(self, ids: list[int], gamma: int) -> TreeBuilder:
        """The continuations (up to γ tokens) of every earlier match of the last max_n … min_n tokens, longest suffix
        first, latest (oldest=1: first) match first, merged where they agree, up to `nodes` nodes."""
        self._index(ids)
        builder, matches = TreeBuilder(), MATCHES_PER_NODE * self.nodes
        for n in range(min(self.max_n, len(ids)), self.min_n - 1, -1):
            starts = self.index.get(tuple(ids[-n:]), [])
            for start in (starts if self.oldest else reversed(starts)):
                matches -= 1
                if matches < 0:
                    return builder
                parent = -1
                for token in ids[start : start + gamma]:
                    node = builder.find(parent, token)
                    if node is None:
                        if len(builder) == self.nodes:
                            return builder
                        node = builder.add(token, parent)
                    parent = node
        return builder

    def hint(self, ids):
        """The matched suffix's length (up to HINT_CLASSES) as the step's class; None without a match (nothing
        is drafted) or with hints off."""
        matched = self.lookup(ids, 1)[1] if self.hints else 0
        return match_hint(matched) if matched else None

    def propose(self, ids, gamma, params, generator):
        if not self.nodes:
            return Draft(torch.tensor(self.lookup(ids, gamma)[0], dtype=torch.long))
        builder = self.tree(ids, gamma) if gamma > 0 else TreeBuilder()
        return builder.build(0) if len(builder) else Draft.empty()  # deterministic nodes: no vocabulary needed
