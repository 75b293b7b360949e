"""The llama.cpp backend: a GGUF model run by ggml's CPU kernels through llama-cpp-python.

`LlamaCppRunner` has the runner protocol of verispec's own `Transformer` — `new_cache`,
`prefilled_cache`, `forward` (logits for every fed position, chains or token trees),
`forward_ragged` (several requests in one pass), and caches with `length`, `truncate`, `keep` and
`release` — so the engine, the drafters and the server run on it unchanged. It reads the GGUF file
as it is: no conversion, any architecture llama.cpp supports (Gemma 3 included).

How the protocol maps onto llama.cpp: every verispec cache is one llama.cpp sequence id
(`LlamaCppCache`) in a `llama_context` whose KV cells are unified across its sequences. Rolling back
is `llama_memory_seq_rm` past the kept length. A token tree is scored in one `llama_decode`: each
leaf gets a sequence of its own that first shares the committed prefix (`seq_cp`), and a node
belongs to the sequences of every leaf below it, so the node sees exactly the prefix, its ancestors
and itself (llama.cpp masks a query by its first sequence and by position; positions are prefix +
depth). After verification the accepted path is copied into the request's own sequence and the leaf
sequences are dropped: nothing is recomputed.

Batch invariance: with precision `gguf` every cache has a context of its own (`_Context`, taken from
a pool of idle ones), because in a shared context a request's logits depend on the others: ggml's
attention walks the cells in the order they were handed out (interleaved with other requests') and
splits a single-token decode across threads by the number of cells in use by *all* sequences. In a
context of its own a request's cells, and so its rounding, follow from its own history only: its
output is the same alone or among any number of requests. Contexts hold a multiple of 256 cells (the
granule llama.cpp pads attention to, so a context's size never changes which cells are attended),
start at the request's first need and move to a context twice as large when the cache outgrows it
(the sequence's state is copied, nothing recomputed). `gguf-wide` keeps one context shared by every
request so that requests share decode passes (throughput over invariance; it is not exact anyway).

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
import threading
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import torch

from verispec.errors import InvalidParameterError, PromptError, VerispecError
from verispec.models.runner import RunnerConfig, row_logits
from verispec.paths import cpu_key, read_table, store_in_table
from verispec.progress import status

__all__ = ["AMX_CRASH", "WINDOW", "LlamaCppCache", "LlamaCppRunner", "context_size", "exact_width", "has_amx_kernels",
           "model_params", "require_llama_cpp"]

CELL_GRANULE = 256  # llama.cpp pads the attended cells to a multiple of this (llama_kv_cache::get_n_kv)
# from this many attended cells ggml's flash attention splits a one-row decode over its threads
# (ggml-cpu ops.cpp, use_split_kv_path), a summation no pass of several rows shares
SPLIT_ATTENTION_CELLS = 2 * CELL_GRANULE
WINDOW = 16384  # the context verispec gives a GGUF model by default (the most positions of one request)
INSTALL_HINT = "it is installed by scripts/setup.sh (a build of llama-cpp-python for this CPU)"


def context_size(train_context: int, window: int = WINDOW) -> int:
    """The context a GGUF model gets: `window`, capped at the context it was trained for (when the file
    says), in whole granules of 256 cells."""
    window = min(window, train_context) if train_context > 0 else window
    return max(CELL_GRANULE, window // CELL_GRANULE * CELL_GRANULE)


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


AMX_CRASH = ("ggml's AMX kernels crash at the first decode on some AMX Xeons (ggml-org/llama.cpp#20824); "
             "scripts/setup.sh builds llama-cpp-python without them")


def has_amx_kernels(llama_cpp) -> bool:
    """Whether this llama-cpp-python build runs ggml's AMX kernels (see AMX_CRASH)."""
    return b"AMX_INT8 = 1" in llama_cpp.llama_print_system_info()


def model_params(llama_cpp):
    """llama.cpp's default model parameters, without its extra weight buffers in a build that has ggml's AMX
    kernels (AMX_CRASH): this keeps another build (a user's own) from crashing, at the cost of repacking."""
    params = llama_cpp.llama_model_default_params()
    if has_amx_kernels(llama_cpp):
        params.use_extra_bufts = False
    return params


IDLE_CONTEXTS = 4  # idle per-request contexts a runner keeps for the next requests (the rest are freed)
CONTEXT_SEQUENCES = 33  # sequences of a per-request context: the request's own and its tree leaves


