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
tokens. Running requests' caches count too (`take`'s `running`): a server's requests that share a
document or a system prompt prefill it once (the scheduler holds a request back while another is
prefilling what they share: `serving/http/scheduler.py`), a request's n choices their prompt once.

A draft model's sessions share a store of their own (`draft_prefix_store`, in memory only): in a conversation
or over a shared document the draft then prefills only what is new too, as the target does (before, a chat's
every turn prefilled the whole conversation into the draft again).

Given a `file`, the store also outlives the process: `save()` writes its `DISK_ENTRIES` most recent entries
there, at most `DISK_BUDGET` bytes (a long one keeps its beginning; the CLI saves after each answer), and a
new store of the same `stamp` (the runner's variant, which names its kernels' build, the model file and the
thread count: `prefix_store_for`) starts with them, so a new `verispec generate` prefills only what follows
the chat template's system prompt. The bits are the ones this runner computed, so the output is still the
same as without the store.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from verispec.models.runner import Cache, LoadedModel, Runner
from verispec.paths import files_stamp, keyed_file, write_whole

__all__ = ["DISK_BUDGET", "DISK_ENTRIES", "MIN_REUSE", "PREFIX_BUDGET", "PrefixStore", "draft_prefix_store", "prefix_store_for",
           "shared_length"]

MIN_REUSE = 16  # shared tokens worth a copy (fewer: prefilling them costs about as little)
PREFIX_BUDGET = 128 << 20  # bytes of cached keys/values kept for reuse by default (~2,300 positions of the 1.5B)
DISK_ENTRIES = 4  # the most recent entries `save` keeps for the next process (system prompts, recent conversations)
DISK_BUDGET = 32 << 20  # bytes `save` writes at most (~570 positions of the 1.5B): a long entry keeps its beginning


