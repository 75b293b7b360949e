"""A compact decoder-only transformer (Llama / Qwen2 family) built for speculative decoding.

Why not the Hugging Face module: verification needs (1) a static, position-indexed KV cache whose
rollback is setting a length, (2) a tree attention mask with per-node positions, (3) compaction of
the accepted tree path inside the cache, and (4) weights prepacked for the CPU's small-batch
kernels (see `linear.py`). The weights, config and tokenizer still come from a Hugging Face folder;
tests check the logits against the transformers implementation of the same config.

With `quant="int8"` every linear layer (and the head) is an `Int8Linear` (see `int8.py`): int8
weights quantized from the float32 folder once and cached (`layer_cache.py`), activations quantized per row, so a row's
logits do not depend on how many positions the forward pass holds. The rest of the layer (norms,
RoPE, attention, the KV cache) stays float32. `variant` then carries ",int8", which keeps measured
costs (`control/costs.py`) apart from the float model's. An int8 runner decodes and verifies chains
through `Int8Layers` (`kernels/int8.cpp`): the same operations as `_layers`, in one C++ call
per forward instead of ~70 Python-level operations per layer, which saves a step the Python overhead
(BENCHMARKS.md#avx2-int8-kernels-and-where-a-step-goes, `benchmarks/probes/int8_overhead.py`).

With `quant="kquant"` (`Transformer.from_gguf`) the weights are a GGUF file's own Q4_K / Q6_K blocks
(`gguf_weights.py`), run by `KQuantLinear` (`kquant.py`): also row-invariant, with the float32 rest
of the layer the same as int8's, and the token embedding dequantized row by row on lookup.

On a GPU a float runner replays its steps as CUDA graphs (`cuda_graphs.py`): `forward_static` is the
same stack with the cache length, positions and masks in device tensors, and caches come from a pool
of storages on which graphs were captured.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from verispec.errors import ModelNotFoundError
from verispec.models import kernels
from verispec.models.cuda_attention import static_attention, supports
from verispec.models.cuda_graphs import GraphSteps, StoragePool, graphs_wanted
from verispec.models.cuda_linear import row_kernels_wanted
from verispec.models.device import CPU
from verispec.models.int8 import Int8Linear
from verispec.models.kquant import (KQuantEmbedding, KQuantLinear, KQuantWeight, concat_rows, kquant_kernels, settle_padding,
                                    settle_prefetch)
from verispec.models.layer_cache import Int8Store, KQuantStore
from verispec.models.linear import PackedLinear
from verispec.models.runner import RunnerConfig, ragged_rows, row_logits

__all__ = ["ModelConfig", "KVCache", "Transformer"]

SUPPORTED_TYPES = ("qwen2", "llama")
QUANTIZATIONS = ("int8", "kquant")
# A quantized runner attends chains of up to this many new positions one query at a time, so that
# verifying γ+1 positions computes each exactly as decoding it alone would (see `Transformer`).
ROW_INVARIANT_POSITIONS = 32
PREFILL_PIECE = 256  # the most positions of one chain a forward pass runs at once (longer ones: in pieces)
AMX_PREFILL_PIECE = 128  # the same on kquant's AMX kernels (a prompt token 3.34 → 2.99 ms: BENCHMARKS.md, "AMX")


@dataclass(frozen=True)
class ModelConfig(RunnerConfig):
    """A Qwen2 / Llama config.json as the runner uses it: the shape every runner reports, and the rest."""

    hidden_size: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        model_type = hf.get("model_type", "?")
        if model_type not in SUPPORTED_TYPES:
            raise ModelNotFoundError(
                f"model type {model_type!r} is not supported by the verispec runner "
                f"(supported: {', '.join(SUPPORTED_TYPES)})"
            )
        if hf.get("rope_scaling") or (hf.get("rope_parameters") or {}).get("rope_type", "default") != "default":
            raise ModelNotFoundError(f"rope scaling {hf.get('rope_scaling') or hf.get('rope_parameters')} is not supported")
        heads = hf["num_attention_heads"]
        rope = hf.get("rope_parameters") or {}
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            attention_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )


class KVCache:
    """Static per-layer key/value storage indexed by slot; `length` slots are valid.

    Rolling back is `truncate(n)`; keeping an accepted tree path is `keep(start, slots)`.
    """

    def __init__(self, config: ModelConfig, capacity: int, dtype: torch.dtype, device: torch.device,
                 pool: StoragePool | None = None):
        self.pool = pool  # where the storage comes from and goes back to (a runner replaying CUDA graphs)
        if pool is not None:
            self.keys, self.values = pool.take(capacity)
        else:
            shape = (config.num_layers, config.num_kv_heads, capacity, config.head_dim)
            self.keys = torch.zeros(shape, dtype=dtype, device=device)  # [layers, kv_heads, capacity, head_dim]
            self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0
        self.ceiling: int | None = None  # doubling stops here (what the sequence can use); None: no cap

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    @torch.inference_mode()  # the slots are inference tensors once a forward has grown them
    def ensure(self, needed: int) -> None:
        """Grow so that `needed` slots fit: a pooled cache takes the pool's next capacity (a power of two),
        others double, at most to `ceiling` unless more is needed."""
        if needed <= self.capacity:
            return
        if self.pool is not None:  # the pool's next capacity that fits; the old storage goes back
            keys, values = self.pool.take(needed)
            keys[:, :, : self.length], values[:, :, : self.length] = self.keys[:, :, : self.length], self.values[:, :, : self.length]
            self.pool.give(self.keys, self.values)
            self.keys, self.values = keys, values
            return
        doubled = 2 * self.capacity if self.ceiling is None else min(2 * self.capacity, self.ceiling)
        new = max(needed, doubled)
        self.keys, self.values = (self._grown(old, new) for old in (self.keys, self.values))

    def _grown(self, old: torch.Tensor, capacity: int) -> torch.Tensor:
        """`old` [layers, kv_heads, capacity', head_dim] with room for `capacity` slots, the valid ones copied."""
        grown = old.new_zeros((*old.shape[:2], capacity, old.shape[3]))
        grown[:, :, : self.length] = old[:, :, : self.length]
        return grown

    @torch.inference_mode()
    def copied(self, length: int, capacity: int) -> KVCache:
        """A new cache of `capacity` slots (no ceiling) holding a copy of the first `length`."""
        twin = copy.copy(self)
        twin.length, twin.ceiling, twin.pool = length, None, None
        twin.keys, twin.values = (twin._grown(old, capacity) for old in (self.keys, self.values))  # its `length` slots copied
        return twin

    def tensors(self) -> dict[str, torch.Tensor]:
        """"keys" and "values" [layers, kv_heads, length, head_dim]: the valid slots (`Transformer.cache_from`)."""
        return {"keys": self.keys[:, :, : self.length], "values": self.values[:, :, : self.length]}

    @torch.inference_mode()
    def clone(self) -> KVCache:
        """An independent copy, of the same capacity and ceiling."""
        twin = copy.copy(self)  # length, ceiling, pool
        if self.pool is not None:  # a pooled storage of the same capacity (a beam's child replays graphs too)
            twin.keys, twin.values = self.pool.take(self.capacity)
            twin.keys[:, :, : self.length], twin.values[:, :, : self.length] = self.keys[:, :, : self.length], self.values[:, :, : self.length]
        else:
            twin.keys, twin.values = self.keys.clone(), self.values.clone()  # [layers, kv_heads, capacity, head_dim]
        return twin

    def release(self) -> None:
        """A pooled storage goes back to its pool (the cache is unusable after); otherwise nothing to give
        back: the storage goes with the object (a llama.cpp cache frees its sequence)."""
        if self.pool is not None and self.keys is not None:
            self.pool.give(self.keys, self.values)
            self.keys = self.values = None

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length

    @torch.inference_mode()
    def keep(self, start: int, slots: torch.Tensor) -> None:
        """Keep slots `start + slots` (ascending) packed right after `start`; drop the rest."""
        src = start + slots
        self.keys[:, :, start : start + len(slots)] = self.keys[:, :, src]
        self.values[:, :, start : start + len(slots)] = self.values[:, :, src]
        self.length = start + len(slots)


@dataclass
class _Row:
    """One row of a forward pass: `n` new tokens written to `cache` from slot `start`."""

    cache: KVCache
    start: int
    n: int
    positions: torch.Tensor  # [n] absolute positions, on the runner's device
    top: int  # the largest of `positions` (known on the host: reading it from a GPU would wait for it)
    mask: torch.Tensor | None  # [n, start + n] bool; None when a single token sees everything
    chain: bool = True  # consecutive positions with a causal mask (not a token tree)
    slots: torch.Tensor | None = None  # [n] the slots written, on the device: a static forward (`forward_static`)

    @cached_property
    def written(self) -> torch.Tensor:
        """[n] the slots this row writes, on the device (`cuda_attention.static_attention` reads up to the last)."""
        return self.slots if self.slots is not None else torch.arange(self.start, self.start + self.n, device=self.positions.device)

    @cached_property
    def visible(self) -> torch.Tensor:
        """[n, ≥ start + n] bool: the slots each new token attends to (`mask`, or everything up to itself)."""
        if self.mask is not None:
            return self.mask
        return torch.ones(self.n, self.start + self.n, dtype=torch.bool, device=self.positions.device)

    @cached_property
    def seen(self) -> list[slice | torch.Tensor]:
        """Per new token, the cache slots it attends to, in the order a single-token decode step would
        see them: a chain position's prefix, or a tree node's context then its ancestors and itself (a
        flattened tree puts parents before children, so slot order is path order). Computed once per
        forward pass, not per layer."""
        if self.chain:
            return [slice(0, self.start + i + 1) for i in range(self.n)]
        return [visible.nonzero()[:, 0] for visible in self.mask]  # mask [n, start + n]


def _linear_factory(pack: bool, quant: str | None, pack_rows: int = 1, store: Int8Store | KQuantStore | None = None):
    """How the runner builds the linear layer `name` from W [out, in] (`weight()` reads it; a layer from
    the int8 or kquant cache never does) and b [out] (or None)."""
    if quant is None:
        return lambda name, weight, bias: PackedLinear(weight(), bias, pack, pack_rows)
    if quant == "int8":
        return store.linear if store is not None else lambda name, weight, bias: Int8Linear.from_float(weight(), bias)
    if quant == "kquant":  # the file's blocks (tiles); a float weight in a k-quant file stays float, packed (row-invariant)
        return lambda name, weight, bias: (
            PackedLinear(w, bias, True, max(pack_rows, 2))
            if isinstance(w := store.tiles(name, weight) if store is not None else weight(), torch.Tensor)
            else KQuantLinear(w, bias)
        )
    raise ValueError(f"unknown quantization {quant!r}: use one of {', '.join(QUANTIZATIONS)} or None")


class _Weights:
    """Weights by name, each read on first use and cast to `dtype` on `device`. The source is a dict or `_Safetensors`
    (files read tensor by tensor), so building the runner never holds every float32 weight at once: what
    a layer needs is read, packed or quantized, and dropped before the next layer is read."""

    def __init__(self, source, dtype: torch.dtype, device: torch.device):
        self.source, self.dtype, self.device = source, dtype, device

    def __getitem__(self, name: str) -> torch.Tensor | KQuantWeight:
        tensor = self.source[name]
        return tensor.to(self.device, self.dtype) if isinstance(tensor, torch.Tensor) else tensor  # k-quant blocks stay as they are

    def get(self, name: str) -> torch.Tensor | None:
        return self[name] if name in self.source else None


class _Safetensors:
    """A read-only mapping over open safetensors files (`handles`); tensors are read on access."""

    def __init__(self, handles: list):
        self.where = {name: handle for handle in handles for name in handle.keys()}

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.where[name].get_tensor(name)


class _Layer:
    def __init__(self, weights: _Weights, prefix: str, config: ModelConfig, linear):
        w = lambda name: weights[prefix + name]  # noqa: E731
        b = lambda name: weights.get(prefix + name)  # noqa: E731
        self.input_norm = w("input_layernorm.weight")
        self.post_norm = w("post_attention_layernorm.weight")
        qkv_bias = None
        if config.attention_bias:
            qkv_bias = torch.cat([b("self_attn.q_proj.bias"), b("self_attn.k_proj.bias"), b("self_attn.v_proj.bias")])
        qkv = lambda: concat_rows(w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"), w("self_attn.v_proj.weight"))  # noqa: E731
        self.qkv = linear(prefix + "qkv", qkv, qkv_bias)
        self.o = linear(prefix + "o", lambda: w("self_attn.o_proj.weight"), b("self_attn.o_proj.bias"))
        self.gate_up = linear(prefix + "gate_up", lambda: concat_rows(w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")), None)
        self.down = linear(prefix + "down", lambda: w("mlp.down_proj.weight"), None)


class Transformer:
    """Inference-only decoder. `forward` appends tokens to a KVCache and returns logits.

    dtype: the dtype of activations, norms and the KV cache (and of the weights unless quantized);
    quant: None, "int8" for int8 linear layers, or "kquant" for a GGUF file's k-quant blocks
    (`from_gguf`; dtype must then be float32);
    pack_rows: the rows per forward the float linear layers are packed for (`linear.py`);
    store: where int8 or kquant layers come from (`from_folder` and `from_gguf` pass the weights' cache,
    `layer_cache.py`; without one they are quantized or repacked from the weights);
    device: where the weights, the RoPE table and every KV cache live (the CPU by default; int8 is
    CPU-only). `forward` takes tokens, positions and masks from anywhere and returns logits there. Steps
    replay as CUDA graphs on a GPU (`use_graphs`; float runners, unless VERISPEC_CUDA_GRAPHS=0).

    A quantized runner is row-invariant: the logits of a position do not depend on how many other
    positions the same forward pass holds, bit for bit. Its linear layers are (see `int8.py`), and so
    are embedding, norms, RoPE and the SiLU gate (elementwise or per-row reductions); batched
    `scaled_dot_product_attention` is not (its blocking changes with the number of queries), so feeds
    of 2..ROW_INVARIANT_POSITIONS positions, chains or token trees, attend one query at a time over
    exactly the keys, in the order, that a single-token step on that path would see (int8: one SDPA call
    per layer and position, a tree node's keys gathered from its ancestors' slots). Longer int8 feeds
    (prompt prefill) use one batched SDPA call: prefill is shared by speculative and plain decoding.
    kquant attends every feed, prompts included, with its extension's own attention (`kernels/attention.h`:
    every position of a layer in one call, each block of the cache read once for a run of positions and every
    query head that shares it, faster than SDPA here), so its prefill is row-invariant too: a prompt fed in
    chunks (a server's) or whole leaves the same cache, bit for bit. Float runners batch everything and are
    exact up to float rounding.

    A row's company in `forward_ragged` does not matter (float32, int8, and bfloat16 where oneDNN
    packs it): its logits (and cached keys/values) are the same bits whether it is fed alone or among
    other sequences' rows, since every operation is per position or per row (the linear layers too:
    int8's per-row scales, and a float target's `PackedLinear`, see `linear.py`) and attention runs per
    row against its own cache. So a request served among others gets what it gets alone
    (`tests/test_row_invariance.py`).
    """

    def __init__(
        self, config: ModelConfig, weights: dict[str, torch.Tensor] | _Safetensors, dtype: torch.dtype,
        pack: bool = True, quant: str | None = None, pack_rows: int = 1, store: Int8Store | KQuantStore | None = None,
        device: torch.device = CPU,
    ):
        if quant is not None and dtype != torch.float32:
            raise ValueError(f"{quant} weights run with float32 activations, not {dtype}")
        if quant is not None and device.type != "cpu":
            raise ValueError(f"{quant} weights run on the CPU only, not on {device}")
        self.config = config
        self.dtype = dtype
        self.quant = quant
        self.variant = (f",{quant}" if quant else "") + (f",rows={pack_rows}" if pack and pack_rows != 1 else "")
        if quant == "kquant":  # its costs are the kernels' own: a new kernel build, or other code of it, is measured anew
            self.variant += f",kernels={kernels.build_key('kquant')}:{kquant_kernels().kernels_in_use()}"
        self.row_invariant = quant is not None
        # a verifying target's GPU forwards on verispec's row-invariant kernels (`cuda_linear.py`, `cuda_attention.py`)
        rows_kernels = pack_rows > 1 and row_kernels_wanted(device)  # its linears take them (`PackedLinear`)
        self._rows_attention = rows_kernels and supports(config.head_dim)
        if rows_kernels:  # other kernels, other costs: timed apart
            self.variant += ",cuda-rows"
        # kquant's own attention (`kernels/attention.h`): every feed's positions each on its own, chains and trees
        self._exact_attend = kquant_kernels().attend if quant == "kquant" else None
        self._compiled: tuple = (None, None)  # (the layers it was built from, `Int8Layers`/`KQuantLayers` or None)
        linear = _linear_factory(pack, quant, pack_rows, store)
        weights = _Weights(weights, dtype, device)
        self.embed = weights["model.embed_tokens.weight"]  # [vocab, hidden]
        if isinstance(self.embed, KQuantWeight):
            self.embed = KQuantEmbedding(self.embed)
        self.device = self.embed.device
        self.layers = [_Layer(weights, f"model.layers.{i}.", config, linear) for i in range(config.num_layers)]
        self.final_norm = weights["model.norm.weight"]
        head = lambda: weights["lm_head.weight"] if not config.tie_word_embeddings else (  # noqa: E731
            self.embed.weight if isinstance(self.embed, KQuantEmbedding) else self.embed)
        self.lm_head = linear("lm_head", head, None)
        self._rope_cache = torch.empty(2, 0, config.head_dim, dtype=dtype, device=self.device)  # [cos/sin, positions, head_dim]
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2, dtype=torch.float64) / config.head_dim))
        self._inv_freq = inv_freq  # [head_dim / 2]
        # steps replayed as CUDA graphs (`cuda_graphs.py`): float runners on a GPU by default; `use_graphs(True)`
        # on a CPU runs the same static forwards eagerly (what the tests check)
        self.use_graphs(quant is None and graphs_wanted(self.device))

    @classmethod
    def from_folder(
        cls, folder: str | Path, dtype: torch.dtype = torch.float32, pack: bool = True, quant: str | None = None,
        pack_rows: int = 1, device: torch.device = CPU,
    ) -> Transformer:
        folder = Path(folder)
        config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ModelNotFoundError(f"no *.safetensors weights in {folder}")
        with contextlib.ExitStack() as stack:
            handles = [stack.enter_context(safe_open(file, framework="pt")) for file in files]
            store = Int8Store(folder) if quant == "int8" else None
            runner = cls(config, _Safetensors(handles), dtype, pack, quant, pack_rows, store, device)
        if store is not None:
            store.save()
        return runner

    @classmethod
    def from_gguf(cls, path: str | Path, config: ModelConfig, pack_rows: int = 1, requantize: bool = False) -> Transformer:
        """The `kquant` runner of a GGUF file: its k-quant blocks as they are (`gguf_weights.py`; repacked into
        the kernels' tiles once per file, `layer_cache.py`), with the file's own output head where it has one
        (llama.cpp uses it over a tied embedding).
        requantize: the tensors of other block types requantized (`models/requantize.py`), else an error."""
        from verispec.models.gguf_weights import GGUFWeights

        weights = GGUFWeights(path, config.num_heads, config.num_kv_heads, requantize)
        config = dataclasses.replace(config, tie_word_embeddings=not weights.has_output)
        store = KQuantStore(path, kernels.build_key("kquant"), bool(weights.requantized))  # the tiles, repacked once
        runner = cls(config, weights, torch.float32, quant="kquant", pack_rows=pack_rows, store=store)
        store.save()
        linears = [m for layer in runner.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        settle_prefetch(linears, runner.linear_bytes)
        settle_padding(linears + [runner.lm_head])  # after the prefetching it is measured with
        if weights.requantized:
            runner.variant += ",requantized"
        return runner

    def use_graphs(self, on: bool) -> None:
        """Replay steps as CUDA graphs (on a CPU: the same static forwards, run eagerly) or launch them as
        before. New caches come from a fresh storage pool; a runner copied with other layers (`variants.py`)
        calls this again to get graphs of its own."""
        if on and self.quant is not None:
            raise ValueError(f"{self.quant} runs its own kernels on the CPU: no CUDA graphs")
        self._graphs = GraphSteps(self, capture=self.device.type == "cuda") if on else None
        self._pool = StoragePool(self._new_storage) if on else None
        self.variant = self.variant.replace(",graphs", "") + (",graphs" if on and self._graphs.capture else "")

    @property
    def graphs(self) -> bool:
        """Whether steps replay as (CUDA) graphs: `use_graphs`."""
        return self._graphs is not None

    @property
    def step_graphs(self) -> GraphSteps | None:
        """Its replayed steps while `graphs` is on (`Runner.step_graphs`), else None."""
        return self._graphs

    def new_cache(self, capacity: int = 1024) -> KVCache:
        return KVCache(self.config, capacity, self.dtype, self.device, self._pool)

    @torch.inference_mode()
    def cache_from(self, tensors: dict[str, torch.Tensor], capacity: int) -> KVCache:
        """A new cache of `capacity` slots holding `KVCache.tensors`' keys and values [layers, kv_heads, length, head_dim]."""
        keys, values = tensors["keys"], tensors["values"]
        expected = (self.config.num_layers, self.config.num_kv_heads, keys.shape[2], self.config.head_dim)
        if keys.shape != expected or values.shape != expected or keys.shape[2] > capacity:
            raise ValueError(f"cached keys/values {tuple(keys.shape)} do not fit this model's cache {expected} of {capacity} slots")
        cache = self.new_cache(capacity)
        cache.keys[:, :, : keys.shape[2]], cache.values[:, :, : keys.shape[2]] = keys, values
        cache.length = keys.shape[2]
        return cache

    def prepare_decoding(self) -> None:
        """Nothing to measure (`Runner.prepare_decoding`)."""

    def placeholder_cache(self, length: int, capacity: int) -> KVCache:
        """A new cache whose first `length` slots count as held: zero keys and values (or a pooled storage's
        stale ones). Attention's arithmetic does not depend on the values, so a forward after them takes the
        time it takes after a real context of that length, without the prefill (most of a first run's
        measuring on a CPU): the cost model's timings only."""
        cache = self.new_cache(max(capacity, length))
        cache.length = length
        return cache

    def _new_storage(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed keys and values [layers, kv_heads, capacity, head_dim] for the storage pool."""
        cfg = self.config
        shape = (cfg.num_layers, cfg.num_kv_heads, capacity, cfg.head_dim)
        return (torch.zeros(shape, dtype=self.dtype, device=self.device), torch.zeros(shape, dtype=self.dtype, device=self.device))

    def prefilled_cache(self, prompt_ids: list[int], spare: int = 64) -> KVCache:
        """A cache holding prompt_ids[:-1] (the last prompt token is fed with the first step), with room
        for `spare` more slots."""
        cache = self.new_cache(len(prompt_ids) + spare)
        if len(prompt_ids) > 1:
            self.forward(cache, torch.tensor(prompt_ids[:-1]), logits="none")
        return cache

    def _rope(self, positions: torch.Tensor, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin at `positions` [n] (all below `needed`), from a table grown on the host in float64."""
        if self._rope_cache.shape[1] < needed:
            size = max(needed, 2 * self._rope_cache.shape[1], 1024)
            angles = torch.outer(torch.arange(size, dtype=torch.float64), self._inv_freq)  # [size, head_dim/2]
            angles = torch.cat([angles, angles], dim=-1)
            self._rope_cache = torch.stack([angles.cos(), angles.sin()]).to(self.device, self.dtype)  # [2, size, head_dim]
        cos, sin = self._rope_cache[:, positions]
        return cos, sin  # [n, head_dim] each

    @staticmethod
    def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.is_cuda:  # one fused kernel instead of eight (a GPU step is launch-bound); the CPU keeps its bits
            return F.rms_norm(x, weight.shape, weight, eps)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    @torch.inference_mode()
    def forward(
        self,
        cache: KVCache,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        logits: str = "all",
    ) -> torch.Tensor:
        """Run `tokens` [n] after the cache's `length` slots and append their keys/values.

        positions: [n] absolute positions (default: consecutive after the cache);
        tree_mask: [n, n] bool, True where new token i may attend to new token j (default causal);
        logits: "all" -> [n, vocab], "last" -> [1, vocab], "none" -> None. Logits are float32.
        A long chain (a prompt) runs in pieces (`_prefill_piece`): the activations of a piece stay in the CPU's
        caches (faster: BENCHMARKS.md, "What made kquant fast").
        """
        n = tokens.shape[0]
        if self._graphs is not None and logits != "none" and self._graphs.fits(cache, n, positions, tree_mask):
            out = self._graphs.forward(cache, tokens, positions, tree_mask)  # [n, vocab], or None: no room for a graph
            if out is not None:
                return out if logits == "all" else out[-1:]
        # (a decode step or a verification, n ≤ AMX_PREFILL_PIECE ≤ any piece, asks nothing of the kernels)
        if positions is None and tree_mask is None and logits != "all" and n > AMX_PREFILL_PIECE and n > (piece := self._prefill_piece()):
            for first in range(0, n - piece, piece):
                self.forward(cache, tokens[first : first + piece], logits="none")
            rest = (n - 1) % piece + 1
            return self.forward(cache, tokens[n - rest :], logits=logits)
        row = self._row(cache, n, positions, tree_mask)
        x = self._run(tokens.to(self.device), [row])  # [n, hidden]
        if logits == "none":
            return None
        if logits == "last":
            x = x[-1:]
        return self._logits(x)

    def _prefill_piece(self) -> int:
        """The most positions of a prompt one pass feeds: `AMX_PREFILL_PIECE` on kquant's AMX kernels (measured there;
        a piece reads every weight once, so elsewhere the larger `PREFILL_PIECE`)."""
        return AMX_PREFILL_PIECE if self.quant == "kquant" and kquant_kernels().kernels_in_use() == "amx" else PREFILL_PIECE

    @torch.inference_mode()
    def forward_static(self, cache: KVCache, tokens: torch.Tensor, start: torch.Tensor, positions: torch.Tensor | None,
                       tree: torch.Tensor | None) -> torch.Tensor:
        """`forward` with every value that changes from step to step in a device tensor, so that a CUDA
        graph captured once replays it (`cuda_graphs.py`): tokens [n] after the first `start` [1] slots;
        a chain (positions and tree None) at positions start … start+n−1, or a token tree's positions [n]
        and mask over its nodes tree [n, n]. Keys and values go to slots start + i; every query attends
        over the whole storage under a mask of the slots it sees. Logits [n, vocab]. Leaves
        `cache.length` alone: the caller sets it (it is host state, not part of a graph)."""
        n, capacity = tokens.shape[0], cache.capacity
        steps = torch.arange(n, device=self.device)  # [n]
        slots = start + steps  # [n]
        if tree is None:
            positions, tree = slots, steps[None, :] <= steps[:, None]  # a chain: causal over its nodes, [n, n]
        relative = torch.arange(capacity, device=self.device) - start  # [capacity]: slot − start
        new = (relative >= 0) & (relative < n)
        mask = (relative < 0)[None, :] | (new[None, :] & tree[:, relative.clamp(0, n - 1)])  # [n, capacity]
        row = _Row(cache, cache.length, n, positions, self.config.max_position_embeddings - 1, mask, chain=False, slots=slots)
        return self._logits(self._layers(self._embed(tokens), [row], *self._rope_rows([row])))  # [n, vocab]

    @torch.inference_mode()
    def forward_ragged(
        self,
        caches: list[KVCache],
        feeds: list[torch.Tensor],
        positions: list[torch.Tensor | None] | None = None,
        tree_masks: list[torch.Tensor | None] | None = None,
        logits: str | Sequence[str] = "all",
    ) -> list[torch.Tensor | None]:
        """Several independent rows in ONE pass: feeds[i] [n_i] is appended to caches[i].

        All rows' new tokens form one [Σn_i, hidden] activation, so every linear layer reads its
        weights once for the whole batch (the point on a memory-bound CPU); attention runs per row
        against that row's own cache. positions[i] [n_i] and tree_masks[i] [n_i, n_i] work as in
        `forward` (None: consecutive positions, causal mask), so a row may be a token tree.
        Returns logits per row (`logits`: one mode, or one per row): [n_i, vocab] ("all"), its last
        position's [1, vocab] ("last") or None ("none"); the head scores only the positions asked for.
        """
        positions, tree_masks = ragged_rows(caches, feeds, positions, tree_masks)
        modes = row_logits(logits, len(feeds))
        rows = [
            self._row(cache, feed.shape[0], pos, mask)
            for cache, feed, pos, mask in zip(caches, feeds, positions, tree_masks)
        ]
        x = self._run(torch.cat([feed.to(self.device) for feed in feeds]), rows)  # [Σn_i, hidden]: feeds on any device
        if all(mode == "all" for mode in modes):
            return list(self._logits(x).split([row.n for row in rows]))
        ends = itertools.accumulate(row.n for row in rows)  # each row's end in x
        wanted = [range(end - row.n, end) if mode == "all" else range(end - 1, end) if mode == "last" else range(0)
                  for row, end, mode in zip(rows, ends, modes)]  # per row: its positions of x to score
        picked = [i for positions in wanted for i in positions]
        if not picked:
            return [None] * len(rows)
        scored = self._logits(x[torch.tensor(picked, device=self.device)]).split([len(w) for w in wanted])  # [len(w), vocab] each
        return [None if mode == "none" else logits_row for logits_row, mode in zip(scored, modes)]

    def _row(self, cache: KVCache, n: int, positions: torch.Tensor | None, tree_mask: torch.Tensor | None) -> _Row:
        start = cache.length
        cache.ensure(start + n)
        if positions is None:
            positions, top = torch.arange(start, start + n, device=self.device), start + n - 1
        else:  # given by the caller (a tree's layout, TriForce's retrieved positions): usually on the host
            top, positions = int(positions.max()), positions.to(self.device)
        if tree_mask is None and n == 1:
            mask = None
        else:
            if tree_mask is not None:
                local = tree_mask.to(self.device)  # [n, n]
            else:
                local = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
            mask = torch.cat([torch.ones(n, start, dtype=torch.bool, device=self.device), local], dim=1)  # [n, start+n]
        return _Row(cache, start, n, positions, top, mask, chain=tree_mask is None)

    def _run(self, tokens: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
        """The decoder stack over tokens [N] (the rows' new tokens, concatenated) -> hidden [N, hidden]."""
        cos, sin = self._rope_rows(rows)
        x = self._embed(tokens)  # [N, hidden]
        compiled = self._compiled_layers() if all(self._compiled_takes(row) for row in rows) else None
        if compiled is not None:  # the same operations as `_layers`, in one C++ call (a server's batch too)
            x = compiled.forward(x, [row.cache.keys for row in rows], [row.cache.values for row in rows],
                                 [row.start for row in rows], [row.n for row in rows], cos, sin,
                                 [None if row.chain else row.mask for row in rows])
        else:
            x = self._layers(x, rows, cos, sin)
        for row in rows:
            row.cache.length = row.start + row.n
        return x

    def _compiled_takes(self, row: _Row) -> bool:
        """Whether the compiled stack attends `row` as `_attend_rows` would: on the exact attention any row (a chain,
        a token tree — the attention takes its mask — or a prompt's piece), else a chain of up to 32 positions."""
        return self._exact_attend is not None or (row.n <= ROW_INVARIANT_POSITIONS and row.chain)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [N] -> their embeddings [N, hidden]."""
        return self.embed(tokens) if isinstance(self.embed, KQuantEmbedding) else F.embedding(tokens, self.embed)

    def _rope_rows(self, rows: list[_Row]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [1, N, head_dim] at the rows' positions, concatenated."""
        cos, sin = self._rope(torch.cat([row.positions for row in rows]), max(row.top for row in rows) + 1)
        return cos[None], sin[None]

    def _layers(self, x: torch.Tensor, rows: list[_Row], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] through every decoder layer, keys and values appended to the rows' caches."""
        cfg = self.config
        total = x.shape[0]
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        for i, layer in enumerate(self.layers):
            h = self._rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
            qkv = layer.qkv(h)  # [N, q_size + 2 kv_size]
            q = qkv[:, :q_size].view(total, cfg.num_heads, cfg.head_dim).transpose(0, 1)  # [heads, N, head_dim]
            k = qkv[:, q_size : q_size + kv_size].view(total, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
            v = qkv[:, q_size + kv_size :].view(total, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            attn = self._attend_rows(i, rows, q, k, v)  # [heads, N, head_dim]
            x = x + layer.o(attn.transpose(0, 1).reshape(total, q_size))
            h = self._rms_norm(x, layer.post_norm, cfg.rms_norm_eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        return x

    @property
    def exact_positions(self) -> int | None:
        """The most new positions one forward scores bit for bit as single-token steps would (a
        row-invariant runner: longer feeds attend in one batched call), or None when no bound applies
        (float runners are exact only up to rounding at any width)."""
        return ROW_INVARIANT_POSITIONS if self.row_invariant else None

    def exact_positions_after(self, length: int) -> int | None:
        return self.exact_positions  # the same at every cache length

    # -- declared capabilities (the runner protocol, `models/runner.py`) ---------------------------
    supports_trees = True  # a token tree is a tree mask over the same static cache

    @property
    def batch_invariant(self) -> bool:
        """A quantized runner: its linears compute each row alone and its attention each position (float ones: not
        promised — a draft's layers packed for one row run `F.linear`, whose kernels follow the row count)."""
        return self.row_invariant

    @property
    def prefix_invariant(self) -> bool:
        """kquant: its linears and its own attention compute every position alone (prompts included)."""
        return self._exact_attend is not None

    @property
    def precision(self) -> str:
        """The quantization ('int8', 'kquant'), else the dtype's name ('float32', 'bfloat16')."""
        return self.quant or str(self.dtype).removeprefix("torch.")

    @property
    def compiled(self) -> bool:
        """Whether decode steps and chain verifications run the C++ decoder stack (`_compiled_layers`)."""
        return self._compiled_layers() is not None

    @property
    def linear_bytes(self) -> int:
        """Bytes of the linear layers and the head, the weights every decode token reads (packed layers
        counted by their shape, int8 ones by their int8 values, scales and bias)."""
        linears = [self.lm_head] + [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return sum(lin.nbytes for lin in linears)

    @property
    def weight_bytes(self) -> int:
        """Bytes of every weight: the linear layers, the embedding and the norms."""
        norms = sum(layer.input_norm.numel() + layer.post_norm.numel() for layer in self.layers)
        floats = (self.final_norm.numel() + norms) * self.final_norm.element_size()
        embed = self.embed.nbytes if isinstance(self.embed, KQuantEmbedding) else self.embed.numel() * self.embed.element_size()
        return self.linear_bytes + floats + embed

    @property
    def cache_bytes_per_position(self) -> int:
        cfg = self.config
        return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.finfo(self.dtype).bits // 8

    def _compiled_layers(self):
        """The decoder stack as one C++ object (`kernels/decoder.h`: `Int8Layers` for an int8 runner whose
        layers all run fbgemm with the residual row, `KQuantLayers` for a kquant runner); None otherwise or
        without the extension. Built once per list of layers (a runner copied with fewer layers, as
        `self:layers=L` does, gets its own)."""
        if self.quant not in ("int8", "kquant"):
            return None
        key = tuple(self.layers)  # the layer objects themselves (compared by identity, kept alive)
        if self._compiled[0] != key:
            self._compiled = key, self.compiled_stack(kernels.extension(self.quant))
        return self._compiled[1]

    def compiled_stack(self, extension):
        """The C++ decoder stack of this runner's layers as `extension` builds it (`kernels.extension(self.quant)`, or
        another build of the same source a probe compares), or None without one or where a layer does not suit it."""
        if extension is None:
            return None
        cfg = self.config
        shape = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps)
        linears = [m for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        if self.quant == "kquant":
            if not all(isinstance(m, KQuantLinear) for m in linears):
                return None
            parts = lambda m: (m.packed, m.kinds, m.columns, m.bias)  # noqa: E731
            layers = [(layer.input_norm, layer.post_norm, *(parts(m) for m in (layer.qkv, layer.o, layer.gate_up, layer.down)))
                      for layer in self.layers]
            return extension.KQuantLayers(layers, *shape)
        if not all(m.use_fbgemm and m.residual for m in linears):
            return None
        layers = [(layer.input_norm, layer.post_norm, layer.qkv.packed, layer.qkv.bias, layer.o.packed, layer.o.bias,
                   layer.gate_up.packed, layer.down.packed) for layer in self.layers]
        return extension.Int8Layers(layers, *shape)

    def _attend_rows(self, layer: int, rows: list[_Row], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store each row's keys/values in its cache and attend over it: q [heads, N, hd] -> [heads, N, hd]."""
        scale = 1.0 / math.sqrt(self.config.head_dim)
        outputs, offset = [], 0
        for row in rows:
            end = row.start + row.n
            queries = q[:, offset : offset + row.n]  # [heads, n, hd]
            storage_keys, storage_values = row.cache.keys[layer], row.cache.values[layer]  # [kv_heads, capacity, hd]
            if row.slots is not None:  # a static forward: written at device-given slots
                storage_keys.index_copy_(1, row.slots, k[:, offset : offset + row.n])
                storage_values.index_copy_(1, row.slots, v[:, offset : offset + row.n])
            else:
                storage_keys[:, row.start : end] = k[:, offset : offset + row.n]
                storage_values[:, row.start : end] = v[:, offset : offset + row.n]
            offset += row.n
            if self._rows_attention:  # each query as its decode step computes it, in any call
                outputs.append(static_attention(queries, storage_keys, storage_values, row.visible, row.written, scale))
            elif row.slots is not None:  # attention over the whole storage under the mask
                outputs.append(F.scaled_dot_product_attention(
                    queries[None], storage_keys[None], storage_values[None], attn_mask=row.mask, scale=scale, enable_gqa=True,
                )[0])  # [heads, n, head_dim]
            elif self._exact_attend is not None:  # every position on its own, in one call (a prompt's too: as fast as SDPA)
                outputs.append(self._exact_attend(queries, storage_keys, storage_values, row.start,
                                                  None if row.chain else row.mask, scale))
            elif self.row_invariant and 1 < row.n <= ROW_INVARIANT_POSITIONS:
                for i in range(row.n):  # each position exactly as a single-token decode step computes it
                    seen = row.seen[i]
                    outputs.append(F.scaled_dot_product_attention(
                        queries[None, :, i : i + 1], storage_keys[:, seen][None], storage_values[:, seen][None],
                        scale=scale, enable_gqa=True,
                    )[0])  # [heads, 1, head_dim]
            else:
                causal = row.chain and row.start == 0 and row.n > 1  # a whole prompt: SDPA's own causal blocking, no mask
                outputs.append(F.scaled_dot_product_attention(
                    queries[None], storage_keys[None, :, :end], storage_values[None, :, :end],
                    attn_mask=None if causal else row.mask, is_causal=causal, scale=scale, enable_gqa=True,
                )[0])  # [heads, n, head_dim]
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self._rms_norm(x, self.final_norm, self.config.rms_norm_eps)).float()  # [rows, vocab]
