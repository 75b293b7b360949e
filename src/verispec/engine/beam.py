"""Beam search over the target model alone (no drafter): a deterministic decoding mode.

It follows Hugging Face `generate(num_beams=k, do_sample=False, early_stopping=False)` (the
vectorised `_beam_search`; tests compare ids and scores with transformers 5.23), step by step:

1. Every live beam's next-token log-softmax is added to its running sum of log-probabilities; the
   top K = max(2, 1 + #eos ids) · k continuations over all beams are ranked (K so that at least k
   of them do not end in eos).
2. A continuation *finishes* when its token is an eos id, or when it is the last step
   (`max_new_tokens` generated). Only finishing continuations ranked in the first k of the K may
   become hypotheses; a hypothesis scores `sum_logprobs / length ** length_penalty`, where length
   counts the generated tokens including the eos. The best k hypotheses so far are kept.
3. The first k non-finishing continuations, in rank order, are the next live beams.
4. Stop after `max_new_tokens` steps, or earlier once k hypotheses exist and the best live beam
   cannot beat the worst of them by HF's `early_stopping=False` heuristic: stop when
   `best_live_sum / generated ** length_penalty <= worst_hypothesis_score`, with `generated` the
   live beams' current length (the heuristic assumes a beam's score will not improve by growing).

The answer is the best hypothesis. Scores are accumulated in float32, as in HF.

Differences from HF, all on edge cases: HF starts with k copies of the prompt (k−1 of them scored
−1e9), so when vocab < K its first step can keep dummy beams; here the first step expands the one
prompt beam and keeps fewer live beams when fewer continuations exist. Generation is also capped at
the model's context length.

Caches: one per live beam. After selection, a source beam's cache is handed to its first child as is
and cloned (`Cache.clone`) for any further child; a source with no child releases its cache. Each
child then runs its one new token (k single-token forwards per step; the runner has no batch
dimension). Beam search runs on verispec's own runner and refuses the others (`require_own_runner`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from verispec.errors import InvalidParameterError
from verispec.models.loading import require_own_runner
from verispec.models.runner import Cache, LoadedModel

__all__ = ["BeamResult", "beam_search"]


@dataclass
class BeamResult:
    token_ids: list[int]  # the best hypothesis, generated part only (ends with the eos id if it stopped on one)
    score: float  # sum of log-probabilities / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" (ended with eos) or "length"


@dataclass
class _Hypothesis:
    tokens: list[int]
    score: float


def _validate(num_beams: int, max_new_tokens: int, length_penalty: float) -> None:
    if isinstance(num_beams, bool) or not isinstance(num_beams, int) or num_beams < 1:
        raise InvalidParameterError(f"num_beams must be an integer ≥ 1 (1 is greedy decoding), got {num_beams!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InvalidParameterError(f"max_new_tokens must be an integer ≥ 1, got {max_new_tokens!r}")
    if not isinstance(length_penalty, (int, float)) or not math.isfinite(length_penalty):
        raise InvalidParameterError(f"length_penalty must be a finite number, got {length_penalty!r}")


def _reorder(caches: list[Cache], sources: list[int]) -> list[Cache]:
    """Caches for the new beams: the first child of a source takes its cache, later ones a clone; the
    caches of sources without a child are released."""
    taken: set[int] = set()
    new = []
    for source in sources:
        new.append(caches[source] if source not in taken else caches[source].clone())
        taken.add(source)
    for source, cache in enumerate(caches):
        if source not in taken:
            cache.release()
    return new


def _add_hypotheses(finished: list[_Hypothesis], new: list[_Hypothesis], num_beams: int) -> list[_Hypothesis]:
    """The best `num_beams` of the old and new hypotheses, best first (on a tie the older one first)."""
    return sorted(finished + new, key=lambda h: -h.score)[:num_beams]


def _cannot_improve(
    finished: list[_Hypothesis], best_live_sum: float, generated: int, num_beams: int, length_penalty: float
) -> bool:
    """HF's early_stopping=False rule: k hypotheses exist and the best live beam, scored at its
    current length, does not beat the worst of them."""
    if len(finished) < num_beams:
        return False
    best_possible = float(torch.tensor(best_live_sum, dtype=torch.float32) / generated**length_penalty)
    return best_possible <= finished[-1].score


def beam_search(
    model: LoadedModel,
    prompt_ids: list[int],
    num_beams: int,
    max_new_tokens: int,
    length_penalty: float = 1.0,
) -> BeamResult:
    """Beam search with the target model alone; see the module docstring for the exact rules."""
    _validate(num_beams, max_new_tokens, length_penalty)
    require_own_runner(model, "beam search")
    prompt = model.prompt_ids(prompt_ids)
    runner = model.runner
    max_new = min(max_new_tokens, model.context_length - len(prompt))
    eos = model.eos_ids
    keep = max(2, 1 + len(eos)) * num_beams  # K continuations ranked per step

    first = runner.new_cache(len(prompt) + max_new)
    logits = runner.forward(first, torch.tensor(prompt), logits="last")  # [1, vocab]
    caches = [first]
    beams: list[list[int]] = [[]]  # generated tokens of each live beam
    sums = torch.zeros(1, device=logits.device)  # [live] float32 running sums of log-probabilities, beside the logits
    finished: list[_Hypothesis] = []

    try:
        for step in range(1, max_new + 1):
            last = step == max_new
            totals = (torch.log_softmax(logits, dim=-1) + sums[:, None]).flatten()  # [live * vocab]
            top_sums, top_index = torch.topk(totals, min(keep, totals.numel()))  # [K'] sorted descending
            penalised = (top_sums / step**length_penalty).tolist()
            vocab = logits.shape[-1]

            new_hyps, sources, next_beams, next_sums = [], [], [], []
            for rank, (index, total) in enumerate(zip(top_index.tolist(), top_sums.tolist())):
                source, token = divmod(index, vocab)
                tokens = beams[source] + [token]
                if last or token in eos:
                    if rank < num_beams:
                        new_hyps.append(_Hypothesis(tokens, penalised[rank]))
                elif len(next_beams) < num_beams:
                    sources.append(source)
                    next_beams.append(tokens)
                    next_sums.append(total)
            finished = _add_hypotheses(finished, new_hyps, num_beams)

            if last or not next_beams:
                break
            if _cannot_improve(finished, next_sums[0], step, num_beams, length_penalty):
                break
            caches = _reorder(caches, sources)
            beams, sums = next_beams, torch.tensor(next_sums, device=logits.device)
            # one single-token forward per live beam -> [live, vocab]
            logits = torch.cat([runner.forward(c, torch.tensor(b[-1:]), logits="last") for c, b in zip(caches, beams)])
    finally:
        for cache in caches:
            cache.release()

    best = finished[0]
    reason = "stop" if best.tokens[-1] in eos else "length"
    return BeamResult(best.tokens, best.score, reason)
