"""A step's forward captured once and replayed: CUDA graphs for verispec's own runner (issue #32).

On a GPU a decode step of a 1.5B model is ~1,000 small kernels; launched one by one from Python the
launches, not the GPU, set the pace. So each forward of 1 … MAX_WIDTH positions (a decode step, a
verification of γ+1, a draft model's step, a token tree) runs as a CUDA graph: captured the first time
a width meets a cache storage, then replayed with new inputs copied into its static buffers.

What may change between replays lives in device tensors the graph reads: the tokens, the first free
slot (`start`), and for a token tree its positions and mask. Keys and values are written with
`index_copy_` at `start + i` and attention runs over the whole storage under a mask of the valid
slots (`Transformer.forward_static`), so one graph serves every cache length. A graph is bound to the
addresses of the storage it was captured on; `StoragePool` hands storages back on `release` and out
again to the next request, so a new request's cache lands where graphs were captured already.

Without CUDA (`capture=False`: the CPU, tests) every "replay" runs the same static forward eagerly:
the bookkeeping and the static forward are tested on any machine, the capture itself on a GPU.
Prompts (chains over MAX_CHAIN positions) and batched rows (`forward_ragged`) run eagerly as before.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["MAX_CHAIN", "MAX_WIDTH", "GraphSteps", "StoragePool", "capture", "graphs_wanted"]

MAX_WIDTH = 64  # the widest token tree captured; longer feeds run eagerly
MAX_CHAIN = 32  # the longest chain captured (a step's γ+1; a longer one is a prompt, prefilled eagerly)
MIN_CAPACITY = 256  # the smallest storage the pool hands out (capacities are powers of two from here)
MAX_GRAPHS = 256  # captured graphs kept per runner; past this a new shape runs eagerly
KEEP_PER_CAPACITY = 4  # released storages the pool keeps per capacity (the rest are freed)


def graphs_wanted(device: torch.device) -> bool:
    """Whether a float runner on `device` replays its steps as CUDA graphs: on CUDA unless
    VERISPEC_CUDA_GRAPHS=0 (eager launches, for measuring what graphs save); =everywhere replays on a
    CPU too (the static forwards, eagerly), to run a test file through the replay path."""
    if os.environ.get("VERISPEC_CUDA_GRAPHS") == "everywhere":
        return True
    return device.type == "cuda" and os.environ.get("VERISPEC_CUDA_GRAPHS", "1") != "0"


class StoragePool:
    """Key/value storages of power-of-two capacities, taken by caches and given back on release.

    make(capacity) builds one storage (keys, values). A storage given back is handed out again to the
    next cache of that capacity, so the graphs captured on its addresses serve the next request too.
    """

    def __init__(self, make: Callable[[int], tuple[torch.Tensor, torch.Tensor]]):
        self.make = make
        self.free: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    @staticmethod
    def capacity_for(needed: int) -> int:
        """The storage capacity a cache of `needed` slots gets: the next power of two ≥ MIN_CAPACITY."""
        return max(MIN_CAPACITY, 1 << max(needed - 1, 0).bit_length())

    def take(self, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        capacity = self.capacity_for(needed)
        spare = self.free.get(capacity)
        return spare.pop() if spare else self.make(capacity)

    def give(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        spare = self.free.setdefault(keys.shape[2], [])  # keys [layers, kv_heads, capacity, head_dim]
        if len(spare) < KEEP_PER_CAPACITY:
            spare.append((keys, values))


@dataclass
class _Graph:
    """One captured forward: its static inputs, its output and the replay."""

    tokens: torch.Tensor  # [n] long
    start: torch.Tensor  # [1] long: the first slot written (the cache's length)
    positions: torch.Tensor | None  # [n] long, a tree's (a chain's follow from start inside the graph)
    tree: torch.Tensor | None  # [n, n] bool, a tree's mask over its own nodes
    logits: torch.Tensor | None  # [n, vocab] float32 once captured (written by every replay)
    cache: object = None  # the cache replayed on (its storage is the one the graph was captured on)
    replay: Callable[[], None] | None = None


class GraphSteps:
    """The captured forwards of one runner, by (storage, width, chain or tree).

    runner: a `Transformer` (its `forward_static` is what is captured); capture: record CUDA graphs
    (False: run the static forward eagerly on every replay, as on a CPU). Called from one thread at a
    time, as the runner is.
    """

    def __init__(self, runner, capture: bool):
        self.runner, self.capture = runner, capture
        self.graphs: dict[tuple, _Graph] = {}
        self.steps: dict[tuple, object] = {}  # the state of whole steps replayed for a caller (`replayed`), by its key
        self.captured_steps = 0
        self.failed: str | None = None  # why a capture failed (then every new shape runs eagerly)
        self.pool = torch.cuda.graph_pool_handle() if capture else None  # one memory pool for every graph's temporaries

    @staticmethod
    def replays_on(cache) -> bool:
        """Whether steps on `cache` may be captured: its storage comes from the pool, which keeps it (and the
        addresses a graph is bound to) for the next request; a storage of its own is freed with the cache."""
        return cache.pool is not None

    def fits(self, cache, n: int, positions: torch.Tensor | None, tree_mask: torch.Tensor | None) -> bool:
        """Whether a forward of `n` positions after `cache` can replay: a pooled storage, a step's width (a
        chain's, or a tree's), positions inside the model's context (the RoPE table a graph reads; TriForce's
        may lie past the slots)."""
        if not self.replays_on(cache) or not 1 <= n <= (MAX_WIDTH if tree_mask is not None else MAX_CHAIN):
            return False
        if positions is not None and int(positions.max()) >= self.runner.config.max_position_embeddings:
            return False
        return True

    def forward(self, cache, tokens: torch.Tensor, positions: torch.Tensor | None, tree_mask: torch.Tensor | None) -> torch.Tensor:
        """Feed tokens [n] after `cache` through the graph of this storage and width; logits [n, vocab]
        (a copy: the graph's output buffer is written again by the next replay), or None where no graph
        may be captured (MAX_GRAPHS reached, or a capture failed): the caller runs the forward eagerly."""
        n, start = tokens.shape[0], cache.length
        cache.ensure(start + n)  # a full storage is swapped for a bigger one first (new addresses, new graphs)
        chain = tree_mask is None and positions is None  # a chain's positions follow its slots
        if positions is not None and tree_mask is None:  # positions of their own (TriForce's): a causal "tree"
            tree_mask = torch.ones(n, n, dtype=torch.bool).tril()
        key = (cache.keys.data_ptr(), cache.values.data_ptr(), cache.capacity, n, chain)
        graph = self.graphs.get(key)
        if graph is None and (len(self.graphs) >= MAX_GRAPHS or self.failed):
            return None
        device = cache.keys.device
        if graph is None:
            graph = _Graph(torch.zeros(n, dtype=torch.long, device=device), torch.zeros(1, dtype=torch.long, device=device),
                           None if chain else torch.zeros(n, dtype=torch.long, device=device),
                           None if chain else torch.zeros(n, n, dtype=torch.bool, device=device), None)
        graph.tokens.copy_(tokens, non_blocking=True)
        graph.start.fill_(start)
        if not chain:
            graph.positions.copy_(positions, non_blocking=True)
            graph.tree.copy_(tree_mask, non_blocking=True)
        graph.cache = cache
        if graph.replay is None:
            try:
                self._record(graph)
            except RuntimeError as error:  # a capture the GPU refused: this runner launches eagerly from now on
                self.failed = f"{type(error).__name__}: {error}"
                warnings.warn(f"CUDA graph capture failed, running eagerly: {self.failed}", RuntimeWarning, stacklevel=2)
                return None
            self.graphs[key] = graph
        graph.replay()
        cache.length = start + n
        return graph.logits.clone()

    def _record(self, graph: _Graph) -> None:
        """Capture `graph`'s forward on its cache's storage (its inputs already loaded: the warm-up writes
        the same keys and values the first replay will)."""
        run = lambda: self.runner.forward_static(graph.cache, graph.tokens, graph.start, graph.positions, graph.tree)  # noqa: E731
        if not self.capture:
            def replay():
                graph.logits = run()

            graph.replay = replay
            return
        graph.logits, graph.replay = capture(run, graph.tokens.device, self.pool)  # logits [n, vocab], rewritten by each replay

    def forward_at(self, cache, tokens: torch.Tensor, start: torch.Tensor, positions: torch.Tensor | None = None,
                   tree: torch.Tensor | None = None) -> torch.Tensor:
        """`tokens` [n] (on the device) fed after the first `start` [1] slots, a device tensor, as a chain or (positions
        [n], tree [n, n] on the device) a token tree: logits [n, vocab] (`Transformer.forward_static`). Leaves
        `cache.length` to the caller."""
        return self.runner.forward_static(cache, tokens, start, positions, tree)

    def replayed(self, run: Callable[[], None]) -> Callable[[], None] | None:
        """`run` — device work on static tensors that reads nothing back to the host (a whole step:
        `engine/device_steps.py`, which keeps it in `steps`) — as a replay: captured as a CUDA graph, or on a CPU
        `run` itself. Capturing runs it once first (a warm-up), so its effects must be ones the caller can undo.
        None where no graph may be captured (MAX_GRAPHS reached, or a capture failed): the caller runs eagerly."""
        if not self.capture:
            return run
        if len(self.graphs) + self.captured_steps >= MAX_GRAPHS or self.failed:
            return None
        try:
            _, replay = capture(run, self.runner.device, self.pool)
        except RuntimeError as error:
            self.failed = f"{type(error).__name__}: {error}"
            warnings.warn(f"CUDA graph capture failed, running eagerly: {self.failed}", RuntimeWarning, stacklevel=2)
            return None
        self.captured_steps += 1
        return replay


def capture(run: Callable[[], object], device: torch.device, pool) -> tuple[object, Callable[[], None]]:
    """Capture `run` as a CUDA graph after one warm-up call off the capturing stream (libraries allocate their
    workspaces there); (what the captured call returned, allocated from `pool` and rewritten by each replay, the
    replay)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream(device).wait_stream(side)
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph, pool=pool):
        output = run()
    return output, cuda_graph.replay
