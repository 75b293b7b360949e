"""Prompt caching: the keys/values of recent requests, reused by a new prompt that starts the same way.

Chat prompts share long beginnings: the chat template's system prompt, and in a conversation every
earlier turn. Where a runner declares `prefix_invariant` (a position's keys and values depend only on
the tokens up to it, not on how they were fed: kquant's row-invariant kernels and attention), the
cached rows of an earlier request are bit for bit what a fresh prefill would compute, so a new request
copies the longest prefix it shares with one of them and prefills only the rest. Its output is the
same as without the store: a request's answer cannot depend on what ran before it. Elsewhere nothing
is stored (llama.cpp's and torch's batched prefill round a chunk differently from a whole prompt).

A finished request leaves a compact copy of its cache (prompt and answer). The store holds at most
`budget` bytes of them, the least recently used going first; a prefix is reused from `MIN_REUSE`
tokens.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from verispec.models.runner import Cache, Runner

__all__ = ["MIN_REUSE", "PREFIX_BUDGET", "PrefixStore"]

MIN_REUSE = 16  # shared tokens worth a copy (fewer: prefilling them costs about as little)
PREFIX_BUDGET = 128 << 20  # bytes of cached keys/values kept for reuse by default (~2,300 positions of the 1.5B)


def _shared(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class PrefixStore:
    """Finished requests' caches, keyed by the tokens they hold (see the module docstring)."""

    def __init__(self, runner: Runner, budget: int = PREFIX_BUDGET):
        self.budget = budget
        self.position_bytes = runner.cache_bytes_per_position or 1
        self._entries: OrderedDict[int, tuple[tuple[int, ...], Cache]] = OrderedDict()  # id -> (tokens, cache); oldest first
        self._serial = 0
        self._lock = threading.Lock()

    @property
    def positions(self) -> int:
        """Positions held, over every entry."""
        return sum(len(tokens) for tokens, _ in self._entries.values())

    def take(self, prompt_ids: Sequence[int], capacity: int) -> Cache | None:
        """A new cache of `capacity` positions holding the longest stored prefix of `prompt_ids` (at most
        all but its last token, which the prefill feeds for the first new token), or None when no entry
        shares MIN_REUSE tokens."""
        with self._lock:
            best, shared = None, 0
            for key, (tokens, _) in self._entries.items():
                if (n := min(_shared(tokens, prompt_ids), len(prompt_ids) - 1)) > shared:
                    best, shared = key, n
            if best is None or shared < MIN_REUSE:
                return None
            self._entries.move_to_end(best)
            return self._entries[best][1].copied(shared, capacity)

    def keep(self, token_ids: Sequence[int], cache: Cache) -> None:
        """Store the first `cache.length` positions of a finished request's `cache` (they hold `token_ids`),
        unless an entry already holds them; then drop the oldest entries past the budget."""
        length = min(cache.length, len(token_ids))
        if length < MIN_REUSE or length * self.position_bytes > self.budget:
            return
        tokens = tuple(token_ids[:length])
        with self._lock:
            if any(_shared(held, tokens) == length for held, _ in self._entries.values()):
                return
            self._entries = OrderedDict((key, (held, c)) for key, (held, c) in self._entries.items()
                                        if _shared(held, tokens) < len(held))  # entries this one extends go
            self._serial += 1
            self._entries[self._serial] = (tokens, cache.copied(length, length))
            while self.positions * self.position_bytes > self.budget:
                self._entries.popitem(last=False)