def shared_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens `a` and `b` begin with in common."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class PrefixStore:
    """Finished requests' caches, keyed by the tokens they hold (see the module docstring)."""

    def __init__(self, runner: Runner, budget: int = PREFIX_BUDGET, file: Path | None = None, stamp: str = ""):
        self.budget = budget
        self.position_bytes = runner.cache_bytes_per_position or 1
        self._entries: OrderedDict[int, tuple[tuple[int, ...], Cache]] = OrderedDict()  # id -> (tokens, cache); oldest first
        self._serial = 0
        self._lock = threading.Lock()
        self.file, self.stamp = file, stamp
        if file is not None:
            self._read(runner)

    def _read(self, runner: Runner) -> None:
        """Start with the entries `save` left in `file` under the same stamp (none when it cannot be read)."""
        try:
            with safe_open(self.file, framework="pt") as stored:
                meta = stored.metadata() or {}
                if meta.get("stamp") != self.stamp:
                    return
                for i, tokens in enumerate(json.loads(meta["tokens"])):
                    names = {key.partition("/")[2] for key in stored.keys() if key.startswith(f"{i}/")}
                    cache = runner.cache_from({name: stored.get_tensor(f"{i}/{name}") for name in names}, len(tokens))
                    self.keep(tokens, cache, owned=True)
        except Exception:  # noqa: BLE001 - a missing, older or damaged file: this process prefills, as without one
            self._entries.clear()

    def save(self) -> None:
        """Write the `DISK_ENTRIES` most recent entries, at most `DISK_BUDGET` bytes of them (the newest first; one
        that does not fit keeps its beginning), to `file` for the next process (atomically; a cache directory that
        cannot be written only costs that process a prefill)."""
        if self.file is None:
            return
        recent, room = [], DISK_BUDGET // self.position_bytes  # positions
        with self._lock:
            for tokens, cache in reversed(self._entries.values()):  # newest first
                keep = min(len(tokens), room)
                if len(recent) == DISK_ENTRIES or keep < MIN_REUSE:
                    break
                recent.append((tokens[:keep], cache if keep == len(tokens) else cache.copied(keep, keep)))
                room -= keep
        if not recent:
            return
        recent.reverse()  # oldest first, as a new store takes them in
        tensors = {f"{i}/{name}": tensor.contiguous() for i, (_, cache) in enumerate(recent) for name, tensor in cache.tensors().items()}
        meta = {"stamp": self.stamp, "tokens": json.dumps([list(tokens) for tokens, _ in recent])}
        write_whole(self.file, lambda path: save_file(tensors, path, metadata=meta))

    @property
    def positions(self) -> int:
        """Positions held, over every entry."""
        return sum(len(tokens) for tokens, _ in self._entries.values())

    def take(self, prompt_ids: Sequence[int], capacity: int,
             running: Iterable[tuple[Sequence[int], Cache]] = ()) -> Cache | None:
        """A new cache of `capacity` positions holding the longest prefix of `prompt_ids` (at most all but its
        last token, which the prefill feeds for the first new token) that a stored entry or one of the
        `running` requests' caches (each with the tokens it holds, from the first) holds, or None when
        none shares MIN_REUSE tokens."""
        most = len(prompt_ids) - 1
        with self._lock:
            best, source, shared = None, None, 0
            for key, (tokens, cache) in self._entries.items():
                if (n := min(shared_length(tokens, prompt_ids), most)) > shared:
                    best, source, shared = key, cache, n
            for tokens, cache in running:
                if (n := min(shared_length(tokens[: cache.length], prompt_ids), most)) > shared:
                    best, source, shared = None, cache, n
            if source is None or shared < MIN_REUSE:
                return None
            if best is not None:
                self._entries.move_to_end(best)
            return source.copied(shared, capacity)

    def keep(self, token_ids: Sequence[int], cache: Cache, owned: bool = False) -> None:
        """Store the first `cache.length` positions of a finished request's `cache` (they hold `token_ids`),
        unless an entry already holds them; then drop the oldest entries past the budget. `owned`: the cache is
        the store's to keep as it is (one `_read` made for exactly those positions), not copied."""
        length = min(cache.length, len(token_ids))
        if length < MIN_REUSE or length * self.position_bytes > self.budget:
            return
        tokens = tuple(token_ids[:length])
        with self._lock:
            if any(shared_length(held, tokens) == length for held, _ in self._entries.values()):
                return
            self._entries = OrderedDict((key, (held, c)) for key, (held, c) in self._entries.items()
                                        if shared_length(held, tokens) < len(held))  # entries this one extends go
            self._serial += 1
            self._entries[self._serial] = (tokens, cache if owned else cache.copied(length, length))
            while self.positions * self.position_bytes > self.budget:
                self._entries.popitem(last=False)


def prefix_store_for(model: LoadedModel) -> PrefixStore | None:
    """The prompt cache of `model` (None where its runner is not `prefix_invariant`), kept on disk between
    processes under `cache_dir()/prompts/`, stamped with what its bits depend on."""
    runner = model.runner
    if not runner.prefix_invariant:
        return None
    path = Path(model.folder).resolve()  # the model file (a GGUF for kquant)
    stamp = files_stamp(runner.variant, torch.get_num_threads(), str(path), files=[path] if path.exists() else [])
    return PrefixStore(runner, file=keyed_file("prompts", path.name, stamp, ".safetensors"), stamp=stamp)


_draft_stores: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # runner -> the store its draft sessions share
_draft_stores_lock = threading.Lock()


def draft_prefix_store(model: LoadedModel) -> PrefixStore | None:
    """The prompt cache every draft session of `model` shares, in memory for as long as its runner lives (None where the
    runner is not `prefix_invariant`: a reused prefix must be what a fresh prefill computes, so a draft proposes the
    same with or without it)."""
    runner = model.runner
    if not runner.prefix_invariant:
        return None
    with _draft_stores_lock:
        if (store := _draft_stores.get(runner)) is None:
            store = _draft_stores[runner] = PrefixStore(runner)
        return store
