"""The llama.cpp backend: a GGUF model run by ggml's CPU kernels through llama-cpp-python.

`LlamaCppRunner` has the runner protocol of verispec's own `Transformer` — `new_cache`,
`prefilled_cache`, `forward` (logits for every fed position, chains or token trees),
`forward_ragged` (several requests in one pass), and caches with `length`, `truncate`, `keep` and
`release` — so the engine, the drafters and the server run on it unchanged. It reads the GGUF file
as it is: no conversion, any architecture llama.cpp supports (Gemma 3 included).

How the protocol maps onto llama.cpp: one `llama_context` per model, with a KV cache unified across
sequences; every verispec cache is one llama.cpp sequence id (`LlamaCppCache`). Rolling back is
`llama_memory_seq_rm` past the kept length. A token tree is scored in one `llama_decode`: each leaf
gets a sequence of its own that first shares the committed prefix (`seq_cp`), and a node belongs to
the sequences of every leaf below it, so the node sees exactly the prefix, its ancestors and itself
(llama.cpp masks a query by its first sequence and by position; positions are prefix + depth). After
verification the accepted path is copied into the request's own sequence and the leaf sequences
are dropped: nothing is recomputed.

Exactness: ggml computes a row's logits the same way whatever else the batch holds only up to a width
that depends on the CPU and the file's quantization (the repacked multi-row kernels round
differently from the one-row ones). `exact_width` measures, once per file, thread count and CPU kind,
the widest feed whose logits equal one-at-a-time logits bit for bit. Precision `gguf` verifies at
most that many positions per pass (and requests one pass each), so greedy speculative output is
token-identical to greedy plain decoding of the same file; `gguf-wide` verifies any width, faster
where the wide kernels pay, and equals plain decoding except where a near-tie flips
(`verispec analyze --flips --dtype gguf-wide` counts them).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import threading
from collections import deque
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from verispec.errors import InvalidParameterError, PromptError, VerispecError
from verispec.paths import cache_dir, cpu_flags

__all__ = ["WINDOW", "LlamaCppCache", "LlamaCppConfig", "LlamaCppRunner", "context_size", "exact_width", "require_llama_cpp"]

WINDOW = 16384  # the context verispec gives a GGUF model by default (KV cells shared by all its sequences)
INSTALL_HINT = "it is installed by scripts/setup.sh (a build of llama-cpp-python for this CPU)"


def context_size(train_context: int, window: int = WINDOW) -> int:
    """The context a GGUF model gets: `window`, capped at the context it was trained for (when the file says)."""
    return min(window, train_context) if train_context > 0 else window


def require_llama_cpp():
    """The llama_cpp module, or a clear error saying how to get it."""
    try:
        import llama_cpp
    except ImportError:
        raise InvalidParameterError(f"the llama.cpp backend needs the llama-cpp-python package: {INSTALL_HINT}") from None
    return llama_cpp


_backend_lock = threading.Lock()
_backend_ready = False


def _init_backend(llama_cpp) -> None:
    global _backend_ready
    with _backend_lock:
        if not _backend_ready:
            from llama_cpp._logger import set_verbose

            set_verbose(False)  # llama.cpp's own log: errors only
            llama_cpp.llama_backend_init()
            _backend_ready = True


@dataclass(frozen=True)
class LlamaCppConfig:
    """What callers read of a runner's configuration (the same names as `ModelConfig`)."""

    model_type: str
    vocab_size: int
    num_layers: int
    max_position_embeddings: int  # the context one request may use (the shared window, at most)


