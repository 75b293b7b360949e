"""The runner seam: what the engine, the drafters and the server ask of a model, whatever runs it.

Three backends implement it: verispec's own `Transformer` (torch; float32, bfloat16, int8,
`models/transformer.py`), `LlamaCppRunner` (a GGUF file in llama.cpp, `models/llama_cpp.py`) and
`HFRunner` (any `transformers` causal LM, `models/hf_runner.py`). Nothing above `models/` knows which
one runs: it reads the typed `RunnerConfig` and the capabilities each runner declares (precision,
variant, tree support, exact width, weight bytes), never probes for attributes, and copies a cache
with `Cache.clone`. A capability a feature needs and the runner lacks is refused where the feature
is built (a token-tree drafter on a runner that scores chains only: `drafters/base.py`), not at its
first step.

`LoadedModel` bundles a runner with its tokenizer and stop ids (`models/loading.py` builds one);
`ragged_rows` and `row_logits` are the argument checks the backends' `forward_ragged` share; `tensor_bytes` counts
weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from verispec.errors import InvalidParameterError, PromptError
from verispec.models.cuda_graphs import GraphSteps
from verispec.models.infill import infill_format

__all__ = ["Cache", "LoadedModel", "Runner", "RunnerConfig", "ragged_rows", "row_logits", "tensor_bytes"]


@dataclass(frozen=True)
class RunnerConfig:
    """The model's shape as every runner reports it (the names of a Hugging Face config)."""

    model_type: str  # the architecture ("qwen2", "llama", "gemma3_text", a GGUF's general.architecture, …)
    vocab_size: int  # the width of a logits row
    max_position_embeddings: int  # the most positions one sequence may use (the context)
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (fewer than num_heads under grouped-query attention)
    head_dim: int  # the size of one head


class Cache(Protocol):
    """One sequence's keys/values: positions 0 … length−1 are valid."""

    length: int
    ceiling: int | None  # the most positions the sequence can use: a cache that grows ahead stops there

    def truncate(self, length: int) -> None:
        """Keep the first `length` positions (a rejected draft's are dropped)."""

    def keep(self, start: int, slots: torch.Tensor) -> None:
        """After a token tree: keep the fed nodes `slots` [k] (relative to `start`, root first) right
        after `start`, as if that path alone had been fed; drop the other nodes."""

    def clone(self) -> Cache:
        """An independent copy of the valid positions (a beam's second child continues from it)."""

    def copied(self, length: int, capacity: int) -> Cache:
        """A new cache of `capacity` positions holding a copy of the first `length` (prompt caching,
        `models/prefixes.py`; only a `prefix_invariant` runner's caches are asked)."""

    def tensors(self) -> dict[str, torch.Tensor]:
        """The valid positions as named tensors, what `Runner.cache_from` takes back (prompt caching kept on
        disk; only a `prefix_invariant` runner's caches are asked)."""

    def release(self) -> None:
        """The sequence is over: give back what it holds."""


