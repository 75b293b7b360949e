"""A Hugging Face backend: any `transformers` causal LM behind the runner protocol (`models/runner.py`).

verispec's own `Transformer` implements Qwen2 and Llama only; `HFRunner` runs every other
architecture transformers knows (Gemma 3, Phi-3, Mistral, …) from the same kind of folder, so the
engine, the drafters and the server work on them unchanged. It is slower than the own runner (no
prepacked weights, a growing cache) but exact in the same sense: float32 logits of a chain forward
equal those of one plain forward over the whole sequence up to float rounding.

How the protocol maps onto transformers:
- a cache is an `HFCache` around a `DynamicCache` whose layers all keep every position (plain
  `DynamicLayer`s, also for sliding-window layers: the model's own mask hides what lies outside a
  window), so rolling back is `DynamicCache.crop` and keeping an accepted tree path is a gather of
  the kept slots' keys/values per layer;
- a chain is fed as HF feeds it (its own causal / sliding masks, consecutive positions);
- a token tree is fed with per-node `position_ids` and a 4-D additive mask [1, 1, n, past + n]
  per attention kind (a dict {layer type: mask} when the model mixes full and sliding-window
  layers, as Gemma 3 does). Whether the architecture honours such a mask is checked once, when the
  runner is built, by scoring a two-leaf tree against the chains it stands for (`supports_trees`);
  one that does not runs chains only: a tree drafter is refused when an engine takes it, and a tree
  fed to `forward` raises an error saying so.
"""

from __future__ import annotations

import copy
import inspect
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from verispec.errors import InvalidParameterError, ModelNotFoundError, PromptError
from verispec.models.runner import RunnerConfig, ragged_rows, row_logits, tensor_bytes

__all__ = ["HFCache", "HFRunner"]

# Layer kinds whose cache is keys/values per position (what crop and gather work on); a layer with a
# recurrent or convolution state (Mamba, linear attention) cannot be rolled back this way.
ATTENTION_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
# Layer kinds a tree mask can be built for (chunked attention's chunk boundaries are not modelled).
TREE_TYPES = ("full_attention", "sliding_attention")


