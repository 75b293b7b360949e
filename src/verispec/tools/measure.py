"""Measure a (target, draft) pair: α along the target's own continuation, and c from timed forwards.

α: for each prompt the target decodes greedily; then the target and the draft each score the whole
sequence in ONE teacher-forced forward, and every continuation position gives
α_i = Σₓ min(target_prob(x), draft_prob(x)) (at `temperature`; the rate a sampled draft token would
be accepted) and a greedy match (the draft's argmax equals the target's: the greedy acceptance).
c: seconds of one single-token draft forward / one single-token target forward, both after the same
context (`verispec.control.costs.measure_verify_curve`, best of a few repeats); the target's curve
T(n) for n = 1 … max_gamma+1 comes along, for the speedup with measured verification cost.
Width flips: how often one model's argmax at a position differs between decoding one position per
forward and verifying `width` positions per forward (`width_flips`). Greedy speculative decoding equals
plain decoding exactly when this is zero; in bf16 a different matmul shape can round a near-tie the
other way, which is the only way its output can leave the plain decoder's.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from verispec.control.theory import acceptance_rate
from verispec.control.costs import measure_verify_curve
from verispec.engine import Engine, GenerationConfig
from verispec.errors import InvalidParameterError
from verispec.models.loading import check_compatible
from verispec.models.runner import LoadedModel

__all__ = ["PairMeasurement", "WidthFlips", "teacher_forced_logits", "position_acceptance", "measure_pair", "width_flips"]


@dataclass
class PairMeasurement:
    alphas: list[float]  # α_i per continuation position, all prompts pooled
    greedy_matches: list[bool]  # draft argmax == target argmax per position
    target_curve: list[float]  # T(n) seconds, n = 1 … max_gamma + 1
    draft_seconds: float  # one single-token draft forward

    @property
    def alpha(self) -> float:
        return statistics.fmean(self.alphas) if self.alphas else 0.0

    @property
    def greedy_alpha(self) -> float:
        return statistics.fmean(self.greedy_matches) if self.greedy_matches else 0.0

    @property
    def c(self) -> float:
        return self.draft_seconds / self.target_curve[0]

    def to_dict(self) -> dict:
        return {"alpha": self.alpha, "greedy_alpha": self.greedy_alpha, "c": self.c, "positions": len(self.alphas),
                "target_forward_seconds": self.target_curve, "draft_forward_seconds": self.draft_seconds}


def teacher_forced_logits(model: LoadedModel, ids: Sequence[int], start: int) -> torch.Tensor:
    """Logits predicting ids[start:] from one forward over ids[:-1]: [len(ids) − start, vocab]."""
    cache = model.runner.new_cache(len(ids))
    logits = model.runner.forward(cache, torch.tensor(ids[:-1]), logits="all")  # [len(ids) − 1, vocab]
    return logits[start - 1:]


def _probs(logits: torch.Tensor, vocab: int, temperature: float) -> torch.Tensor:
    """Softmax at `temperature` (a point mass at the argmax when 0), padded to `vocab` columns."""
    logits = logits.float()
    if temperature > 0:
        probs = torch.softmax(logits / temperature, dim=-1)
    else:
        probs = torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    return torch.nn.functional.pad(probs, (0, vocab - probs.shape[-1]))


def position_acceptance(target: LoadedModel, draft: LoadedModel, prompt_ids: list[int], continuation: list[int],
                        temperature: float = 1.0) -> tuple[list[float], list[bool]]:
    """α_i and greedy matches for each token of `continuation` after `prompt_ids`."""
    if not continuation:
        return [], []
    ids = prompt_ids + continuation
    target_logits = teacher_forced_logits(target, ids, len(prompt_ids))  # [n, vocab]
    draft_logits = teacher_forced_logits(draft, ids, len(prompt_ids))  # [n, draft vocab]
    vocab = target_logits.shape[-1]
    alphas = acceptance_rate(_probs(target_logits, vocab, temperature), _probs(draft_logits, vocab, temperature))  # [n]
    matches = target_logits.argmax(dim=-1) == draft_logits.argmax(dim=-1)  # [n]
    return alphas.tolist(), matches.tolist()


def measure_pair(target: LoadedModel, draft: LoadedModel, prompts_ids: Sequence[list[int]], max_new_tokens: int = 64,
                 temperature: float = 1.0, max_gamma: int = 12) -> PairMeasurement:
    """α over the target's greedy continuations of `prompts_ids`, and the forward timings behind c."""
    if not prompts_ids:
        raise InvalidParameterError("measuring α needs at least one prompt")
    if temperature < 0:
        raise InvalidParameterError(f"temperature must be ≥ 0, got {temperature}")
    check_compatible(target, draft)
    plain = Engine(target, None)
    alphas: list[float] = []
    matches: list[bool] = []
    with torch.inference_mode():
        for prompt_ids in prompts_ids:
            continuation = plain.generate(prompt_ids, GenerationConfig(max_new_tokens=max_new_tokens)).token_ids
            a, m = position_acceptance(target, draft, list(prompt_ids), list(continuation), temperature)
            alphas += a
            matches += m
        target_curve = measure_verify_curve(target.runner, max_gamma + 1)
        draft_seconds = measure_verify_curve(draft.runner, 1)[0]
    return PairMeasurement(alphas, matches, target_curve, draft_seconds)


