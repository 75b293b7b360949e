"""Plain data shared by drafters, verifiers, the engine and its callers."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

import torch


class Origin(str, Enum):
    """Where an emitted token came from."""

    ACCEPTED = "accepted"  # a draft token the target accepted
    RECOVERED = "recovered"  # sampled from the residual after a rejection (or the target's argmax)
    BONUS = "bonus"  # the target's extra token after every draft token was accepted
    TARGET = "target"  # plain decoding: no draft this step


class Hint(NamedTuple):
    """What a draft session knows of its next proposal before making it (`DraftSession.hint`): `key` names a
    class of steps whose acceptance the γ policy measures apart (prompt lookup: how long a suffix it matched),
    `prior` the acceptance rate expected of that class before the request has measured any, `free` whether its
    proposals cost no draft model's forward (prompt lookup, also inside `hybrid`: the policy prices them at c = 0)."""

    key: int
    prior: float
    free: bool = False


@dataclass
class Draft:
    """A drafter's proposal for one step: a chain, or a token tree.

    tokens: [n] proposed ids.
    probs: [n, vocab] the distribution each token was drawn from, after the same processing as the
      target's; None marks a deterministic drafter (a point mass at each token). In a tree, row i is
      the exact distribution node i was drawn from given everything drafted before it: the parent's
      distribution for children drawn independently, that distribution with the earlier siblings
      removed and renormalised for children drawn without replacement (Gumbel-top-k), a one-hot row
      for a deterministic node in a mixed tree. That one convention makes tree verification exact.
    parents: [n] index of each node's parent within the draft, −1 = child of the last committed token,
      nodes in topological order; None means a chain (node i follows node i−1).
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    parents: torch.Tensor | None = None

    @staticmethod
    def empty() -> Draft:
        """No proposal: the step scores the last committed token alone."""
        return Draft(torch.zeros(0, dtype=torch.long))

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def to(self, device: torch.device) -> Draft:
        """The draft with its tokens and probabilities on `device`, where the target verifies it (`parents`,
        which the step reads on the host, stay there). On the same device: the same tensors."""
        return Draft(self.tokens.to(device), None if self.probs is None else self.probs.to(device), self.parents)

    @property
    def is_tree(self) -> bool:
        """A token tree (parents given, even when they form a chain) rather than a chain."""
        return self.parents is not None


@dataclass(frozen=True)
class Verdict:
    """The rejection rule's decision: keep `accepted` draft tokens, then append `next_token`.

    path: for a tree, the indices of the accepted nodes, root side first (len(path) == accepted);
    None for a chain, where the accepted tokens are the first `accepted` of the draft.
    """

    accepted: int
    next_token: int
    next_origin: Origin
    path: tuple[int, ...] | None = None


@dataclass(frozen=True)
class TokenLogprobs:
    """The target's log-probabilities at one emitted token (its raw distribution: before temperature,
    top-k/p, penalties or a grammar mask).

    logprob: log p(the emitted token); top: the k most likely tokens as (id, log p), most likely first.
    """

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class TokenEvent:
    """One emitted token, as streamed to callers; `logprobs` only when the request asked for them."""

    token_id: int
    text: str
    origin: Origin
    logprobs: TokenLogprobs | None = None


@dataclass
class AcceptanceStats:
    """Acceptance counted over verification steps: α, τ and the acceptance rate per draft position.

    One step drafted `proposed` tokens (a tree: its depth, the longest path it offered) and the
    rejection rule kept the first `accepted` of them (0 ≤ accepted ≤ proposed); a step that drafted
    nothing (plain decoding) still counts as a step. The engine, the server's metrics, the batch
    tally, the γ policies and the online drafter all count with this one type.
    """

    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    judged: int = 0  # draft tokens the rule decided on: the accepted ones and the first rejected one per step
    offered: list[int] = field(default_factory=list)  # [i]: steps that drafted position i (proposed > i)
    kept: list[int] = field(default_factory=list)  # [i]: steps that kept position i (accepted > i)
    histogram: dict[int, int] = field(default_factory=dict)  # accepted count -> steps

    def add(self, proposed: int, accepted: int) -> None:
        """Count one step that drafted `proposed` tokens and kept `accepted`."""
        if not 0 <= accepted <= max(proposed, 0):
            raise ValueError(f"a step keeps between 0 and its {proposed} drafted tokens, not {accepted}")
        self.steps += 1
        self.proposed += proposed
        self.accepted += accepted
        self.judged += accepted + (accepted < proposed)
        self._grow(proposed)
        for i in range(proposed):
            self.offered[i] += 1
            self.kept[i] += accepted > i
        self.histogram[accepted] = self.histogram.get(accepted, 0) + 1

    def merge(self, other: AcceptanceStats) -> None:
        """Add every step `other` counted (the same as adding them one by one)."""
        self.steps += other.steps
        self.proposed += other.proposed
        self.accepted += other.accepted
        self.judged += other.judged
        self._grow(len(other.offered))
        for i, (offered, kept) in enumerate(zip(other.offered, other.kept)):
            self.offered[i] += offered
            self.kept[i] += kept
        for accepted, steps in other.histogram.items():
            self.histogram[accepted] = self.histogram.get(accepted, 0) + steps

    def _grow(self, positions: int) -> None:
        while len(self.offered) < positions:
            self.offered.append(0)
            self.kept.append(0)

    @property
    def alpha(self) -> float:
        """α estimate: accepted / judged draft tokens (the geometric MLE); 0 before any judged token."""
        return self.accepted / self.judged if self.judged else 0.0

    @property
    def tau(self) -> float:
        """τ: tokens emitted per step, the accepted ones plus the target's own (recovered or bonus) one."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def per_position(self) -> list[float]:
        """Share of steps whose draft reached and kept position i, over the steps that drafted it."""
        return [kept / offered for offered, kept in zip(self.offered, self.kept)]

    @classmethod
    def from_dict(cls, stats: dict) -> AcceptanceStats:
        """The counts back from `GenerationStats.to_dict()`'s fields (also after a JSON round trip), to merge
        generations as one; a record without the per-position counts or the histogram (a batch row) leaves
        those empty."""
        return cls(steps=stats["steps"], proposed=stats["proposed_tokens"], accepted=stats["accepted_tokens"],
                   judged=stats["judged_tokens"], offered=list(stats.get("offered_per_position", [])),
                   kept=list(stats.get("kept_per_position", [])),
                   histogram={int(k): n for k, n in stats.get("accepted_histogram", {}).items()})


