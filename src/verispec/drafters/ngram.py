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
"""

from __future__ import annotations

import torch

from verispec.drafters.base import Drafter, DraftSession
from verispec.drafters.prefix import common_prefix_length
from verispec.errors import InvalidParameterError
from verispec.types import Draft, Hint

__all__ = ["NgramDrafter", "MATCH_PRIORS"]

# acceptance of the first drafted token by matched suffix length (1, 2, ≥ 3), measured on public prompts (Spec-Bench's
# groups and HumanEval, the 1.5B target's greedy outputs: `benchmarks/probes/lookup_bound.py`): the classes' priors
MATCH_PRIORS = {1: 0.25, 2: 0.45, 3: 0.8}
HINT_CLASSES = max(MATCH_PRIORS)


class NgramDrafter(Drafter):
    def __init__(self, max_n: int = 3, min_n: int = 1, oldest: int = 0, hints: int = 1):
        if not 1 <= min_n <= max_n:
            raise InvalidParameterError(f"n-gram sizes need 1 ≤ min_n ≤ max_n, got min_n={min_n}, max_n={max_n}")
        for option, value in (("oldest", oldest), ("hints", hints)):
            if value not in (0, 1):
                raise InvalidParameterError(f"ngram option {option} must be 0 or 1, got {value}")
        self.max_n, self.min_n, self.oldest, self.hints = max_n, min_n, bool(oldest), bool(hints)
        self.name = f"ngram:max_n={max_n}" + (",oldest=1" if oldest else "") + ("" if hints else ",hints=0")

    def start(self, prompt_ids: list[int]) -> DraftSession:
        return _NgramSession(self.max_n, self.min_n, self.oldest, self.hints)


class _NgramSession(DraftSession):
    def __init__(self, max_n: int, min_n: int, oldest: bool = False, hints: bool = True):
        self.max_n, self.min_n, self.oldest, self.hints = max_n, min_n, oldest, hints
        self.index: dict[tuple[int, ...], int] = {}  # n-gram -> position right after its latest (oldest) occurrence
        self.indexed_until = 0  # n-grams ending before this position are indexed
        self.indexed_ids: list[int] = []  # the sequence they were read from
        self.undo: list[list[tuple[tuple[int, ...], int | None]]] = []  # per end position: (n-gram, previous entry)

    def _rollback(self, ids: list[int]) -> None:
        """Make `ids` the indexed sequence: undo the entries of n-grams ending where the two part."""
        same = common_prefix_length(self.indexed_ids, ids)
        del self.indexed_ids[same:]
        self.indexed_ids += ids[same:]  # now equal to ids, copying only the tail
        valid = min(same, len(ids) - 1)  # n-grams ending before: still valid
        while self.indexed_until > valid:
            self.indexed_until -= 1
            for key, previous in reversed(self.undo.pop()):
                if previous is None:
                    del self.index[key]
                else:
                    self.index[key] = previous

    def _index(self, ids: list[int]) -> None:
        self._rollback(ids)
        # Index n-grams ending at positions < len(ids) - 1, so each has a continuation
        # and the current suffix never matches itself.
        for end in range(self.indexed_until, len(ids) - 1):
            changes = []
            for n in range(self.min_n, self.max_n + 1):
                if end - n + 1 >= 0:
                    key = tuple(ids[end - n + 1 : end + 1])
                    if not (self.oldest and key in self.index):
                        changes.append((key, self.index.get(key)))
                        self.index[key] = end + 1
            self.undo.append(changes)
        self.indexed_until = max(self.indexed_until, len(ids) - 1)

    def lookup(self, ids: list[int], gamma: int) -> tuple[list[int], int]:
        """(up to γ continuation tokens, length n of the matched suffix); ([], 0) without a match."""
        self._index(ids)
        if gamma > 0:
            for n in range(min(self.max_n, len(ids)), self.min_n - 1, -1):
                start = self.index.get(tuple(ids[-n:]))
                if start is not None:
                    return ids[start : start + gamma], n
        return [], 0

    def hint(self, ids):
        """The matched suffix's length (up to HINT_CLASSES) as the step's class; None without a match (nothing
        is drafted) or with hints off."""
        matched = self.lookup(ids, 1)[1] if self.hints else 0
        return Hint(min(matched, HINT_CLASSES), MATCH_PRIORS[min(matched, HINT_CLASSES)]) if matched else None

    def propose(self, ids, gamma, params, generator):
        return Draft(torch.tensor(self.lookup(ids, gamma)[0], dtype=torch.long))