def _granules(cells: int) -> int:
    """The context size for `cells` cells: 256 × a power of two (contexts of few sizes are reused)."""
    size = CELL_GRANULE
    while size < cells:
        size *= 2
    return size


class _Context:
    """One llama_context: `size` KV cells unified across its `sequences` sequence ids, and a batch buffer.

    shared: every cache of the runner lives here (`gguf-wide`); otherwise it belongs to one cache at a
    time and goes back to the runner's pool when that cache is released."""

    def __init__(self, runner: LlamaCppRunner, size: int, sequences: int, shared: bool):
        lib = self.lib = runner.llama_cpp
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_seq_max, params.kv_unified = size, sequences, True
        params.n_batch = params.n_ubatch = runner.batch_size
        params.n_threads = params.n_threads_batch = runner.threads
        self.ctx = lib.llama_init_from_model(runner.model, params)
        if not self.ctx:
            raise VerispecError(f"llama.cpp could not create a context of {size} cells (out of memory?)")
        self.memory = lib.llama_get_memory(self.ctx)
        self.size, self.sequences, self.shared = lib.llama_n_ctx(self.ctx), sequences, shared
        self.batch_size, self.vocab_size = runner.batch_size, runner.config.vocab_size
        self.batch = lib.llama_batch_init(runner.batch_size, 0, sequences)
        self.free_seqs = deque(range(sequences))
        self.pending: deque[int] = deque()  # sequences of caches dropped without release(), freed on the next use

    def close(self) -> None:
        if self.ctx is not None:
            self.lib.llama_batch_free(self.batch)
            self.lib.llama_free(self.ctx)
            self.ctx = None

    def clear(self) -> None:
        """Empty every sequence (a pooled context starts each request as a fresh one does)."""
        self.lib.llama_memory_clear(self.memory, True)
        self.free_seqs, self.pending = deque(range(self.sequences)), deque()

    def collect(self) -> None:
        while self.pending:
            self.free(self.pending.popleft())

    def take(self) -> int:
        self.collect()
        if not self.free_seqs:
            raise VerispecError("every llama.cpp sequence is in use (too many requests or tree leaves at once)")
        return self.free_seqs.popleft()

    def free(self, seq: int) -> None:
        self.seq_rm(seq, -1, -1)
        self.free_seqs.append(seq)

    def seq_rm(self, seq: int, start: int, end: int) -> None:
        self.lib.llama_memory_seq_rm(self.memory, seq, start, end)

    def seq_cp(self, source: int, dest: int, start: int, end: int) -> None:
        self.lib.llama_memory_seq_cp(self.memory, source, dest, start, end)

    def export(self, seq: int) -> ctypes.Array:
        """The keys/values of `seq` as llama.cpp serializes them."""
        size = self.lib.llama_state_seq_get_size(self.ctx, seq)
        state = (ctypes.c_uint8 * size)()
        self.lib.llama_state_seq_get_data(self.ctx, state, size, seq)
        return state

    def load(self, state: ctypes.Array, seq: int) -> None:
        if self.lib.llama_state_seq_set_data(self.ctx, state, len(state), seq) == 0:
            raise VerispecError("llama.cpp could not move a sequence into a larger context")

    def decode(self, rows: list[tuple[int, int, tuple[int, ...], bool]]) -> torch.Tensor:
        """llama_decode over `rows` (token, position, sequences, wants logits) in chunks of the batch
        size; the logits of the rows that want them [wanted, vocab], in row order."""
        self.collect()
        lib, batch, vocab = self.lib, self.batch, self.vocab_size
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
                    f"llama.cpp could not decode {len(chunk)} tokens (status {status}): its context of "
                    f"{self.size} cells is full; retry when fewer requests run at once"
                )
            wanted = sum(row[3] for row in chunk)
            if wanted:
                logits = torch.empty(wanted, vocab)  # [wanted, vocab], rows in batch order
                # one copy out of llama.cpp's buffer (numpy's as_array builds a new ctypes type every call)
                ctypes.memmove(logits.data_ptr(), lib.llama_get_logits(self.ctx), logits.numel() * 4)
                outputs.append(logits)
        return (outputs[0] if len(outputs) == 1 else torch.cat(outputs)) if outputs else torch.zeros(0, vocab)


