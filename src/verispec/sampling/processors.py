"""Sampling parameters and the logits processing shared by draft and target.

Every function works on a whole block `[positions, vocab]` at once: no Python loop per position
(a per-position Python loop over the vocabulary costs far more). Draft and target distributions go through the very same
`to_probs`, which is what keeps speculative sampling lossless under truncation.

Order (as in Hugging Face): repetition penalty → temperature → top-k → top-p → min-p → ε → η.

Everything runs where the logits are (a GPU's logits are processed on the GPU); masks made here are made there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from verispec.errors import InvalidParameterError
from verispec.sampling.samplers import argmax
from verispec.tokentree import ancestor_mask
from verispec.types import TokenLogprobs

MIN_TEMPERATURE = 1e-3  # logits / smaller temperatures overflow float32: the distribution turns NaN
MIN_REPETITION_PENALTY = 1e-2  # the same overflow, through the penalty's division
FLOAT32_MAX = torch.finfo(torch.float32).max  # a larger temperature or penalty acts as this (float32 would make it inf)

__all__ = [
    "SamplingParams", "MIN_TEMPERATURE", "MIN_REPETITION_PENALTY", "apply_repetition_penalty", "to_probs", "greedy_tokens",
    "seen_mask", "penalty_seen", "Scores", "score_rows", "token_logprobs", "MAX_TOP_LOGPROBS",
]


@dataclass(frozen=True)
class SamplingParams:
    """How to turn logits into the next token. `temperature == 0` means greedy.

    eta: the ε of η-sampling (Hewitt et al.): keep tokens with prob ≥ η = min(eta, √eta·exp(−entropy));
         0 disables, 0.0009 is the paper's default.
    epsilon: ε-sampling, keep tokens with prob ≥ epsilon; 0 disables.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    eta: float = 0.0
    epsilon: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        checks = [
            (math.isfinite(self.temperature) and (self.temperature == 0 or self.temperature >= MIN_TEMPERATURE),
             f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {self.temperature}"),
            (isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be an integer ≥ 0 (0 = off), got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p < 1, f"min_p must be in [0, 1), got {self.min_p}"),
            (0 <= self.eta < 1, f"eta must be in [0, 1) (0 = off; 0.0009 is the usual value), got {self.eta}"),
            (0 <= self.epsilon < 1, f"epsilon must be in [0, 1) (0 = off), got {self.epsilon}"),
            (math.isfinite(self.repetition_penalty) and self.repetition_penalty >= MIN_REPETITION_PENALTY,
             f"repetition_penalty must be at least {MIN_REPETITION_PENALTY} (1 = off), got {self.repetition_penalty}"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidParameterError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def seen_mask(
    vocab_size: int,
    prefix: list[int] | torch.Tensor,
    block: torch.Tensor | None = None,
    ancestors: torch.Tensor | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Which tokens each position's own prefix contains, for the repetition penalty.

    Row 0 sees `prefix`; row i (i ≥ 1) sees `prefix` plus block[:i] for a chain, or plus the tokens of
    block node i−1 and its ancestors for a token tree (`ancestors` [n, n] bool, see
    `tokentree.ancestor_mask`). Returns [len(block)+1, vocab] bool (one row when block is None) on
    `device` (None: the CPU), where the logits it masks are.
    """
    base = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    base[torch.as_tensor(prefix, dtype=torch.long, device=device)] = True
    if block is None or len(block) == 0:
        return base[None]
    block = block.to(base.device)
    if ancestors is not None:
        onehot = torch.nn.functional.one_hot(block, vocab_size).float()  # [n, vocab]
        on_path = (ancestors.to(base.device).float() @ onehot) > 0  # [n, vocab]
        return base[None] | torch.cat([torch.zeros(1, vocab_size, dtype=torch.bool, device=base.device), on_path])
    added = torch.zeros(len(block) + 1, vocab_size, dtype=torch.int32, device=base.device)
    added[torch.arange(1, len(block) + 1, device=base.device), block] = 1
    return base[None] | (added.cumsum(0) > 0)


def penalty_seen(
    params: SamplingParams, vocab_size: int, prefix: list[int] | torch.Tensor,
    block: torch.Tensor | None = None, parents: torch.Tensor | None = None, device: torch.device | None = None,
) -> torch.Tensor | None:
    """`seen_mask` when `params` has a repetition penalty, else None (nothing to penalise, nothing built).
    A token tree's `parents` [n] give each row its ancestors (built only here, when they are needed)."""
    if params.repetition_penalty == 1.0:
        return None
    return seen_mask(vocab_size, prefix, block, None if parents is None else ancestor_mask(parents), device)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style penalty: seen tokens' logits are divided by `penalty` if positive, multiplied if negative.
    A penalised logit stays finite (float32's range), so a row keeps a finite logit; −inf (a token a
    grammar forbids) stays −inf."""
    if penalty == 1.0:
        return logits
    penalty = min(penalty, FLOAT32_MAX)  # 0 × inf would be NaN
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty).clamp(-FLOAT32_MAX, FLOAT32_MAX)
    return torch.where(seen & (logits > -math.inf), penalized, logits)


def _keep_at_least_top1(remove: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """`remove` without each row's most likely token: truncation never empties a distribution."""
    top1 = probs.argmax(dim=-1, keepdim=True)
    return remove.scatter(-1, top1, False)


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature, shifted so that each row's largest is 0: nothing overflows to +inf however
    small the temperature (softmax is the same), and a huge temperature does not turn −inf into NaN."""
    return (logits - logits.max(dim=-1, keepdim=True).values) / min(temperature, FLOAT32_MAX)


def to_probs(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None) -> torch.Tensor:
    """Processed sampling distribution for each row: logits [n, vocab] -> probs [n, vocab] (float32).

    Call only when sampling (temperature > 0); greedy uses `greedy_tokens`. Every row needs one finite
    logit; each truncation (top-k/p, min-p, ε, η) keeps at least the row's most likely token.
    """
    logits = logits.float()
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    logits = _scaled(logits, params.temperature)
    neg_inf = torch.finfo(logits.dtype).min
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [n, 1]
        logits = logits.masked_fill(logits < kth, neg_inf)
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [n, vocab]
        remove_sorted = mass_before >= params.top_p  # keeps the smallest prefix reaching top_p
        remove_sorted[..., 0] = False  # a top_p below float32's resolution (1e-300) would remove every token
        probs = probs.masked_fill(remove_sorted.scatter(-1, order, remove_sorted), 0.0)
    if params.min_p > 0:
        threshold = params.min_p * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)  # min_p < 1: the top token stays
    if params.epsilon > 0:
        probs = _renormalize(probs)
        probs = probs.masked_fill(_keep_at_least_top1(probs < params.epsilon, probs), 0.0)
    if params.eta > 0:
        probs = _renormalize(probs)
        entropy = -(probs * probs.clamp_min(1e-30).log()).sum(dim=-1, keepdim=True)  # [n, 1]
        eta = torch.minimum(torch.tensor(params.eta, device=probs.device), math.sqrt(params.eta) * torch.exp(-entropy))
        probs = probs.masked_fill(_keep_at_least_top1(probs < eta, probs), 0.0)
    return _renormalize(probs)


def _renormalize(probs: torch.Tensor) -> torch.Tensor:
    return probs / probs.sum(dim=-1, keepdim=True)


def greedy_tokens(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None) -> torch.Tensor:
    """Argmax per row after the repetition penalty: logits [n, vocab] -> token ids [n]."""
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    return argmax(logits)


@dataclass(frozen=True)
class Scores:
    """What a verifier needs from a scoring pass over a block (the last committed token + n drafts).

    logits: [n+1, vocab] after any grammar mask (a forbidden token is −inf); greedy: [n+1] the
    processed argmax of each row (greedy decoding only); probs: [n+1, vocab] the processed sampling
    distribution of each row (sampling only).
    """

    logits: torch.Tensor
    greedy: torch.Tensor | None = None
    probs: torch.Tensor | None = None


def score_rows(
    logits: torch.Tensor, params: SamplingParams, prefix: list[int], block: torch.Tensor | None = None,
    parents: torch.Tensor | None = None, allowed: torch.Tensor | None = None,
) -> Scores:
    """Turn a scoring pass's logits [n+1, vocab] over `block` [n] (drafted after `prefix`) into `Scores`:
    the grammar mask `allowed` [n+1, vocab] (None: no grammar), the repetition penalty over each row's
    own prefix (a tree's rows, `parents` [n]: over their ancestors), then argmax or probabilities.
    The one place a target's (or a checking draft model's) logits become a verifier's inputs."""
    if allowed is not None:
        logits = logits.masked_fill(~allowed.to(logits.device), float("-inf"))
    seen = penalty_seen(params, logits.shape[-1], prefix, block, parents, logits.device)  # [n+1, vocab] or None
    if params.greedy:
        return Scores(logits, greedy=greedy_tokens(logits, params, seen))
    return Scores(logits, probs=to_probs(logits, params, seen))


MAX_TOP_LOGPROBS = 20  # the most alternatives a request may ask for per token (OpenAI's bound)


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprobs]:
    """Log-probabilities of `tokens` under the raw distribution of each logits row [len(tokens), vocab],
    with the `top` most likely alternatives of each row (no temperature, top-k/p or penalty applied)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [n, vocab]
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()  # [n]
    if top <= 0:
        return [TokenLogprobs(value) for value in chosen]
    values, ids = logp.topk(top, dim=-1)  # [n, top] each
    return [TokenLogprobs(value, tuple(zip(row_ids, row_values)))
            for value, row_ids, row_values in zip(chosen, ids.tolist(), values.tolist())]