class Runner(Protocol):
    """A model that scores new positions after a cache, for one sequence or several at once.

    Besides its config and dtype a runner declares what it can do, so that callers never probe:
    `precision`, `variant`, `supports_trees`, `batch_invariant`, `prefix_invariant`, `compiled`, `step_graphs`, the exact width (`exact_positions`,
    `exact_positions_after`) and its bytes (`weight_bytes`, `linear_bytes`, `cache_bytes_per_position`).
    """

    config: RunnerConfig
    dtype: torch.dtype  # of the logits' source activations (logits themselves are float32)
    device: torch.device  # where its weights, caches and logits live (llama.cpp: the CPU)

    @property
    def precision(self) -> str:
        """'float32', 'bfloat16', 'float16', 'int8', 'gguf', 'gguf-wide', 'hf', 'hf-bfloat16' or 'hf-float16': the precision name
        the CLI, server and benchmark use (and what a draft for it loads in by default)."""

    @property
    def variant(self) -> str:
        """Tags that keep measured costs apart (",int8", ",layers=12", ",gguf", ",hf", …; "" for none)."""

    @property
    def supports_trees(self) -> bool:
        """Whether `forward` scores a token tree (positions + tree mask); False: chains only."""

    @property
    def batch_invariant(self) -> bool:
        """Whether each row of `forward_ragged` gets the bits `forward` gives it alone, for feeds of up to
        `exact_positions`, whatever else the pass holds: drafts may then be batched across requests
        (`drafters/batching.py`) without changing any request's output."""

    @property
    def prefix_invariant(self) -> bool:
        """Whether a position's keys/values depend only on the tokens up to it, not on how they were fed
        (whole, in chunks, in verification passes): a cached prefix is then exact to reuse."""

    @property
    def compiled(self) -> bool:
        """Whether decode steps run a compiled decoder stack (its timings are kept apart)."""

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights the runner holds (for llama.cpp: the GGUF file it maps)."""

    @property
    def linear_bytes(self) -> int | None:
        """Bytes of the linear layers and head, the weights every decode step reads; None where the
        backend does not say."""

    @property
    def cache_bytes_per_position(self) -> int | None:
        """Bytes one cached position takes (keys and values of every layer) where the runner allocates
        them itself; None where the backend keeps its own cache (llama.cpp, Hugging Face)."""

    @property
    def exact_positions(self) -> int | None:
        """The most positions one forward scores bit for bit as single-token steps would, or None."""

    def exact_positions_after(self, length: int) -> int | None:
        """`exact_positions` for a forward after `length` cached positions (it may shrink as a cache grows)."""

    @property
    def step_graphs(self) -> GraphSteps | None:
        """Where a whole step may run on the runner's device without the host (`engine/device_steps.py`): its
        `GraphSteps` (`models/cuda_graphs.py`: a forward after a device-given start, whole steps captured as
        CUDA graphs); None for a runner that does not replay its steps."""

    def new_cache(self, capacity: int = ...) -> Cache: ...

    def cache_from(self, tensors: dict[str, torch.Tensor], capacity: int) -> Cache:
        """A new cache of `capacity` positions holding what `Cache.tensors` gave (only a `prefix_invariant`
        runner is asked)."""

    def prefilled_cache(self, prompt_ids: list[int], spare: int = ...) -> Cache:
        """A cache holding prompt_ids[:-1]: the last prompt token is fed with the first step."""

    def prepare_decoding(self) -> None:
        """Measure, once, what decoding reads beyond what loading measured (llama.cpp: its exact width after a long
        context); `Engine.prepare` calls it, so that no request waits for it."""

    def placeholder_cache(self, length: int, capacity: int) -> Cache | None:
        """A new cache of `capacity` positions whose first `length` count as held without being computed: for
        timing forwards after a context that long (`control/costs.py`), never for decoding. None where the
        backend must be fed its context (llama.cpp's cells, Hugging Face's cache)."""

    def forward(self, cache: Cache, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None, logits: str = "all") -> torch.Tensor | None:
        """Feed `tokens` [n] after the cache; logits "all" [n, vocab], "last" [1, vocab] or "none".
        A token tree passes positions [n] and tree_mask [n, n] (True where node i sees node j)."""

    def forward_ragged(self, caches: list[Cache], feeds: list[torch.Tensor],
                       positions: list[torch.Tensor | None] | None = None,
                       tree_masks: list[torch.Tensor | None] | None = None,
                       logits: str | Sequence[str] = "all") -> list[torch.Tensor | None]:
        """Several sequences' feeds in one pass; per sequence its logits, [n_i, vocab] ("all"), [1, vocab] ("last") or
        None ("none"); `logits` one mode for every row or one per row (`row_logits`: a prompt chunk riding in other
        requests' verification pass wants at most its last)."""


@dataclass
class LoadedModel:
    """A model ready to generate: its runner, its tokenizer and the token ids it stops on."""

    name: str
    folder: Path
    runner: Runner
    tokenizer: object  # `models/tokenizer.py`: a FastTokenizer or transformers' (None in tests that feed token ids only)
    eos_ids: frozenset[int]

    @property
    def vocab_size(self) -> int:
        return self.runner.config.vocab_size

    @property
    def context_length(self) -> int:
        return self.runner.config.max_position_embeddings

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    @property
    def device(self) -> torch.device:
        """Where the runner computes: its logits are on this device (`models/device.py`)."""
        return self.runner.device

    @property
    def precision(self) -> str:
        """'float32', 'bfloat16', 'float16', 'int8', 'gguf', 'gguf-wide', 'hf', 'hf-bfloat16' or 'hf-float16': what a draft for
        this model is loaded in by default."""
        return self.runner.precision

    def wraps_in_chat_template(self, chat: bool = True) -> bool:
        """Whether `encode_prompt(..., chat)` wraps a text prompt in a chat turn (else: raw text, which
        a base model continues with no end of turn to stop at)."""
        # getattr: a tokenizer, not a runner: None in tests, and `chat_template` unset on some tokenizer classes
        return chat and bool(getattr(self.tokenizer, "chat_template", None))

    def encode_prompt(self, prompt: str, chat: bool = True) -> list[int]:
        """Token ids for `prompt`, wrapped in the chat template when the model has one and chat=True."""
        if self.wraps_in_chat_template(chat):
            return self.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer(prompt)["input_ids"]

    def encode_chat(self, conversation: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of a conversation ({role, content} turns, and any calls and their answers) with the
        `tools` offered (None: none) through the chat template, ready for the assistant's turn: the one place
        a template is applied (check `wraps_in_chat_template()` first)."""
        extra = {"tools": tools} if tools else {}
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True, **extra)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def infill_ids(self, before: str, after: str) -> list[int]:
        """Checked token ids asking the model for the text between `before` and `after` (`models/infill.py`);
        InvalidParameterError (param "suffix") for a model without fill-in-the-middle tokens."""
        form = infill_format(self.tokenizer)
        if form is None:
            raise InvalidParameterError(f"suffix: {self.name} has no fill-in-the-middle tokens (such as <|fim_prefix|>) "
                                        "to write text between a prompt and a suffix", param="suffix")
        return self.prompt_ids(form.encode(self.tokenizer, before, after))

    @property
    def infill_ends(self) -> frozenset[int]:
        """The tokens that end a fill-in-the-middle answer besides `eos_ids` (none for a model without the format)."""
        form = infill_format(self.tokenizer)
        return frozenset() if form is None else form.ends

    def prompt_ids(self, prompt: str | Sequence[int], chat: bool = True) -> list[int]:
        """`prompt` as token ids (text encoded as `encode_prompt` does), checked: PromptError for an empty
        prompt, one that leaves no room in the context, or ids outside the vocabulary."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise PromptError("the prompt is empty: give some text to continue")
            ids = self.encode_prompt(prompt, chat)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise PromptError("the prompt has no tokens: give some text to continue")
        if len(ids) >= self.context_length:
            raise PromptError(
                f"the prompt has {len(ids)} tokens but {self.name} has a context of "
                f"{self.context_length}: shorten the prompt to leave room for new tokens"
            )
        if max(ids) >= self.vocab_size or min(ids) < 0:
            raise PromptError(f"prompt token ids must lie in [0, {self.vocab_size})")
        return ids


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


LOGITS_MODES = ("all", "last", "none")


def row_logits(logits: str | Sequence[str], rows: int) -> list[str]:
    """`forward_ragged`'s `logits`, one mode per row: "all", "last" or "none", given once for every row or per row."""
    modes = [logits] * rows if isinstance(logits, str) else list(logits)
    if len(modes) != rows or any(mode not in LOGITS_MODES for mode in modes):
        raise ValueError(f"forward_ragged needs logits in {LOGITS_MODES}, once or once per row ({rows}), got {logits!r}")
    return modes


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of `tensors`, a tensor that appears more than once (a tied head) counted once."""
    return sum({tensor.data_ptr(): tensor.numel() * tensor.element_size() for tensor in tensors}.values())
