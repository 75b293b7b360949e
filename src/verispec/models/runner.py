"""The runner seam: what the engine, the drafters and the server ask of a model, whatever runs it.

Two backends implement it: verispec's own `Transformer` (torch; float32, bfloat16, int8) and
`LlamaCppRunner` (a GGUF file in llama.cpp). Nothing above `models/` knows which one runs.
`ragged_rows` is the argument check the backends' `forward_ragged` share.
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["Cache", "Runner", "ragged_rows"]


class Cache(Protocol):
    """One sequence's keys/values: positions 0 … length−1 are valid."""

    length: int
    ceiling: int | None  # the most positions the sequence can use: a cache that grows ahead stops there

    def truncate(self, length: int) -> None:
        """Keep the first `length` positions (a rejected draft's are dropped)."""

    def keep(self, start: int, slots: torch.Tensor) -> None:
        """After a token tree: keep the fed nodes `slots` [k] (relative to `start`, root first) right
        after `start`, as if that path alone had been fed; drop the other nodes."""

    def release(self) -> None:
        """The sequence is over: give back what it holds."""


class Runner(Protocol):
    """A model that scores new positions after a cache, for one sequence or several at once."""

    config: object  # .vocab_size, .max_position_embeddings, .num_layers
    dtype: torch.dtype

    @property
    def exact_positions(self) -> int | None:
        """The most positions one forward scores bit for bit as single-token steps would, or None."""

    def exact_positions_after(self, length: int) -> int | None:
        """`exact_positions` for a forward after `length` cached positions (it may shrink as a cache grows)."""

    def new_cache(self, capacity: int = ...) -> Cache: ...

    def prefilled_cache(self, prompt_ids: list[int], spare: int = ...) -> Cache:
        """A cache holding prompt_ids[:-1]: the last prompt token is fed with the first step."""

    def forward(self, cache: Cache, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None, logits: str = "all") -> torch.Tensor | None:
        """Feed `tokens` [n] after the cache; logits "all" [n, vocab], "last" [1, vocab] or "none".
        A token tree passes positions [n] and tree_mask [n, n] (True where node i sees node j)."""

    def forward_ragged(self, caches: list[Cache], feeds: list[torch.Tensor],
                       positions: list[torch.Tensor | None] | None = None,
                       tree_masks: list[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
        """Several sequences' feeds in one pass; per sequence its logits [n_i, vocab]."""


def ragged_rows(
    caches: list, feeds: list[torch.Tensor], positions: list[torch.Tensor | None] | None,
    tree_masks: list[torch.Tensor | None] | None,
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """Check a `forward_ragged` call (one feed per cache, no cache twice) and return its positions
    and tree masks per row, None (consecutive positions, causal mask) where the caller gave none."""
    if len(caches) != len(feeds) or not feeds:
        raise ValueError(f"forward_ragged needs one feed per cache, got {len(caches)} caches and {len(feeds)} feeds")
    if len({id(c) for c in caches}) != len(caches):
        raise ValueError("forward_ragged got the same cache twice: each row needs its own cache")
    return positions or [None] * len(feeds), tree_masks or [None] * len(feeds)