@dataclass
class StepRecord:
    proposed: int  # the draft's depth (a chain's length)
    accepted: int
    draft_seconds: float
    target_seconds: float
    width: int | None = None  # the draft tokens the verification scored (a tree's nodes); None: `proposed`
    free: bool = False  # proposed by no draft model's forward (`Hint.free`: prompt lookup, also inside `hybrid`)


@dataclass
class GenerationStats:
    """What one generation did: steps, acceptance, timings. Field names match the CLI's --json."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    prefill_seconds: float = 0.0
    wall_seconds: float = 0.0
    cached_tokens: int = 0  # prompt tokens whose keys/values came from an earlier request (prompt caching)
    records: list[StepRecord] = field(default_factory=list)
    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)
    phases: dict[str, float] = field(default_factory=dict)  # seconds per step phase (`PHASES`), summed over steps

    PHASES = ("draft", "target", "verify", "commit", "policy", "emit")  # a step's parts, in order

    def add_phase(self, phase: str, seconds: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds

    def record(self, record: StepRecord) -> None:
        self.records.append(record)
        self.acceptance.add(record.proposed, record.accepted)
        self.steps += 1
        self.draft_seconds += record.draft_seconds
        self.target_seconds += record.target_seconds

    @property
    def proposed_tokens(self) -> int:
        return self.acceptance.proposed

    @property
    def accepted_tokens(self) -> int:
        return self.acceptance.accepted

    @property
    def mean_accepted_length(self) -> float:
        """τ: tokens emitted per target forward (accepted + 1)."""
        return self.acceptance.tau

    @property
    def judged_tokens(self) -> int:
        """Draft tokens the rejection rule decided on: the accepted ones and the first rejected one per step."""
        return self.acceptance.judged

    @property
    def acceptance_rate(self) -> float:
        """α estimate: accepted / drafted positions that were actually judged (the geometric MLE)."""
        return self.acceptance.alpha

    @property
    def per_position_acceptance(self) -> list[float]:
        """Share of steps whose draft reached and kept position i (over steps that proposed ≥ i+1)."""
        return self.acceptance.per_position

    @property
    def accepted_histogram(self) -> dict[int, int]:
        return dict(sorted(self.acceptance.histogram.items()))

    @property
    def cost_ratio(self) -> float:
        """c: seconds per drafted token / seconds per target forward, over the steps a draft model drafted (a
        `hybrid`'s prompt-lookup steps draft for free and would dilute it); over every step when none did."""
        paid = [record for record in self.records if not record.free]
        if paid and len(paid) < len(self.records):
            proposed, draft_seconds = sum(r.proposed for r in paid), sum(r.draft_seconds for r in paid)
        else:
            proposed, draft_seconds = self.proposed_tokens, self.draft_seconds
        if not proposed or not self.target_seconds:
            return 0.0
        return (draft_seconds / proposed) / (self.target_seconds / self.steps)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_seconds if self.wall_seconds else 0.0

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "steps": self.steps,
            "proposed_tokens": self.proposed_tokens,
            "accepted_tokens": self.accepted_tokens,
            "judged_tokens": self.judged_tokens,
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "per_position_acceptance": [round(x, 4) for x in self.per_position_acceptance],
            "offered_per_position": list(self.acceptance.offered),  # the counts behind it (`AcceptanceStats.from_dict`)
            "kept_per_position": list(self.acceptance.kept),
            "accepted_histogram": self.accepted_histogram,
            "draft_seconds": round(self.draft_seconds, 4),
            "target_seconds": round(self.target_seconds, 4),
            "prefill_seconds": round(self.prefill_seconds, 4),
            "cached_tokens": self.cached_tokens,
            "cost_ratio": round(self.cost_ratio, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "wall_seconds": round(self.wall_seconds, 4),
            "phase_seconds": {phase: round(self.phases.get(phase, 0.0), 4) for phase in self.PHASES},
        }


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    stats: GenerationStats
    origins: list[Origin] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None  # one per token id, when the request asked for them
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # one per prompt token (the first: None), when asked for

    def to_dict(self) -> dict:
        out = {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(),
        }
        if self.logprobs is not None:
            out["logprobs"] = [{"logprob": lp.logprob, "top": [list(pair) for pair in lp.top]} for lp in self.logprobs]
        return out
