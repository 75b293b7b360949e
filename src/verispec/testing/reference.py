"""A naive, obviously-correct reference decoder: the oracle the tests compare against.

It uses the Hugging Face transformers implementation of the model (independent of verispec's
runner), recomputes the whole sequence every token (no cache), and samples one token at a time
with the same processors. `sequence_distribution` enumerates the exact probability of every
continuation of a given length, for distribution tests on tiny vocabularies. `allowed` (the
continuation so far → bool [vocab]) constrains every step the obvious way: forbidden logits are −inf
before the processors, as a grammar constraint asks.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch

from verispec.sampling.processors import SamplingParams, greedy_tokens, penalties, to_probs
from verispec.sampling.samplers import multinomial

__all__ = ["WholeSequenceOracle", "next_token_probs", "reference_generate", "sequence_distribution"]


class WholeSequenceOracle:
    """`model(ids).logits` like a transformers model (the interface of the functions below), computed by a
    verispec runner over the whole sequence in ONE forward pass with a fresh cache: the oracle of a
    row-invariant runner's own decoding, bit for bit (kquant at any length, int8 up to 32 positions)."""

    def __init__(self, runner):
        self.runner = runner

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor) -> SimpleNamespace:  # input_ids [1, L]
        cache = self.runner.new_cache(input_ids.shape[1] + 1)
        return SimpleNamespace(logits=self.runner.forward(cache, input_ids[0], logits="all")[None])  # [1, L, vocab]


@torch.inference_mode()
def _last_logits(hf_model, ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([ids])).logits[0, -1:].float()  # [1, vocab]


Allowed = Callable[[tuple[int, ...]], torch.Tensor]  # the new tokens so far -> bool [vocab]


def next_token_probs(
    hf_model, ids: list[int], params: SamplingParams, allowed: torch.Tensor | None = None, *, prompt_len: int
) -> torch.Tensor:
    """The processed next-token distribution after `ids` (a prompt of `prompt_len` tokens, then the output):
    [vocab]; `allowed` bool [vocab] masks the logits first."""
    logits = _last_logits(hf_model, ids)
    if allowed is not None:
        logits = logits.masked_fill(~allowed[: logits.shape[-1]], float("-inf"))  # [1, vocab]
    seen = penalties(params, logits.shape[-1], ids, output_start=prompt_len)  # one row, or None
    if params.greedy:
        probs = torch.zeros_like(logits[0])
        probs[greedy_tokens(logits, params, seen)] = 1.0
        return probs
    return to_probs(logits, params, seen)[0]


def reference_generate(
    hf_model,
    prompt_ids: list[int],
    max_new_tokens: int,
    params: SamplingParams = SamplingParams(),
    generator: torch.Generator | None = None,
    eos_ids: frozenset[int] = frozenset(),
    allowed: Allowed | None = None,
) -> list[int]:
    """Token-by-token decoding of the target alone; returns the new ids (eos included if hit)."""
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        mask = None if allowed is None else allowed(tuple(ids[len(prompt_ids) :]))
        probs = next_token_probs(hf_model, ids, params, mask, prompt_len=len(prompt_ids))
        token = int(probs.argmax()) if params.greedy else int(multinomial(probs[None], generator))
        ids.append(token)
        if token in eos_ids:
            break
    return ids[len(prompt_ids) :]


def sequence_distribution(
    hf_model, prompt_ids: list[int], length: int, params: SamplingParams, allowed: Allowed | None = None
) -> dict[tuple[int, ...], float]:
    """Exact probability of every continuation of `length` tokens (no early stop); zero-mass ones omitted."""
    dist: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        grown: dict[tuple[int, ...], float] = {}
        for prefix, mass in dist.items():
            mask = None if allowed is None else allowed(prefix)
            probs = next_token_probs(hf_model, list(prompt_ids) + list(prefix), params, mask, prompt_len=len(prompt_ids))
            for token in probs.nonzero().flatten().tolist():
                grown[prefix + (token,)] = mass * float(probs[token])
        dist = grown
    return dist
