"""Prompt-lookup (n-gram) drafting: continue the text the way it continued last time.

The suffix of the sequence (n tokens, n from `max_n` down to `min_n`) is looked up in an index of
every earlier n-gram; the most recent earlier occurrence of the longest matching suffix wins, and
the tokens that followed it are the draft. Hugging Face's prompt lookup scans left to right and
takes the first (oldest) match; `oldest=1` does the same, so the two rules can be measured on one
engine (BENCHMARKS.md). The index is a dict updated incrementally with the committed tokens,
so a lookup costs microseconds whatever the context length. Deterministic: no draft probabilities.
The sequence may also shrink or change at its end between calls (a cascade drafts after speculative
tokens that are later rolled back): the entries of n-grams that no longer occur are undone.
"""

from __future__ import annotations

import torch

from verispec.drafters.base import Drafter, DraftSession
from verispec.drafters.prefix import common_prefix_length
from verispec.errors import InvalidParameterError
from verispec.types import Draft

__all__ = ["NgramDrafter"]


class NgramDrafter(Drafter):
    def __init__(self, max_n: int = 3, min_n: int = 1, oldest: int = 0):
        if not 1 <= min_n <= max_n:
            raise InvalidParameterError(f"n-gram sizes need 1 ≤ min_n ≤ max_n, got min_n={min_n}, max_n={max_n}")
        if oldest not in (0, 1):
            raise InvalidParameterError(f"ngram option oldest must be 0 (latest match) or 1 (oldest, as HF), got {oldest}")
        self.max_n, self.min_n, self.oldest = max_n, min_n, bool(oldest)
        self.name = f"ngram:max_n={max_n}" + (",oldest=1" if oldest else "")

    def start(self, prompt_ids: list[int]) -> DraftSession:
        return _NgramSession(self.max_n, self.min_n, self.oldest)


class _NgramSession(DraftSession):
    def __init__(self, max_n: int, min_n: int, oldest: bool = False):
        self.max_n, self.min_n, self.oldest = max_n, min_n, oldest
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

    def propose(self, ids, gamma, params, generator):
        return Draft(torch.tensor(self.lookup(ids, gamma)[0], dtype=torch.long))