class LlamaCppCache:
    """One llama.cpp sequence: positions 0 … length−1 hold the keys/values of the tokens fed so far.

    `release()` gives the sequence (and a context of its own) back; the engine calls it when a request
    ends, and a cache that is simply dropped is given back by the runner before its next decode.
    """

    def __init__(self, runner: LlamaCppRunner, context: _Context, seq: int):
        self.runner, self.context, self.seq, self.length = runner, context, seq, 0
        self.tree_seqs: list[int] = []  # leaf sequences of the last token tree, until `keep`
        self.node_seqs: list[list[int]] = []  # [n] the leaf sequences each fed node belongs to
        self._released = False
        self.ceiling: int | None = None  # unused: a context grows by moving, up to the runner's window

    @property
    def capacity(self) -> int:
        return self.runner.window

    def ensure(self, needed: int) -> None:
        """Room for `needed` positions: a per-request context too small moves to a larger one."""
        if needed > self.runner.window:
            raise PromptError(f"{needed} positions do not fit llama.cpp's window of {self.runner.window} tokens")
        if needed > self.context.size:
            self.runner._move(self, needed)

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self._drop_tree()
        self.context.seq_rm(self.seq, length, -1)
        self.length = length

    def keep(self, start: int, slots: torch.Tensor) -> None:
        """Keep the fed nodes `slots` (relative to `start`, a root-to-node path, root first) after `start`."""
        kept = len(slots)
        deepest = int(slots[-1])
        leaf = self.node_seqs[deepest][0]
        self.context.seq_rm(self.seq, start, -1)
        self.context.seq_rm(leaf, start + kept, -1)  # the nodes below the accepted path
        self.context.seq_cp(leaf, self.seq, start, start + kept)
        self._drop_tree()
        self.length = start + kept
        if self.runner.exact and slots.tolist() != list(range(kept)):
            self._lay_out_in_order()

    def _lay_out_in_order(self) -> None:
        """Move the sequence's keys/values into cells 0 … length−1 in position order, as plain decoding lays
        them out. After a token tree the kept path can skip a rejected node's cell, which the next token would
        fill: attention sums the cells in their order, so that token's step would round differently."""
        state = self.context.export(self.seq)
        self.context.seq_rm(self.seq, -1, -1)
        self.context.load(state, self.seq)

    def clone(self) -> LlamaCppCache:
        """An independent copy: a sequence of its own holding the same keys/values (copied within a
        shared context; in a context of its own otherwise, as a cache moving to a larger one is)."""
        if self.tree_seqs:
            raise ValueError("cannot clone a cache while it holds a token tree: keep or truncate it first")
        twin = self.runner.new_cache(self.length)
        if twin.context is self.context:
            self.context.seq_cp(self.seq, twin.seq, 0, self.length)
        elif self.length:
            twin.context.load(self.context.export(self.seq), twin.seq)
        twin.length = self.length
        return twin

    def tree_sequences(self, tree_mask: torch.Tensor) -> list[tuple[int, ...]]:
        """Per fed node of a token tree, the leaf sequences it belongs to; each leaf first gets the prefix."""
        self._drop_tree()
        mask = tree_mask.bool()  # [n, n] node i sees node j
        n = mask.shape[0]
        leaves = [i for i in range(n) if int(mask[:, i].sum()) == 1]  # seen by no one but itself
        leaf_seqs = {leaf: self.context.take() for leaf in leaves}
        self.tree_seqs = list(leaf_seqs.values())
        for seq in self.tree_seqs:
            self.context.seq_cp(self.seq, seq, 0, self.length)
        # a node's first sequence decides what it sees: any leaf below it sees exactly its ancestors
        self.node_seqs = [[leaf_seqs[leaf] for leaf in leaves if mask[leaf, i]] for i in range(n)]
        return [tuple(s) for s in self.node_seqs]

    def _drop_tree(self) -> None:
        for seq in self.tree_seqs:
            self.context.free(seq)
        self.tree_seqs, self.node_seqs = [], []

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._drop_tree()
            self.runner._give_back(self.context, self.seq)

    def __del__(self):
        if not self._released:
            # given back by the decoding thread, never from a finalizer
            self.runner._dropped.append((self.context, [self.seq, *self.tree_seqs]))