class LlamaCppCache:
    """One llama.cpp sequence: positions 0 … length−1 hold the keys/values of the tokens fed so far.

    `release()` gives the sequence back (the engine calls it when a request ends; a cache that is
    simply dropped is released by the runner before its next decode).
    """

    def __init__(self, runner: LlamaCppRunner, seq: int):
        self.runner, self.seq, self.length = runner, seq, 0
        self.tree_seqs: list[int] = []  # leaf sequences of the last token tree, until `keep`
        self.node_seqs: list[list[int]] = []  # [n] the leaf sequences each fed node belongs to
        self._released = False
        self.ceiling: int | None = None  # unused: llama.cpp's context is allocated once, shared

    @property
    def capacity(self) -> int:
        return self.runner.window

    def ensure(self, needed: int) -> None:
        if needed > self.runner.window:
            raise PromptError(f"{needed} positions do not fit llama.cpp's window of {self.runner.window} tokens")

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.runner._drop_tree(self)
        self.runner._seq_rm(self.seq, length, -1)
        self.length = length

    def keep(self, start: int, slots: torch.Tensor) -> None:
        """Keep the fed nodes `slots` (relative to `start`, a root-to-node path, root first) after `start`."""
        kept = len(slots)
        deepest = int(slots[-1])
        leaf = self.node_seqs[deepest][0]
        self.runner._seq_rm(self.seq, start, -1)
        self.runner._seq_rm(leaf, start + kept, -1)  # the nodes below the accepted path
        self.runner._seq_cp(leaf, self.seq, start, start + kept)
        self.runner._drop_tree(self)
        self.length = start + kept

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.runner._drop_tree(self)
            self.runner._free(self.seq)

    def __del__(self):
        if not self._released:
            # freed by the decoding thread, never from a finalizer
            self.runner._pending.extend([self.seq, *self.tree_seqs])


