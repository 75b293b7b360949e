"""Sampling parameters and the logits processing shared by draft and target.

Every function works on a whole block `[positions, vocab]` at once: no Python loop per position
(a per-position Python loop over the vocabulary costs far more). Draft and target distributions go through the very same
`to_probs`, which is what keeps speculative sampling lossless under truncation.

Order: logit bias → repetition penalty (Hugging Face's, over prompt and output) → presence and frequency
penalties (OpenAI's, over the output only, as vLLM and SGLang count them) → temperature → top-k → top-p →
min-p → ε → η. Each position is penalised for its own prefix: a draft token counts for the positions after it.

Everything runs where the logits are (a GPU's logits are processed on the GPU); masks made here are made there.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from verispec.errors import InvalidParameterError
from verispec.sampling.samplers import argmax
from verispec.tokentree import ancestor_mask
from verispec.types import TokenLogprobs

MIN_TEMPERATURE = 1e-3  # logits / smaller temperatures overflow float32: the distribution turns NaN
MIN_REPETITION_PENALTY = 1e-2  # the same overflow, through the penalty's division
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [−2, 2] (OpenAI's range)
MAX_LOGIT_BIAS = 100.0  # a bias lies in [−100, 100] (OpenAI's range): ±100 bans or forces a token
MAX_BIASED_TOKENS = 300  # the most tokens one request may bias (OpenAI's bound)
FLOAT32_MAX = torch.finfo(torch.float32).max  # a larger temperature or penalty acts as this (float32 would make it inf)

__all__ = [
    "SamplingParams", "MIN_TEMPERATURE", "MIN_REPETITION_PENALTY", "MAX_PENALTY", "MAX_LOGIT_BIAS", "MAX_BIASED_TOKENS",
    "apply_repetition_penalty", "adjusted", "to_probs", "greedy_tokens", "token_counts", "Penalties", "penalties",
    "Scores", "score_rows", "token_logprobs", "MAX_TOP_LOGPROBS",
]


@dataclass(frozen=True)
class SamplingParams:
    """How to turn logits into the next token. `temperature == 0` means greedy.

    eta: the ε of η-sampling (Hewitt et al.): keep tokens with prob ≥ η = min(eta, √eta·exp(−entropy));
         0 disables, 0.0009 is the paper's default.
    epsilon: ε-sampling, keep tokens with prob ≥ epsilon; 0 disables.
    presence_penalty, frequency_penalty: subtracted from a token's logit once if it came in the output so
         far, and once per time it came (OpenAI's); 0 disables.
    logit_bias: (token id, bias) pairs added to those logits first (a mapping is taken too); ±100 bans or
         forces a token. The engine checks the ids against the target's vocabulary.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    eta: float = 0.0
    epsilon: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
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
            *[(-MAX_PENALTY <= value <= MAX_PENALTY, f"{name} must be in [{-MAX_PENALTY}, {MAX_PENALTY}] (0 = off), got {value}")
              for name, value in (("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty))],
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidParameterError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        """Whether any penalty looks at the tokens before a position."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def truncates(self) -> bool:
        """Whether a rule past top-k removes tokens after the softmax (top-p, min-p, ε, η): its rows renormalised."""
        return self.top_p < 1.0 or self.min_p > 0 or self.epsilon > 0 or self.eta > 0

    def in_draft_vocabulary(self) -> SamplingParams:
        """These parameters for a draft model of another vocabulary: the logit bias names the target's ids, so
        it is left out (a draft only proposes: what it leaves out lowers acceptance, never exactness)."""
        return replace(self, logit_bias=())


def _bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as sorted (token id, bias) pairs, or a clear error."""
    pairs = bias.items() if isinstance(bias, Mapping) else bias
    try:
        pairs = [(operator.index(token), float(value)) for token, value in pairs]
    except (TypeError, ValueError) as error:
        raise InvalidParameterError(f"logit_bias maps token ids (integers) to biases (numbers): {error}") from None
    if len(pairs) > MAX_BIASED_TOKENS:
        raise InvalidParameterError(f"logit_bias may bias at most {MAX_BIASED_TOKENS} tokens, got {len(pairs)}")
    if len({token for token, _ in pairs}) < len(pairs):
        raise InvalidParameterError("logit_bias names a token twice")
    for token, value in pairs:
        if token < 0 or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise InvalidParameterError(
                f"logit_bias needs token ids ≥ 0 and biases in [{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {token}: {value}")
    return tuple(sorted(pairs))


def token_counts(
    vocab_size: int,
    prefix: list[int] | torch.Tensor,
    block: torch.Tensor | None = None,
    ancestors: torch.Tensor | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """How often each token comes in each position's own prefix: [len(block)+1, vocab] float32 (one row
    when block is None) on `device` (None: the CPU), where the logits it adjusts are.

    Row 0 counts `prefix`; row i (i ≥ 1) counts `prefix` plus block[:i] for a chain, or plus block node
    i−1 and its ancestors for a token tree (`ancestors` [n, n] bool, see `tokentree.ancestor_mask`).
    """
    prefix = torch.as_tensor(prefix, dtype=torch.long, device=device)
    base = torch.bincount(prefix, minlength=vocab_size).float()[None]  # [1, vocab]
    if block is None or len(block) == 0:
        return base
    block = block.to(base.device)
    onehot = torch.nn.functional.one_hot(block, vocab_size).float()  # [n, vocab]
    added = ancestors.to(base.device).float() @ onehot if ancestors is not None else onehot.cumsum(0)  # [n, vocab]
    return base + torch.cat([torch.zeros_like(base), added])


@dataclass
class Penalties:
    """What the penalties see of each position's own prefix (None where a penalty is off):
    seen [rows, vocab] bool, the tokens anywhere in it (repetition penalty); output [rows, vocab] float32,
    how often each came in the output (presence and frequency penalties)."""

    seen: torch.Tensor | None
    output: torch.Tensor | None

    def rows(self, n: int) -> Penalties:
        """The first `n` rows."""
        return Penalties(None if self.seen is None else self.seen[:n], None if self.output is None else self.output[:n])

    def add(self, token: int) -> None:
        """A one-row prefix grows by `token` (a draft model's next step sees it)."""
        if self.seen is not None:
            self.seen[0, token] = True
        if self.output is not None:
            self.output[0, token] += 1


def penalties(
    params: SamplingParams, vocab_size: int, prefix: list[int] | torch.Tensor,
    block: torch.Tensor | None = None, parents: torch.Tensor | None = None, device: torch.device | None = None,
    *, output_start: int,
) -> Penalties | None:
    """What `params`' penalties see of the positions after `prefix` and after each token of `block` [n], or
    None (no penalty: nothing built). prefix[output_start:] is the output so far (what the presence and
    frequency penalties count); a token tree's `parents` [n] give each row its ancestors."""
    if not params.penalised:
        return None
    ancestors = None if parents is None else ancestor_mask(parents)
    seen = output = None
    if params.repetition_penalty != 1.0:
        seen = token_counts(vocab_size, prefix, block, ancestors, device) > 0
    if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
        output = token_counts(vocab_size, prefix[output_start:], block, ancestors, device)
    return Penalties(seen, output)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style penalty: seen tokens' logits are divided by `penalty` if positive, multiplied if negative.
    A penalised logit stays finite (float32's range), so a row keeps a finite logit; −inf (a token a
    grammar forbids) stays −inf."""
    if penalty == 1.0:
        return logits
    penalty = min(penalty, FLOAT32_MAX)  # 0 × inf would be NaN
    penalized = _finite(torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    return torch.where(seen, penalized, logits)


def _finite(adjusted: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """`adjusted` kept in float32's range, with −inf (a token a grammar forbids) where `logits` has it."""
    return torch.where(logits > -math.inf, adjusted.clamp(-FLOAT32_MAX, FLOAT32_MAX), logits)


def adjusted(logits: torch.Tensor, params: SamplingParams, penalties: Penalties | None = None) -> torch.Tensor:
    """logits [n, vocab] after the logit bias and the penalties (`penalties` of these rows): float32, a
    finite logit stays finite, −inf stays −inf. Unchanged (not copied) when there is nothing to apply."""
    if not params.logit_bias and penalties is None:
        return logits
    logits = logits.float()
    if params.logit_bias:
        bias = torch.zeros(logits.shape[-1], device=logits.device)  # [vocab]
        pairs = [(token, value) for token, value in params.logit_bias if token < logits.shape[-1]]  # a draft's vocabulary may be smaller
        if pairs:
            tokens, values = zip(*pairs)
            bias[list(tokens)] = torch.tensor(values, device=logits.device)
        logits = _finite(logits + bias, logits)
    if penalties is not None and penalties.seen is not None:
        logits = apply_repetition_penalty(logits, penalties.seen, params.repetition_penalty)
    if penalties is not None and penalties.output is not None:
        output = penalties.output
        logits = _finite(logits - params.frequency_penalty * output - params.presence_penalty * (output > 0).float(), logits)
    return logits


def _keep_at_least_top1(remove: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """`remove` without each row's most likely token: truncation never empties a distribution."""
    top1 = probs.argmax(dim=-1, keepdim=True)
    return remove.scatter(-1, top1, False)


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature, shifted so that each row's largest is 0: nothing overflows to +inf however
    small the temperature (softmax is the same), and a huge temperature does not turn −inf into NaN."""
    return (logits - logits.amax(dim=-1, keepdim=True)).div_(min(temperature, FLOAT32_MAX))  # a fresh tensor: divided in place


def to_probs(logits: torch.Tensor, params: SamplingParams, penalties: Penalties | None = None) -> torch.Tensor:
    """Processed sampling distribution for each row: logits [n, vocab] -> probs [n, vocab] (float32).

    Call only when sampling (temperature > 0); greedy uses `greedy_tokens`. Every row needs one finite
    logit; each truncation (top-k/p, min-p, ε, η) keeps at least the row's most likely token.
    """
    logits = _scaled(adjusted(logits, params, penalties).float(), params.temperature)
    neg_inf = torch.finfo(logits.dtype).min
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [n, 1]
        logits = logits.masked_fill(logits < kth, neg_inf)
    probs = torch.softmax(logits, dim=-1)
    if not params.truncates:
        return probs  # nothing removed: softmax's rows are already normalised
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


def greedy_tokens(logits: torch.Tensor, params: SamplingParams, penalties: Penalties | None = None) -> torch.Tensor:
    """Argmax per row after the logit bias and the penalties: logits [n, vocab] -> token ids [n]."""
    return argmax(adjusted(logits, params, penalties))


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
    parents: torch.Tensor | None = None, allowed: torch.Tensor | None = None, *, output_start: int,
) -> Scores:
    """Turn a scoring pass's logits [n+1, vocab] over `block` [n] (drafted after `prefix`, whose output
    begins at `output_start`) into `Scores`: the grammar mask `allowed` [n+1, vocab] (None: no grammar),
    the logit bias and the penalties over each row's own prefix (a tree's rows, `parents` [n]: over their
    ancestors), then argmax or probabilities. The one place a target's (or a checking draft model's)
    logits become a verifier's inputs."""
    if allowed is not None:
        logits = logits.masked_fill(~allowed.to(logits.device), float("-inf"))
    seen = penalties(params, logits.shape[-1], prefix, block, parents, logits.device, output_start=output_start)
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
