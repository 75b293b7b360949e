"""Drafting with llama.cpp: the draft model's GGUF file run by llama-cpp-python (an optional extra).

A draft never decides what is emitted — the target's verification does — so it may come from any
engine that shares the target's tokenizer; the output stays exactly the target's. It pays where
llama.cpp drafts much faster than verispec's own runner (a CPU without fbgemm runs verispec's int8 in
a float64 fallback). On the 2-core AVX2 CPU of BENCHMARKS.md ("Session 8") it does not: one token
costs 22 ms against the int8 draft's 28, but the step after a fully accepted draft feeds two tokens,
which llama.cpp's kernels charge ~1.9× one (`scripts/llama_cpp_verify_probe.py`; verispec's int8
runner ~1.05×, `scripts/int8_overhead.py`), so c came out 0.48 against 0.43.

The session keeps llama.cpp's context a prefix of the committed sequence, as the draft-model session
does with its KV cache: after verification it is cut back to the accepted part (the next evaluation
drops what lies past it). One llama.cpp context serves one request at a time; a session that finds
another one's tokens there (concurrent requests on a server) starts over from its own sequence.
"""

from __future__ import annotations

import time

import torch

from verispec.drafters.base import Drafter, DraftSession
from verispec.drafters.draft_model import sample_chain
from verispec.errors import IncompatibleModelsError, InvalidParameterError
from verispec.models.loading import LoadedModel
from verispec.models.registry import gguf_file
from verispec.progress import status
from verispec.types import Draft

__all__ = ["LlamaCppContext", "LlamaCppDrafter"]

PROBE_TEXT = "def main():\n    print('Hello, world! Ça va? 你好')\n"  # tokenized by both: the same family?


class LlamaCppContext:
    """The llama.cpp calls drafting needs, over a `llama_cpp.Llama` built without `logits_all` (so
    prefill computes logits for its last token only)."""

    def __init__(self, llm):
        import llama_cpp
        import numpy as np

        self.llm = llm
        self._logits_ith, self._as_array = llama_cpp.llama_get_logits_ith, np.ctypeslib.as_array

    @property
    def length(self) -> int:
        """Tokens in the context."""
        return self.llm.n_tokens

    @property
    def window(self) -> int:
        return self.llm.n_ctx()

    def truncate(self, length: int) -> None:
        self.llm.n_tokens = min(self.llm.n_tokens, length)  # `eval` removes the cache past n_tokens

    def reset(self) -> None:
        self.llm.reset()

    def eval(self, tokens: list[int]) -> torch.Tensor:
        """Append `tokens`; the logits [1, vocab] after the last one."""
        self.llm.eval(tokens)
        row = self._logits_ith(self.llm.ctx, -1)  # float* into llama.cpp's buffer
        return torch.from_numpy(self._as_array(row, shape=(self.llm.n_vocab(),)).copy())[None]

    def tokenize(self, text: str) -> list[int]:
        return list(self.llm.tokenize(text.encode(), add_bos=False, special=False))


class LlamaCppDrafter(Drafter):
    """Drafts a chain with a `LlamaCppContext` (tests give it a stand-in with the same methods)."""

    def __init__(self, context: LlamaCppContext, target: LoadedModel, name: str):
        self.context = context
        self.name = f"gguf:{name}"
        self.cost_key = f"llama.cpp:{name}"  # `control.costs.TimedDrafter`: the γ policy's c
        self.target_vocab_size = target.vocab_size
        self.owner: _LlamaCppSession | None = None  # the session whose tokens the context holds
        ours = target.tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
        theirs = context.tokenize(PROBE_TEXT)
        if theirs != ours:
            raise IncompatibleModelsError(
                f"{name!r} does not share the tokenizer of target {target.name!r} (a probe text gives "
                f"{theirs[:6]}… against {ours[:6]}…): use the GGUF of a model of the target's family"
            )

    @classmethod
    def load(cls, spec: str, target: LoadedModel, window: int = 8192) -> LlamaCppDrafter:
        """The GGUF file of `spec` (a shipped model name or a .gguf path) in llama.cpp, with a
        `window`-token context and verispec's thread count."""
        try:
            import llama_cpp
        except ImportError:
            raise InvalidParameterError(
                "the gguf drafter needs the optional llama-cpp-python package: "
                "CMAKE_ARGS=\"-DGGML_NATIVE=ON\" pip install 'verispec[llama-cpp]'"
            ) from None
        gguf = gguf_file(spec)
        with status(f"loading {gguf.name} into llama.cpp for drafting"):
            threads = torch.get_num_threads()
            llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=window, n_threads=threads, n_threads_batch=threads,
                                  verbose=False)
        return cls(LlamaCppContext(llm), target, gguf.stem)

    def start(self, prompt_ids: list[int]) -> DraftSession:
        return _LlamaCppSession(self, prompt_ids)

    def token_seconds(self, tokens: int = 8) -> float:
        """Seconds per drafted token after a 32-token prefix (the context is cleared after)."""
        self.owner = None
        self.context.reset()
        self.context.eval([0] * 32)
        start = time.perf_counter()
        for _ in range(tokens):
            self.context.eval([0])
        seconds = (time.perf_counter() - start) / tokens
        self.context.reset()
        return seconds


class _LlamaCppSession(DraftSession):
    def __init__(self, drafter: LlamaCppDrafter, prompt_ids: list[int]):
        self.drafter, self.context = drafter, drafter.context
        self._own()
        if 1 < len(prompt_ids) <= self.context.window:
            self.context.eval(prompt_ids[:-1])  # the prompt's prefill, as the target's

    def _own(self) -> None:
        """Make the context this session's: empty it when another session's tokens are there."""
        if self.drafter.owner is not self:
            self.context.reset()
            self.drafter.owner = self

    def propose(self, ids, gamma, params, generator):
        if gamma == 0 or len(ids) + gamma > self.context.window:  # past llama.cpp's window: no draft
            return Draft(torch.zeros(0, dtype=torch.long))
        self._own()
        logits = self.context.eval(ids[self.context.length :])
        return sample_chain(logits, lambda token: self.context.eval([token]), ids, gamma, params, generator,
                            self.drafter.target_vocab_size)

    def commit(self, ids):
        # a chain is accepted up to a prefix and the target adds a token the draft has not seen: the
        # context stays valid up to the committed sequence minus its last token
        if self.drafter.owner is self:
            self.context.truncate(len(ids) - 1)

    def finish(self):
        if self.drafter.owner is self:
            self.drafter.owner = None