class LlamaCppRunner:
    """A GGUF model in llama.cpp, behind verispec's runner protocol (see the module docstring).

    threads: ggml's threads (default: torch's, i.e. the machine's cores); window: the KV cells shared by
    all sequences of this model; max_sequences: requests, draft sessions and tree leaves at once;
    exact: verify at most `exact_width` positions per pass, one request per pass (see the module
    docstring), so that every position is computed as a single-token decode step computes it.
    """

    dtype = torch.float32

    def __init__(self, gguf: str | Path, threads: int | None = None, window: int = WINDOW, max_sequences: int = 256,
                 batch: int = 512, exact: bool = True):
        llama_cpp = require_llama_cpp()
        from llama_cpp._internals import LlamaContext, LlamaModel

        _init_backend(llama_cpp)
        self.llama_cpp, self.path = llama_cpp, Path(gguf)
        threads = threads or torch.get_num_threads()
        model_params = llama_cpp.llama_model_default_params()
        self._model = LlamaModel(path_model=str(self.path), params=model_params, verbose=False)
        model = self._model.model
        train_context = llama_cpp.llama_model_n_ctx_train(model)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = context_size(train_context, window)
        params.n_batch = params.n_ubatch = batch
        params.n_seq_max = max_sequences
        params.kv_unified = True
        params.n_threads = params.n_threads_batch = threads
        self._context = LlamaContext(model=self._model, params=params, verbose=False)
        self.ctx, self.memory = self._context.ctx, self._context.memory
        self.window, self.batch_size, self.threads = llama_cpp.llama_n_ctx(self.ctx), batch, threads
        self.vocab = vocab = self._model.vocab
        self.config = LlamaCppConfig(
            model_type=self._metadata("general.architecture") or "?",
            vocab_size=llama_cpp.llama_vocab_n_tokens(vocab),
            num_layers=llama_cpp.llama_model_n_layer(model),
            max_position_embeddings=self.window,
        )
        self.exact = exact
        self.quant = "gguf" if exact else "gguf-wide"  # the precision name
        self.variant = ",gguf" if exact else ",gguf-wide"
        self._free_seqs = deque(range(max_sequences))
        self._pending: deque[int] = deque()
        self._batch = llama_cpp.llama_batch_init(batch, 0, max_sequences)

    def __del__(self):
        batch = getattr(self, "_batch", None)
        if batch is not None:
            self.llama_cpp.llama_batch_free(batch)
            self._batch = None

    def _metadata(self, key: str) -> str | None:
        buffer = ctypes.create_string_buffer(256)
        size = self.llama_cpp.llama_model_meta_val_str(self._model.model, key.encode(), buffer, len(buffer))
        return buffer.value.decode() if size >= 0 else None

    @property
    def eos_ids(self) -> set[int]:
        """The ids llama.cpp ends generation on (end of sequence, end of turn)."""
        ids = {self.llama_cpp.llama_vocab_eos(self.vocab), self.llama_cpp.llama_vocab_eot(self.vocab)}
        return {i for i in ids if i >= 0}

    @cached_property
    def exact_positions(self) -> int | None:
        """With `exact`: the most positions one pass scores bit for bit as single-token steps would
        (`exact_width`, measured once per file, threads and CPU kind); None without."""
        return exact_width(self) if self.exact else None

    # -- sequences -------------------------------------------------------------------------------
    def _collect(self) -> None:
        while self._pending:
            self._free(self._pending.popleft())

    def _take(self) -> int:
        self._collect()
        if not self._free_seqs:
            raise VerispecError("every llama.cpp sequence is in use (too many requests or tree leaves at once)")
        return self._free_seqs.popleft()

    def _free(self, seq: int) -> None:
        self._seq_rm(seq, -1, -1)
        self._free_seqs.append(seq)

    def _seq_rm(self, seq: int, start: int, end: int) -> None:
        self.llama_cpp.llama_memory_seq_rm(self.memory, seq, start, end)

    def _seq_cp(self, source: int, dest: int, start: int, end: int) -> None:
        self.llama_cpp.llama_memory_seq_cp(self.memory, source, dest, start, end)

    def _drop_tree(self, cache: LlamaCppCache) -> None:
        for seq in cache.tree_seqs:
            self._free(seq)
        cache.tree_seqs, cache.node_seqs = [], []

    # -- the runner protocol ---------------------------------------------------------------------
    def new_cache(self, capacity: int = 0) -> LlamaCppCache:
        self._collect()
        return LlamaCppCache(self, self._take())

    def prefilled_cache(self, prompt_ids: list[int], spare: int = 0) -> LlamaCppCache:
        """A cache holding prompt_ids[:-1] (the last prompt token is fed with the first step)."""
        cache = self.new_cache()
        if len(prompt_ids) + 1 > self.window:
            cache.release()
            raise PromptError(f"the prompt has {len(prompt_ids)} tokens; llama.cpp's window holds {self.window}")
        if len(prompt_ids) > 1:
            self.forward(cache, torch.tensor(prompt_ids[:-1]), logits="none")
        return cache

    @torch.inference_mode()
    def forward(self, cache: LlamaCppCache, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None, logits: str = "all") -> torch.Tensor | None:
        """Feed `tokens` [n] after the cache's `length` tokens; logits "all" [n, vocab], "last" [1, vocab]
        or "none". positions [n] and tree_mask [n, n] (node i sees node j) make it a token tree."""
        return self.forward_ragged([cache], [tokens], [positions], [tree_mask], logits)[0]

    @torch.inference_mode()
    def forward_ragged(self, caches: list[LlamaCppCache], feeds: list[torch.Tensor],
                       positions: list[torch.Tensor | None] | None = None,
                       tree_masks: list[torch.Tensor | None] | None = None, logits: str = "all") -> list[torch.Tensor | None]:
        """Several requests' feeds in as few `llama_decode` calls as the batch size allows; per request
        the logits of its fed positions (as `forward` with the same `logits`)."""
        if self.exact and len(caches) > 1:  # one request per pass: its rows alone decide the kernels
            return [self.forward_ragged([c], [f], [p], [m], logits)[0]
                    for c, f, p, m in zip(caches, feeds, positions or [None] * len(caches), tree_masks or [None] * len(caches))]
        self._collect()
        positions = positions or [None] * len(caches)
        tree_masks = tree_masks or [None] * len(caches)
        rows: list[tuple[int, int, tuple[int, ...], bool]] = []  # (token, position, sequences, wants logits)
        spans = []  # per request: where its rows start and how many want logits
        for cache, feed, pos, mask in zip(caches, feeds, positions, tree_masks):
            n = int(feed.shape[0])
            if cache.length + n > self.window:
                raise PromptError(f"{cache.length + n} positions do not fit llama.cpp's window of {self.window} tokens")
            seqs = self._tree_sequences(cache, mask) if mask is not None else [(cache.seq,)] * n
            pos_list = (pos.tolist() if pos is not None else list(range(cache.length, cache.length + n)))
            wants = [logits == "all" or (logits == "last" and i == n - 1) for i in range(n)]
            spans.append((len(rows), sum(wants)))
            rows.extend(zip(feed.tolist(), pos_list, seqs, wants))
            cache.length += n
        out = self._decode(rows)  # [rows wanting logits, vocab]
        results, taken = [], 0
        for _, count in spans:
            results.append(out[taken : taken + count] if logits != "none" else None)
            taken += count
        return results

    def _tree_sequences(self, cache: LlamaCppCache, tree_mask: torch.Tensor) -> list[tuple[int, ...]]:
        """Per fed node, the leaf sequences it belongs to; each leaf sequence first gets the prefix."""
        self._drop_tree(cache)
        mask = tree_mask.bool()  # [n, n] node i sees node j
        n = mask.shape[0]
        leaves = [i for i in range(n) if int(mask[:, i].sum()) == 1]  # seen by no one but itself
        leaf_seqs = {leaf: self._take() for leaf in leaves}
        cache.tree_seqs = list(leaf_seqs.values())
        for seq in cache.tree_seqs:
            self._seq_cp(cache.seq, seq, 0, cache.length)
        # a node's first sequence decides what it sees: any leaf below it sees exactly its ancestors
        cache.node_seqs = [[leaf_seqs[leaf] for leaf in leaves if mask[leaf, i]] for i in range(n)]
        return [tuple(s) for s in cache.node_seqs]

    def _decode(self, rows: list[tuple[int, int, tuple[int, ...], bool]]) -> torch.Tensor:
        """llama_decode over `rows` in chunks of the batch size; logits of the rows that want them."""
        lib, batch, vocab = self.llama_cpp, self._batch, self.config.vocab_size
        outputs = []
        for begin in range(0, len(rows), self.batch_size):
            chunk = rows[begin : begin + self.batch_size]
            for i, (token, position, seqs, wants) in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.logits[i] = token, position, wants
                batch.n_seq_id[i] = len(seqs)
                for j, seq in enumerate(seqs):
                    batch.seq_id[i][j] = seq
            batch.n_tokens = len(chunk)
            status = lib.llama_decode(self.ctx, batch)
            if status != 0:
                raise VerispecError(
                    f"llama.cpp could not decode {len(chunk)} tokens (status {status}): its window of "
                    f"{self.window} tokens shared by all requests is full; retry when fewer run at once"
                )
            wanted = sum(row[3] for row in chunk)
            if wanted:
                pointer = lib.llama_get_logits(self.ctx)  # float* [wanted, vocab], rows in batch order
                outputs.append(torch.from_numpy(np.ctypeslib.as_array(pointer, shape=(wanted, vocab)).copy()))
        return torch.cat(outputs) if outputs else torch.zeros(0, vocab)