class LlamaCppRunner:
    """A GGUF model in llama.cpp, behind verispec's runner protocol (see the module docstring).

    threads: ggml's threads (default: torch's, i.e. the machine's cores); window: the most positions
    one request may use (and, shared, the KV cells of all of them together); max_sequences: requests,
    draft sessions and tree leaves at once in the shared context; exact: verify at most `exact_width`
    positions per pass, each request in a context of its own and a pass of its own (see the module
    docstring), so that every position is computed as a single-token decode step of that request
    alone computes it.
    """

    dtype = torch.float32
    device = torch.device("cpu")  # ggml's CPU kernels: logits come back as CPU tensors

    def __init__(self, gguf: str | Path, threads: int | None = None, window: int = WINDOW, max_sequences: int = 256,
                 batch: int = 512, exact: bool = True):
        self._shared: _Context | None = None  # first: `__del__` closes these even when loading fails
        self._idle: list[_Context] = []  # per-request contexts waiting for their next request
        llama_cpp = require_llama_cpp()
        from llama_cpp._internals import LlamaModel

        _init_backend(llama_cpp)
        self.llama_cpp, self.path = llama_cpp, Path(gguf)
        self.threads, self.batch_size = threads or torch.get_num_threads(), batch
        self._model = LlamaModel(path_model=str(self.path), params=model_params(llama_cpp), verbose=False)
        self.model = self._model.model
        self.window = context_size(llama_cpp.llama_model_n_ctx_train(self.model), window)
        self.vocab = vocab = self._model.vocab
        architecture = self._metadata("general.architecture") or "?"
        heads = llama_cpp.llama_model_n_head(self.model)
        key_length = self._metadata(f"{architecture}.attention.key_length")  # a head's size where it is not embedding / heads
        self.config = RunnerConfig(
            model_type=architecture,
            vocab_size=llama_cpp.llama_vocab_n_tokens(vocab),
            max_position_embeddings=self.window,  # the context one request may use (the shared window, at most)
            num_layers=llama_cpp.llama_model_n_layer(self.model),
            num_heads=heads,
            num_kv_heads=llama_cpp.llama_model_n_head_kv(self.model),
            head_dim=int(key_length) if key_length else llama_cpp.llama_model_n_embd(self.model) // heads,
        )
        self.exact = exact
        self.precision = "gguf" if exact else "gguf-wide"
        self.variant = "," + self.precision
        self._exact_widths: tuple[int | None, int | None] = (None, None)  # (short, long): `measure_exact_widths`
        self._shared = None if exact else _Context(self, self.window, max_sequences, shared=True)
        self._dropped: deque[tuple[_Context, list[int]]] = deque()  # caches dropped without release()

    def __del__(self):
        for context in [*self._idle, self._shared]:
            if context is not None:
                context.close()

    def _metadata(self, key: str) -> str | None:
        buffer = ctypes.create_string_buffer(256)
        size = self.llama_cpp.llama_model_meta_val_str(self.model, key.encode(), buffer, len(buffer))
        return buffer.value.decode() if size >= 0 else None

    @property
    def eos_ids(self) -> set[int]:
        """The ids llama.cpp ends generation on (end of sequence, end of turn)."""
        ids = {self.llama_cpp.llama_vocab_eos(self.vocab), self.llama_cpp.llama_vocab_eot(self.vocab)}
        return {i for i in ids if i >= 0}

    # -- declared capabilities (the runner protocol, `models/runner.py`) ---------------------------
    supports_trees = True  # each leaf a sequence sharing the prefix (see the module docstring)
    prefix_invariant = False  # ggml's kernels round a batch of rows differently from fewer
    step_graphs = None  # each step goes through llama.cpp's own graph, from the host
    compiled = False  # ggml is what runs: no Python-level decoder stack to tell apart
    linear_bytes = None  # ggml's quantized blocks: only the file's size is known
    cache_bytes_per_position = None  # llama.cpp sizes its KV cells itself

    @property
    def batch_invariant(self) -> bool:
        """Exact: `forward_ragged` passes each request alone (a wide runner's shared passes round by the batch)."""
        return self.exact

    @property
    def weight_bytes(self) -> int:
        """The GGUF file's size: llama.cpp maps its tensors from it."""
        return self.path.stat().st_size

    def measure_exact_widths(self, long: bool = True) -> tuple[int | None, int | None]:
        """Measure the exact width while a cache is short now (or read it from the cache) and, with `long`, the one
        after a long context: the loader measures the first (what a plan reads), `prepare_decoding` the second (what
        decoding past SPLIT_ATTENTION_CELLS reads: a backend a plan does not keep is never measured there), so that
        no request waits for either and reading them never measures."""
        if self.exact and self._exact_widths[0] is None:
            self._exact_widths = exact_width(self), self._exact_widths[1]
        if self.exact and long and self._exact_widths[1] is None:
            self._exact_widths = self._exact_widths[0], exact_width(self, context=SPLIT_ATTENTION_CELLS)
        return self._exact_widths

    def prepare_decoding(self) -> None:
        """The exact width after a long context, measured now (`Engine.prepare` calls this before any request)."""
        self.measure_exact_widths()

    def _width(self, which: int, measure: str) -> int | None:
        if not self.exact:
            return None
        if self._exact_widths[which] is None:
            raise VerispecError(f"this exact width of the GGUF runner is not measured yet: call {measure} first")
        return self._exact_widths[which]

    @property
    def exact_positions(self) -> int | None:
        """With `exact`: the most positions one pass scores bit for bit as single-token steps would
        while a cache is short (`exact_width`, measured once per file, threads and CPU kind); None without."""
        return self._width(0, "measure_exact_widths() (load_model does)")

    @property
    def exact_positions_long(self) -> int | None:
        """`exact_positions` once single-token steps attend SPLIT_ATTENTION_CELLS cells or more
        (measured after a context that long)."""
        return self._width(1, "prepare_decoding() (Engine.prepare does)")

    def exact_positions_after(self, length: int) -> int | None:
        """`exact_positions` while every single-token step of the pass would attend fewer than
        SPLIT_ATTENTION_CELLS cells, `exact_positions_long` from there on (None without `exact`)."""
        if not self.exact:
            return None
        if length + self.exact_positions <= SPLIT_ATTENTION_CELLS - CELL_GRANULE:
            return self.exact_positions
        return self.exact_positions_long

    # -- contexts and sequences ------------------------------------------------------------------
    def _context_for(self, cells: int) -> _Context:
        """The shared context, or an idle per-request one of at least `cells` cells (a new one if none)."""
        if self._shared is not None:
            return self._shared
        size = min(self.window, _granules(cells))
        fitting = [context for context in self._idle if context.size >= size]
        if fitting:
            context = min(fitting, key=lambda context: context.size)
            self._idle.remove(context)
            return context
        return _Context(self, size, CONTEXT_SEQUENCES, shared=False)

    def _give_back(self, context: _Context, seq: int) -> None:
        """A cache is done with `seq`: free it, and pool a context of its own (emptied)."""
        if context.shared:
            context.free(seq)
            return
        context.clear()
        self._idle.append(context)
        while len(self._idle) > IDLE_CONTEXTS:
            self._idle.pop(0).close()  # the oldest

    def _collect(self) -> None:
        while self._dropped:
            context, seqs = self._dropped.popleft()
            if context.shared:
                context.pending.extend(seqs)
            else:
                self._give_back(context, seqs[0])

    def _move(self, cache: LlamaCppCache, needed: int) -> None:
        """Carry `cache`'s sequence into a context of at least `needed` cells (its own only)."""
        cache._drop_tree()
        old, state = cache.context, cache.context.export(cache.seq)
        new = self._context_for(needed)
        seq = new.take()
        new.load(state, seq)
        self._give_back(old, cache.seq)
        cache.context, cache.seq = new, seq

    # -- the runner protocol ---------------------------------------------------------------------
    def new_cache(self, capacity: int = 0) -> LlamaCppCache:
        """An empty cache; a context of its own holds at least `capacity` positions (it grows as needed)."""
        self._collect()
        context = self._context_for(min(max(capacity, 1), self.window))
        return LlamaCppCache(self, context, context.take())

    def placeholder_cache(self, length: int, capacity: int) -> None:
        """None: a context must be fed here to be timed (`Runner.placeholder_cache`)."""
        return None

    def prefilled_cache(self, prompt_ids: list[int], spare: int = 0) -> LlamaCppCache:
        """A cache holding prompt_ids[:-1] (the last prompt token is fed with the first step)."""
        if len(prompt_ids) + 1 > self.window:
            raise PromptError(f"the prompt has {len(prompt_ids)} tokens; llama.cpp's window holds {self.window}")
        cache = self.new_cache(len(prompt_ids) + spare)
        if len(prompt_ids) > 1:
            self.forward(cache, torch.tensor(prompt_ids[:-1]), logits="none")
        return cache

    def forward(self, cache: LlamaCppCache, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None, logits: str = "all") -> torch.Tensor | None:
        """Feed `tokens` [n] after the cache's `length` tokens; logits "all" [n, vocab], "last" [1, vocab]
        or "none". positions [n] and tree_mask [n, n] (node i sees node j) make it a token tree."""
        return self.forward_ragged([cache], [tokens], [positions], [tree_mask], logits)[0]

    def forward_ragged(self, caches: list[LlamaCppCache], feeds: list[torch.Tensor],
                       positions: list[torch.Tensor | None] | None = None,
                       tree_masks: list[torch.Tensor | None] | None = None,
                       logits: str | Sequence[str] = "all") -> list[torch.Tensor | None]:
        """Several requests' feeds; per request the logits of its fed positions (as `forward` with the
        same `logits`, one mode or one per request). Exact: a pass per request, in its own context; wide: as few `llama_decode`
        calls over the shared context as the batch size allows. No torch.inference_mode here: nothing
        records gradients, and entering the mode costs tens of µs a step once a decode has evicted the
        caches (as does every tensor operation: this path keeps to a few)."""
        positions = positions or [None] * len(caches)
        tree_masks = tree_masks or [None] * len(caches)
        modes = row_logits(logits, len(caches))
        if self.exact and len(caches) > 1:  # one request per pass: its rows alone decide the kernels
            return [self.forward_ragged([c], [f], [p], [m], mode)[0]
                    for c, f, p, m, mode in zip(caches, feeds, positions, tree_masks, modes)]
        self._collect()
        rows: list[tuple[int, int, tuple[int, ...], bool]] = []  # (token, position, sequences, wants logits)
        spans = []  # per request: how many of its rows want logits
        for cache, feed, pos, mask, mode in zip(caches, feeds, positions, tree_masks, modes):
            n = int(feed.shape[0])
            cache.ensure(cache.length + n)
            seqs = cache.tree_sequences(mask) if mask is not None else [(cache.seq,)] * n
            pos_list = pos.tolist() if pos is not None else list(range(cache.length, cache.length + n))
            wants = [mode == "all" or (mode == "last" and i == n - 1) for i in range(n)]
            spans.append(sum(wants))
            rows.extend(zip(feed.tolist(), pos_list, seqs, wants))
            cache.length += n
        out = caches[0].context.decode(rows)  # [rows wanting logits, vocab]
        results, taken = [], 0
        for count, mode in zip(spans, modes):
            results.append(out[taken : taken + count] if mode != "none" else None)
            taken += count
        return results