@dataclass
class WidthFlips:
    positions: int  # continuation positions compared
    flips: int  # positions whose argmax differs between 1-wide and `width`-wide forwards
    flip_margins: list[float]  # the 1-wide top-2 logit gap at each flip
    median_margin: float  # the 1-wide top-2 logit gap over all positions

    @property
    def rate(self) -> float:
        return self.flips / self.positions if self.positions else 0.0


def _greedy_one_at_a_time(model: LoadedModel, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """The model's greedy continuation, one position per forward after the prompt, with the logits
    that chose each token: (tokens, [n, vocab])."""
    cache = model.runner.new_cache(len(prompt_ids) + max_new_tokens)
    model.runner.forward(cache, torch.tensor(prompt_ids[:-1]), logits="none")
    token, tokens, rows = prompt_ids[-1], [], []
    for _ in range(max_new_tokens):
        rows.append(model.runner.forward(cache, torch.tensor([token]), logits="all"))  # [1, vocab]
        token = int(rows[-1].argmax(-1))
        tokens.append(token)
        if token in model.eos_ids:
            break
    return tokens, torch.cat(rows)


def _wide_logits(model: LoadedModel, ids: list[int], start: int, width: int) -> torch.Tensor:
    """Logits predicting ids[start:], the prefix prefilled at once, then `width` tokens per forward:
    [len(ids) − start, vocab]."""
    cache = model.runner.new_cache(len(ids))
    model.runner.forward(cache, torch.tensor(ids[: start - 1]), logits="none")
    tokens = torch.tensor(ids[start - 1 : -1])  # [n]: the inputs whose next tokens are ids[start:]
    return torch.cat([model.runner.forward(cache, chunk, logits="all") for chunk in tokens.split(width)])


def width_flips(model: LoadedModel, prompts_ids: Sequence[list[int]], max_new_tokens: int = 64,
                width: int = 5) -> WidthFlips:
    """Compare argmaxes along the model's own greedy continuations: one position per forward (as plain
    decoding) against `width` positions per forward (as verifying γ = width − 1 draft tokens)."""
    if width < 2:
        raise InvalidParameterError(f"width must be ≥ 2 positions per forward, got {width}")
    margins, flip_margins = [], []
    with torch.inference_mode():
        for prompt_ids in prompts_ids:
            continuation, one = _greedy_one_at_a_time(model, list(prompt_ids), max_new_tokens)  # one [n, vocab]
            wide = _wide_logits(model, list(prompt_ids) + continuation, len(prompt_ids), width)  # [n, vocab]
            top2 = one.topk(2, dim=-1).values  # [n, 2]
            gap = (top2[:, 0] - top2[:, 1]).tolist()
            margins += gap
            flip_margins += [g for g, f in zip(gap, (one.argmax(-1) != wide.argmax(-1)).tolist()) if f]
    return WidthFlips(len(margins), len(flip_margins), flip_margins, statistics.median(margins) if margins else 0.0)