def exact_width(runner: LlamaCppRunner, widest: int = 16, context: int = 32) -> int:
    """The widest feed (≤ `widest` positions) whose logits equal one-at-a-time decoding bit for bit, at
    every narrower width too: measured on fixed pseudo-random tokens after a `context`-token prefix,
    then cached per file, thread count and CPU kind (`cache_dir()/exact_widths.json`)."""
    key = f"{runner.path.resolve()}|threads={runner.threads}|cpu={hashlib.sha256(cpu_flags().encode()).hexdigest()[:12]}"
    file = cache_dir() / "exact_widths.json"
    table = json.loads(file.read_text()) if file.exists() else {}
    if key in table:
        return table[key]
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, runner.config.vocab_size, (context + widest,), generator=generator)  # [context + widest]
    prefix, fed = tokens[:context].tolist(), tokens[context:]

    def fed_at_once(width: int) -> torch.Tensor:  # [width, vocab]: the first `width` fed tokens in one pass
        cache = runner.prefilled_cache(prefix + [0])  # holds the prefix
        logits = runner.forward(cache, fed[:width], logits="all")
        cache.release()
        return logits

    cache = runner.prefilled_cache(prefix + [0])
    single = torch.cat([runner.forward(cache, fed[i : i + 1], logits="all") for i in range(widest)])  # [widest, vocab]
    cache.release()
    exact = 1
    for width in range(2, widest + 1):
        if not torch.equal(fed_at_once(width), single[:width]):
            break
        exact = width
    table[key] = exact
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps(table, indent=1))
    return exact