def exact_width(runner: LlamaCppRunner, widest: int = 16, context: int = 32) -> int:
    """The widest feed (≤ `widest` positions) whose logits equal one-at-a-time decoding bit for bit, at
    every narrower width too: measured on fixed pseudo-random tokens after a `context`-token prefix,
    then cached per file, thread count and CPU kind (`cache_dir()/exact_widths.json`)."""
    key = (f"{runner.path.resolve()}|threads={runner.threads}|context={context}"
           f"|cpu={cpu_key()}")
    known = read_table("exact_widths.json").get(key)
    if known is not None:
        return known
    with status("measuring which verification widths are exact (once per file, threads and CPU)"):
        exact = _measure_exact_width(runner, widest, context)
    store_in_table("exact_widths.json", key, exact)
    return exact


def _measure_exact_width(runner: LlamaCppRunner, widest: int, context: int) -> int:
    """One prefill of the prefix; the single steps, then each width fed at once, rolled back to the prefix
    after each (as a decoding step rolls back a rejected draft): the prefix is never fed twice."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, runner.config.vocab_size, (context + widest,), generator=generator)  # [context + widest]
    prefix, fed = tokens[:context].tolist(), tokens[context:]
    cache = runner.prefilled_cache(prefix + [0])  # holds the prefix
    single = torch.cat([runner.forward(cache, fed[i : i + 1], logits="all") for i in range(widest)])  # [widest, vocab]
    exact = 1
    for width in range(2, widest + 1):
        cache.truncate(context)
        if not torch.equal(runner.forward(cache, fed[:width], logits="all"), single[:width]):
            break
        exact = width
    cache.release()
    return exact
