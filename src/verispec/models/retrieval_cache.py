"""Sparse KV caches for long contexts: a StreamingLLM cache and a chunk-retrieval cache (TriForce).

Both keep a *static* head of slots (attention sinks, or retrieved prompt chunks) followed by a
*dynamic*, contiguous run of positions [dynamic_start, covered). Keys are stored already rotated
with their original absolute positions, and new tokens are fed with their absolute positions, so
RoPE stays consistent however many slots were dropped in between. Rolling back or evicting only
touches the dynamic run: `truncate` for rollback, `KVCache.keep` to compact after eviction.
"""

from __future__ import annotations

import torch

from verispec.models.transformer import KVCache, Transformer

__all__ = ["SparseCache", "chunk_scores", "select_chunks", "build_retrieval_cache"]


class SparseCache:
    """A KVCache whose slots are `static` fixed slots + the positions [dynamic_start, covered)."""

    def __init__(self, runner: Transformer, cache: KVCache, static: int = 0, dynamic_start: int = 0):
        self.runner, self.cache = runner, cache
        self.static, self.dynamic_start = static, dynamic_start

    @property
    def covered(self) -> int:
        """The sequence ids[:covered] has been fed (some of its slots may have been dropped)."""
        return self.dynamic_start + self.cache.length - self.static

    @property
    def dynamic_length(self) -> int:
        return self.cache.length - self.static

    def rollback(self, position: int) -> None:
        """Forget positions ≥ `position` (only dynamic ones can be forgotten)."""
        if position < self.dynamic_start:
            raise ValueError(f"cannot roll back to position {position}: positions before {self.dynamic_start} were evicted")
        self.cache.truncate(self.static + min(position - self.dynamic_start, self.dynamic_length))

    def feed(self, tokens: list[int], logits: str = "all") -> torch.Tensor | None:
        """Run `tokens` as positions [covered, covered + n); logits as in `Transformer.forward`."""
        positions = torch.arange(self.covered, self.covered + len(tokens))  # [n]
        return self.runner.forward(self.cache, torch.tensor(tokens, dtype=torch.long), positions, logits=logits)

    def freeze_prefix(self, slots: int) -> None:
        """Make the first `slots` slots static (e.g. the attention sinks once they are fed)."""
        if self.static != 0 or self.dynamic_start != 0 or slots > self.cache.length:
            raise ValueError("freeze_prefix applies once, to a cache that holds positions 0.. contiguously")
        self.static = self.dynamic_start = slots

    def evict(self, window: int) -> None:
        """Keep the static slots and the last `window` dynamic positions, compacted."""
        drop = self.dynamic_length - window
        if drop <= 0:
            return
        self.cache.keep(self.static, torch.arange(drop, self.dynamic_length))
        self.dynamic_start += drop


def chunk_scores(keys: torch.Tensor, query: torch.Tensor, chunk: int) -> torch.Tensor:
    """Relevance of each chunk of `chunk` slots to the query, per layer.

    keys [layers, kv_heads, n_chunks * chunk, head_dim]; query [layers, kv_heads, head_dim]
    -> scores [layers, n_chunks]: query · (mean key of the chunk), summed over kv heads.
    """
    layers, heads, slots, head_dim = keys.shape
    if slots % chunk:
        raise ValueError(f"{slots} slots do not split into chunks of {chunk}")
    chunk_keys = keys.float().reshape(layers, heads, slots // chunk, chunk, head_dim).mean(dim=3)  # [L, H, C, D]
    return torch.einsum("lhcd,lhd->lc", chunk_keys, query.float())


def select_chunks(scores: torch.Tensor, keep: int, chunk: int) -> torch.Tensor:
    """Slots of the `keep` best-scoring chunks per layer, ascending: scores [layers, n_chunks] -> [layers, keep * chunk]."""
    best = scores.topk(min(keep, scores.shape[1]), dim=1).indices.sort(dim=1).values  # [layers, keep]
    offsets = torch.arange(chunk, device=scores.device)  # [chunk]
    return (best[:, :, None] * chunk + offsets).flatten(1)


def build_retrieval_cache(
    runner: Transformer, full: KVCache, chunk: int, budget: int, recent: int, query: torch.Tensor | None = None
) -> SparseCache:
    """A TriForce retrieval cache from a full prompt cache of `full.length` slots (positions 0..).

    The last `recent`…`recent + chunk − 1` positions (so the rest splits into whole chunks) are kept
    as the dynamic run; of the earlier positions, the `budget // chunk` chunks scoring best against
    `query` [layers, kv_heads, head_dim] are kept per layer (each layer may keep different chunks).
    Without a query, the mean key of the recent run stands in for it (the runner exposes no queries).
    """
    if chunk < 1 or budget < 0 or recent < 0:
        raise ValueError(f"retrieval cache needs chunk ≥ 1, budget ≥ 0, recent ≥ 0 (got {chunk}, {budget}, {recent})")
    length = full.length
    chunks = max(0, length - recent) // chunk
    dynamic_start = chunks * chunk
    if query is None:
        recent_keys = full.keys[:, :, dynamic_start:length] if length > dynamic_start else full.keys[:, :, :length]
        query = recent_keys.float().mean(dim=2)  # [layers, kv_heads, head_dim]
    if chunks * chunk <= budget:
        slots = torch.arange(dynamic_start).expand(full.keys.shape[0], -1)  # everything fits: keep it all
    else:
        slots = select_chunks(chunk_scores(full.keys[:, :, :dynamic_start], query, chunk), budget // chunk, chunk)
    static = slots.shape[1]
    cache = runner.new_cache(static + length - dynamic_start + 64)
    layer_index = torch.arange(full.keys.shape[0])[:, None]  # [layers, 1]
    for src, dst in ((full.keys, cache.keys), (full.values, cache.values)):
        dst[:, :, :static] = src[layer_index, :, slots].transpose(1, 2)  # [layers, kv_heads, static, head_dim]
        dst[:, :, static : static + length - dynamic_start] = src[:, :, dynamic_start:length]
    cache.length = static + length - dynamic_start
    return SparseCache(runner, cache, static, dynamic_start)
