"""A naive, obviously-correct reference decoder: the oracle the tests compare against.

It uses the Hugging Face transformers implementation of the model (independent of verispec's
runner), recomputes the whole sequence every token (no cache), and samples one token at a time
with the same processors. `sequence_distribution` enumerates the exact probability of every
continuation of a given length, for distribution tests on tiny vocabularies.
"""

from __future__ import annotations

import torch

from verispec.sampling.processors import SamplingParams, greedy_tokens, seen_mask, to_probs
from verispec.sampling.samplers import multinomial

__all__ = ["next_token_probs", "reference_generate", "sequence_distribution"]


@torch.inference_mode()
def _last_logits(hf_model, ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([ids])).logits[0, -1:].float()  # [1, vocab]


def next_token_probs(hf_model, ids: list[int], params: SamplingParams) -> torch.Tensor:
    """The processed next-token distribution after `ids`: [vocab]."""
    logits = _last_logits(hf_model, ids)
    seen = seen_mask(logits.shape[-1], ids) if params.repetition_penalty != 1.0 else None
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
) -> list[int]:
    """Token-by-token decoding of the target alone; returns the new ids (eos included if hit)."""
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        probs = next_token_probs(hf_model, ids, params)
        token = int(probs.argmax()) if params.greedy else int(multinomial(probs[None], generator))
        ids.append(token)
        if token in eos_ids:
            break
    return ids[len(prompt_ids) :]


def sequence_distribution(hf_model, prompt_ids: list[int], length: int, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """Exact probability of every continuation of `length` tokens (no early stop); zero-mass ones omitted."""
    dist: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        grown: dict[tuple[int, ...], float] = {}
        for prefix, mass in dist.items():
            probs = next_token_probs(hf_model, list(prompt_ids) + list(prefix), params)
            for token in probs.nonzero().flatten().tolist():
                grown[prefix + (token,)] = mass * float(probs[token])
        dist = grown
    return dist