class HFCache:
    """One sequence's keys/values in a `DynamicCache`: positions 0 … length−1 are valid."""

    def __init__(self, runner: HFRunner):
        from transformers import DynamicCache

        self.runner = runner
        self.kv = DynamicCache()  # no config: every layer a plain DynamicLayer that keeps all positions
        self.length = 0
        self.ceiling: int | None = None  # unused: a DynamicCache grows by exactly what is fed

    @property
    def capacity(self) -> int:
        return self.runner.config.max_position_embeddings

    def ensure(self, needed: int) -> None:
        if needed > self.capacity:
            raise PromptError(f"{needed} positions do not fit the model's context of {self.capacity} tokens")

    def truncate(self, length: int) -> None:
        """Keep the first `length` positions."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        if length < self.length:
            self.kv.crop(length - self.length)  # a negative count: the positions to remove
        self.length = length

    @torch.inference_mode()
    def keep(self, start: int, slots: torch.Tensor) -> None:
        """Keep the fed nodes `start + slots` (ascending, root first) packed right after `start`; drop the rest."""
        slots = torch.as_tensor(slots, dtype=torch.long)
        if len(slots) and (int(slots.min()) < 0 or start + int(slots.max()) >= self.length):
            raise ValueError(f"cannot keep slots {slots.tolist()} after {start} in a cache of length {self.length}")
        index = torch.cat([torch.arange(start), start + slots]).to(self.runner.device)  # [start + k] slots to keep, in order
        for layer in self.kv.layers:
            if layer.keys is None or layer.keys.numel() == 0:
                continue
            layer.keys = layer.keys.index_select(-2, index)  # [1, kv_heads, start + k, head_dim]
            layer.values = layer.values.index_select(-2, index)
        self.length = start + len(slots)

    @torch.inference_mode()
    def clone(self) -> HFCache:
        """An independent copy (every layer's keys/values copied)."""
        twin = HFCache(self.runner)
        twin.kv, twin.length = copy.deepcopy(self.kv), self.length
        return twin

    def release(self) -> None:
        """Drop the keys/values (the object may be reused as an empty cache)."""
        self.truncate(0)


class HFRunner:
    """A `transformers.AutoModelForCausalLM` behind verispec's runner protocol (see the module docstring).

    model: the loaded HF model (eval mode); its dtype and device are the runner's (float32 on the CPU by
    default): inputs are moved there, logits come back there;
    model_type: the folder's `config.json` model type (for messages and `config`).
    """

    variant = ",hf"
    compiled = False  # transformers' own modules run
    step_graphs = None  # transformers' modules, launched from the host
    linear_bytes = None  # not told apart from the other weights
    cache_bytes_per_position = None  # a DynamicCache grows by what is fed

    def __init__(self, model, model_type: str | None = None):
        from transformers.cache_utils import get_layer_types_and_kwargs

        self.model = model.eval()
        text = model.config.get_text_config(decoder=True)
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
        odd = sorted(set(layer_types) - set(ATTENTION_TYPES))
        model_type = model_type or getattr(model.config, "model_type", "?")  # getattr: a transformers config, not ours
        if odd:
            raise ModelNotFoundError(
                f"model type {model_type!r} has {', '.join(odd)} layers, whose state cannot be rolled back by the "
                "Hugging Face runner (it runs attention-only models): use --dtype gguf (llama.cpp) for it"
            )
        # the cache's keyword: `cache` in newer transformers (which deprecate `past_key_values`)
        self._cache_keyword = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
        # per layer kind, the sliding window a tree mask must apply (None: full attention)
        self._windows = {kind: kwargs.get("sliding_window") for kind, kwargs in zip(layer_types, layer_kwargs)}
        heads = int(text.num_attention_heads)
        # getattr: a transformers config, whose optional fields differ by architecture (absent: HF's own defaults)
        self.config = RunnerConfig(
            model_type=model_type,
            vocab_size=int(text.vocab_size),
            max_position_embeddings=int(getattr(text, "max_position_embeddings", None) or 4096),
            num_layers=int(text.num_hidden_layers),
            num_heads=heads,
            num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
        )
        self.supports_trees = self._scores_trees()  # measured now: a tree drafter is refused at load, not mid-request

    @classmethod
    def from_folder(cls, folder: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> HFRunner:
        """The Hugging Face model in `folder` (config.json + safetensors) in `dtype`, on `device` (None: the CPU)."""
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        folder = Path(folder)
        model_type = json.loads((folder / "config.json").read_text()).get("model_type", "?")
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # verispec's own status line says what is loading
        try:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
            if device is not None:
                model = model.to(device)
        except (ValueError, KeyError, OSError) as error:
            raise ModelNotFoundError(f"transformers cannot load {folder} (model type {model_type!r}): {error}") from error
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        return cls(model, model_type)

    # -- declared capabilities (the runner protocol, `models/runner.py`) ---------------------------
    @property
    def precision(self) -> str:
        return {torch.float32: "hf", torch.float16: "hf-float16"}.get(self.dtype, "hf-bfloat16")

    @property
    def weight_bytes(self) -> int:
        """Bytes of the module's parameters and buffers (a tied head counted once)."""
        return tensor_bytes([*self.model.parameters(), *self.model.buffers()])

    prefix_invariant = False  # HF's batched attention rounds a chunk differently from a whole prompt
    batch_invariant = True  # `forward_ragged` runs one forward per row

    @property
    def exact_positions(self) -> int | None:
        """No bound: HF's batched attention rounds a multi-position forward differently from one position."""
        return None

    def exact_positions_after(self, length: int) -> int | None:
        return None

    # -- caches ----------------------------------------------------------------------------------
    def new_cache(self, capacity: int = 0) -> HFCache:
        return HFCache(self)

    def prepare_decoding(self) -> None:
        """Nothing to measure (`Runner.prepare_decoding`)."""

    def placeholder_cache(self, length: int, capacity: int) -> None:
        """None: a context must be fed here to be timed (`Runner.placeholder_cache`)."""
        return None

    def prefilled_cache(self, prompt_ids: list[int], spare: int = 0) -> HFCache:
        """A cache holding prompt_ids[:-1] (the last prompt token is fed with the first step)."""
        cache = self.new_cache()
        if len(prompt_ids) > 1:
            self.forward(cache, torch.tensor(prompt_ids[:-1]), logits="none")
        return cache

    # -- forward ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, cache: HFCache, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None, logits: str = "all") -> torch.Tensor | None:
        """Feed `tokens` [n] after the cache's `length` positions and append their keys/values.

        positions: [n] absolute positions (default: consecutive after the cache); tree_mask: [n, n]
        bool, True where new token i sees new token j (default causal); logits: "all" -> [n, vocab],
        "last" -> [1, vocab], "none" -> None, float32.
        """
        if logits not in ("all", "last", "none"):
            raise ValueError(f"logits must be 'all', 'last' or 'none', got {logits!r}")
        n, past = int(tokens.shape[0]), cache.length
        cache.ensure(past + n)
        if positions is None:
            positions = torch.arange(past, past + n, device=self.device)
        mask = None
        if tree_mask is not None:
            if not self.supports_trees:
                raise InvalidParameterError(
                    f"model type {self.config.model_type!r} runs chains only in the Hugging Face runner (its attention "
                    "does not take a custom 4-D mask): use a chain drafter (model, ngram, hybrid, …), not a token tree"
                )
            mask = self._tree_masks(past, positions, tree_mask)
        return self._run(cache, tokens, positions, mask, logits)

    def _run(self, cache: HFCache, tokens: torch.Tensor, positions: torch.Tensor, mask, logits: str) -> torch.Tensor | None:
        """One model call: tokens [n] at positions [n] after the cache, with HF's own mask (None) or `mask`."""
        n, past = int(tokens.shape[0]), cache.length
        with torch.inference_mode():
            out = self.model(
                input_ids=tokens.view(1, n).to(self.device), position_ids=positions.view(1, n).to(self.device),
                attention_mask=mask, use_cache=True, **{self._cache_keyword: cache.kv},
                logits_to_keep=0 if logits == "all" else 1,  # 0: every position
            )
        cache.length = past + n
        if logits == "none":
            return None
        return out.logits[0].float()  # [n or 1, vocab]

    def forward_ragged(self, caches: list[HFCache], feeds: list[torch.Tensor],
                       positions: list[torch.Tensor | None] | None = None,
                       tree_masks: list[torch.Tensor | None] | None = None,
                       logits: str | Sequence[str] = "all") -> list[torch.Tensor | None]:
        """Several sequences' feeds, one forward each; per sequence the logits `forward` gives (`logits`: one mode,
        or one per sequence)."""
        positions, tree_masks = ragged_rows(caches, feeds, positions, tree_masks)
        return [self.forward(cache, feed, pos, mask, mode)
                for cache, feed, pos, mask, mode in zip(caches, feeds, positions, tree_masks, row_logits(logits, len(feeds)))]

    def _tree_masks(self, past: int, positions: torch.Tensor, tree_mask: torch.Tensor):
        """The additive masks [1, 1, n, past + n] of a token tree after `past` cached positions: node i
        sees every cached position and the nodes tree_mask[i] allows, within a layer kind's sliding
        window when it has one (measured in positions: cached slot j holds position j). One tensor when
        every layer is of one kind, else {layer kind: mask}."""
        n = int(positions.shape[0])
        if tree_mask.shape != (n, n):
            raise ValueError(f"tree_mask must be [{n}, {n}] for {n} fed tokens, got {list(tree_mask.shape)}")
        seen = torch.cat([torch.ones(n, past, dtype=torch.bool), tree_mask.bool().cpu()], dim=1)  # [n, past+n]
        key_positions = torch.cat([torch.arange(past), positions.cpu()])  # [past+n]
        distance = positions.cpu()[:, None] - key_positions[None, :]  # [n, past+n] query − key position
        low = torch.finfo(self.dtype).min
        masks = {}
        for kind, window in self._windows.items():
            if kind not in TREE_TYPES:
                raise InvalidParameterError(f"{kind} layers of {self.config.model_type!r} run chains only in the HF runner")
            visible = seen if window is None else seen & (distance < window)
            additive = torch.zeros(n, past + n, dtype=self.dtype).masked_fill(~visible, low)
            masks[kind] = additive[None, None].to(self.device)  # [1, 1, n, past+n]
        return next(iter(masks.values())) if len(masks) == 1 else masks

    def _scores_trees(self) -> bool:
        """Whether this architecture scores a token tree correctly: a root with two leaves, fed as one
        tree after a one-token prefix, must give each leaf the logits its own chain gives (a model that
        drops the custom mask lets the second leaf see the first; one that drops the positions shifts it)."""
        vocab = self.config.vocab_size
        prefix, root, left, right = (torch.tensor([t % vocab]) for t in (1, 2, 3, 4))
        try:
            cache = self.new_cache()
            self.forward(cache, prefix, logits="none")
            tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # root; left, right under it
            positions = torch.tensor([1, 2, 2])
            got = self._run(cache, torch.cat([root, left, right]), positions, self._tree_masks(1, positions, tree), "all")  # [3, vocab]
            want = []
            for leaf in (left, right):
                chain = self.new_cache()
                want.append(self.forward(chain, torch.cat([prefix, root, leaf]))[-1])  # [vocab]
        except Exception:  # noqa: BLE001 - an architecture that rejects the mask or the dict runs chains only
            return False
        tolerance = 1e-3 if self.dtype == torch.float32 else 5e-2
        scale = max(float(w.abs().max()) for w in want) + 1.0
        return all(torch.allclose(got[i + 1], w, rtol=0, atol=tolerance * scale) for i, w in enumerate(want))
