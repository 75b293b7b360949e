"""Online speculative decoding: distil the draft model toward the target while serving.

The draft model's LM head gets a low-rank adapter (logits += (h Aᵀ) Bᵀ, B starting at zero).
While drafting, the head's inputs h (the draft's final hidden state at each drafted position) are
tapped. Only the head changes, so h does not depend on the adapter version. When the target
rejects a draft token, the pair (h there, the target's distribution there) is a miss; a draft
token the target accepted leaves its h as an anchor. Both go into bounded replay windows (the
last `replay` × `buffer_size` misses, four times as many anchors). A request's α is recorded when
it finishes (several may run at once, as in the server's batches).

When a request starts and `buffer_size` new misses have come in since the last update, A and B are
trained with plain torch autograd on fixed features: KL(target ‖ draft) over the replayed misses
plus KL(draft before ‖ draft) over the anchors, so the update fixes the misses without moving the
draft where it already agreed. A miss keeps only the target's `support` most likely tokens. Both
KLs are exact over the full vocabulary without a full-vocabulary softmax per row and Adam step
(which made one update block its request far longer: docs/history.md#avx2-repeated-topics-online-drafter
and docs/history.md): B is trained only on the columns that
can change, the misses' target tokens and every token B already moved; all other tokens keep their
base logits, so their log-sum-exp per row is one constant, computed in one pass before training.

The newest `holdout` % of misses and anchors stay out of training and judge the update first: it
serves only if (1 − α)·(share of held-out misses it fixes) − α·(share of held-out anchors it
moves), the change of α it predicts, is positive. A served update
is saved as a version under `cache_dir()/online/<draft>/`; if the α of the next `eval_requests`
requests falls below the α of the version it replaced (minus `tolerance`), that version comes
back. A new version is always judged against the kept version's α, never a rejected one's. The
target still verifies every token, so the output stays exactly the target's.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import statistics
from collections import deque
from pathlib import Path

import torch
import torch.nn.functional as F

from verispec.drafters.base import Drafter, DraftSession
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.models.loading import require_own_runner
from verispec.models.runner import LoadedModel
from verispec.paths import cache_dir
from verispec.types import AcceptanceStats

__all__ = ["LowRankHead", "OnlineDrafter", "distill"]


class LowRankHead:
    """An LM head plus a trainable low-rank correction; optionally records its inputs (`tap`)."""

    def __init__(self, base, rank: int, seed: int = 0, device: torch.device = torch.device("cpu")):
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        generator = torch.Generator().manual_seed(seed)  # drawn on the CPU: the same start on every device
        self.A = (torch.randn(rank, self.in_features, generator=generator) / self.in_features**0.5).to(device)  # [rank, hidden]
        self.B = torch.zeros(self.out_features, rank, device=device)  # [vocab, rank], beside the head it corrects
        self.bias = None
        self.tap: list[torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        """The base head's bytes and the correction's (float32 A and B)."""
        return self.base.nbytes + (self.A.numel() + self.B.numel()) * self.A.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x [rows, hidden] -> [rows, vocab]
        if self.tap is not None:
            self.tap.append(x[-1].clone())
        return self.base(x) + ((x.float() @ self.A.T) @ self.B.T).to(x.dtype)


def distill(head: LowRankHead, features: torch.Tensor, target: tuple[torch.Tensor, torch.Tensor], steps: int,
            lr: float, anchors: torch.Tensor | None = None) -> float:
    """Fit head.A, head.B to KL(target ‖ draft) on features [n, hidden], where `target` is the target's
    most likely tokens and their probabilities (ids [n, k], probs [n, k], renormalized), plus
    KL(draft now ‖ draft) on `anchors` [m, hidden] (positions the draft got right). Exact over the
    vocabulary (see the module docstring); returns the last loss."""
    with torch.inference_mode(False), torch.enable_grad():
        x = features.clone().float()  # [n, hidden]
        a = (anchors if anchors is not None else features[:0]).clone().float()  # [m, hidden]
        ids, probs = target  # [n, k]
        columns = torch.unique(torch.cat([ids.flatten(), head.B.abs().sum(-1).nonzero().flatten()]))  # [u], sorted
        with torch.no_grad():
            miss_base, miss_rest = _columns_and_rest(head.base, x, columns)  # [n, u], [n, 1]
            anchor_base, anchor_rest = _columns_and_rest(head.base, a, columns)  # [m, u], [m, 1]
            wanted = torch.zeros_like(miss_base).scatter_add_(1, torch.searchsorted(columns, ids), probs.float())
            wanted = F.pad(wanted / wanted.sum(-1, keepdim=True).clamp_min(1e-30), (0, 1))  # [n, u + 1]; 0 on the rest
            keep = _log_probs(anchor_base, anchor_rest, a @ head.A.T, head.B[columns])  # [m, u + 1]
        A = head.A.clone().requires_grad_(True)
        trained = head.B[columns].clone().requires_grad_(True)  # [u, rank]; B's other rows stay zero
        optimizer = torch.optim.Adam([A, trained], lr=lr)
        loss = torch.tensor(0.0)
        for _ in range(steps):
            draft_log_probs = _log_probs(miss_base, miss_rest, x @ A.T, trained)  # [n, u + 1]
            loss = (torch.xlogy(wanted, wanted) - wanted * draft_log_probs).sum(-1).mean()
            if len(a):
                moved = _log_probs(anchor_base, anchor_rest, a @ A.T, trained)  # [m, u + 1]
                loss = loss + (keep.exp() * (keep - moved)).sum(-1).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        head.A, head.B = A.detach(), head.B.index_copy(0, columns, trained.detach())
    return float(loss.detach())


def _columns_and_rest(base, x: torch.Tensor, columns: torch.Tensor, chunk: int = 256):
    """The base head's logits of x [n, hidden] at `columns` [u], and the log-sum-exp of all its other
    logits per row ([n, 1]; -1e4 when there are none), with full-vocabulary logits for `chunk` rows at
    a time."""
    at, rest = [x.new_zeros(0, len(columns))], [x.new_zeros(0, 1)]
    for rows in range(0, len(x), chunk):
        logits = base(x[rows : rows + chunk]).float()  # [r, vocab]
        at.append(logits[:, columns])
        logits[:, columns] = -torch.inf
        rest.append(logits.logsumexp(-1, keepdim=True).clamp_min(-1e4))
    return torch.cat(at), torch.cat(rest)


def _log_probs(base: torch.Tensor, rest: torch.Tensor, projected: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of the columns and, last, of all other tokens together: base [n, u], rest
    [n, 1], projected = x Aᵀ [n, rank], B the adapter's rows of the columns [u, rank] -> [n, u + 1]."""
    return F.log_softmax(torch.cat([base + projected @ B.T, rest], 1), -1)


class OnlineDrafter(Drafter):
    """A draft-model drafter that learns from its misses between requests (see the module docstring)."""

    def __init__(
        self, draft: LoadedModel, target_vocab_size: int, rank: int = 8, buffer_size: int = 64, steps: int = 40,
        lr: float = 0.02, eval_requests: int = 2, tolerance: float = 0.02, replay: int = 4, holdout: int = 25,
        support: int = 64, store: Path | None = None,
    ):
        require_own_runner(draft, "the online drafter")
        runner = copy.copy(draft.runner)  # shares the weights; only the head object differs
        self.head = runner.lm_head = LowRankHead(draft.runner.lm_head, rank, device=draft.runner.device)
        self.model = dataclasses.replace(draft, runner=runner, name=f"{draft.name}+online")
        self.inner = DraftModelDrafter(self.model, target_vocab_size)
        self.name = f"online:{draft.name}"
        self.buffer_size, self.steps, self.lr = buffer_size, steps, lr
        self.eval_requests, self.tolerance, self.holdout, self.support = eval_requests, tolerance, holdout, support
        self.store = store or cache_dir() / "online" / re.sub(r"[^A-Za-z0-9._-]+", "_", draft.name)
        self.buffer: deque[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = deque(maxlen=replay * buffer_size)
        # misses: (hidden [hidden], the target's `support` most likely token ids [support], their probs [support])
        self.anchors: deque[torch.Tensor] = deque(maxlen=4 * replay * buffer_size)  # hidden [hidden] of accepted
        # tokens: a good draft gets most tokens right, so it keeps more of them than of its misses
        self.new_misses = 0  # misses since the last update
        self.alphas: list[float] = []  # measured α of each finished request
        self.version = 0  # 0 = the untouched draft
        self.trainings = 0  # updates run (kept or discarded)
        self.events: list[str] = []
        self._probation: tuple[int, float, int] | None = None  # (previous version, its α, requests at update)
        self._kept_since = 0  # index into alphas where the kept version's own requests begin
        self._kept_alpha: float | None = None  # the kept version's α when it has had no requests of its own yet

    def start(self, prompt_ids: list[int]) -> DraftSession:
        """Between requests: judge a version on probation, distil when the buffer is full, then draft."""
        self._judge_probation()
        if self.new_misses >= self.buffer_size and self._probation is None:
            self.update()
        return _OnlineSession(self, self.inner.start(prompt_ids))

    def add_miss(self, hidden: torch.Tensor, target_probs: torch.Tensor) -> None:
        """Remember a position the draft got wrong: the head's input there [hidden] and the target's
        distribution there [vocab], of which the `support` most likely tokens are kept."""
        probs, ids = target_probs[: self.head.out_features].float().topk(min(self.support, self.head.out_features))
        self.buffer.append((hidden, ids, probs))
        self.new_misses += 1

    def _finished(self, session: _OnlineSession) -> None:
        if session.acceptance.judged:
            self.alphas.append(session.acceptance.alpha)

    def _judge_probation(self) -> None:
        if self._probation is None:
            return
        previous, alpha_before, at = self._probation
        after = self.alphas[at:]
        if len(after) < self.eval_requests:
            return
        alpha_after = statistics.fmean(after)
        self._probation = None
        if alpha_after < alpha_before - self.tolerance:
            self.load_version(previous)
            self._kept_since, self._kept_alpha = len(self.alphas), alpha_before
            self.events.append(f"rolled back to v{previous}: α {alpha_before:.3f} → {alpha_after:.3f}")
        else:
            self._kept_since, self._kept_alpha = at, alpha_after
            self.events.append(f"kept v{self.version}: α {alpha_before:.3f} → {alpha_after:.3f}")

    def _kept_version_alpha(self) -> float:
        """α of the version in use, from its own most recent requests (at most 2 × eval_requests)."""
        own = self.alphas[self._kept_since :][-2 * self.eval_requests :]
        return statistics.fmean(own) if own else (self._kept_alpha or 0.0)

    def update(self) -> float:
        """Distil on the replayed misses and anchors; a version that the held-out positions predict to
        raise α is saved and put on probation, any other is discarded. Returns the training loss."""
        if not self.buffer:
            raise ValueError("nothing to learn from yet: the buffer of draft misses is empty")
        misses, held_misses = _split(list(self.buffer), self.holdout)
        anchors, held_anchors = _split(list(self.anchors), self.holdout)
        features = torch.stack([h for h, _, _ in misses])  # [n, hidden]
        target = torch.stack([i for _, i, _ in misses]), torch.stack([p for _, _, p in misses])  # ids, probs [n, k]
        alpha_before, previous = self._kept_version_alpha(), self.version
        kept = self.head.A, self.head.B
        before = _HeldOut(self.head, held_misses, held_anchors)
        loss = distill(self.head, features, target, self.steps, self.lr, torch.stack(anchors) if anchors else None)
        self.new_misses = 0
        self.trainings += 1
        gain = before.predicted_gain(self.head, alpha_before)
        trained = f"{len(features)} misses and {len(anchors)} anchors, loss {loss:.4f}"
        if gain is not None and gain <= 0:
            self.head.A, self.head.B = kept
            self.events.append(f"discarded an update ({trained}): on {len(held_misses)} held-out misses and "
                               f"{len(held_anchors)} anchors it predicted Δα {gain:+.4f}")
            return loss
        self.version = self._save()
        self._probation = (previous, alpha_before, len(self.alphas))
        self.events.append(f"v{self.version}: distilled on {trained}"
                           + ("" if gain is None else f", held-out Δα {gain:+.4f}"))
        return loss

    def _path(self, version: int) -> Path:
        return self.store / f"v{version:04d}.pt"

    def _save(self) -> int:
        self.store.mkdir(parents=True, exist_ok=True)
        version = max([int(p.stem[1:]) for p in self.store.glob("v*.pt")] + [self.version]) + 1
        torch.save({"A": self.head.A, "B": self.head.B}, self._path(version))
        return version

    def load_version(self, version: int) -> None:
        """Restore a saved adapter (0 = the untouched draft)."""
        if version == 0:
            self.head.B = torch.zeros_like(self.head.B)
        else:
            saved = torch.load(self._path(version), map_location=self.head.B.device)  # saved on any device
            self.head.A, self.head.B = saved["A"], saved["B"]
        self.version = version


def _split(items: list, percent: int) -> tuple[list, list]:
    """(older, newest `percent` %) of a time-ordered list; nothing held out of fewer than 4 items."""
    held = len(items) * percent // 100 if len(items) >= 4 else 0
    return items[: len(items) - held], items[len(items) - held :]


class _HeldOut:
    """Positions kept out of training, to judge an update before it serves: the share of held-out
    misses it fixes (argmax = the target's) and of held-out anchors it breaks (argmax moves)."""

    def __init__(self, head: LowRankHead, misses: list, anchors: list[torch.Tensor]):
        self.miss_features = torch.stack([h for h, _, _ in misses]) if misses else None  # [k, hidden]
        self.wanted = torch.stack([ids[0] for _, ids, _ in misses]) if misses else None  # [k], the target's argmax
        self.anchors = torch.stack(anchors) if anchors else None  # [j, hidden]
        self.fixed_before = self._fixed(head)
        self.anchor_tokens = head(self.anchors).argmax(-1) if anchors else None  # [j]

    def _fixed(self, head: LowRankHead) -> float:
        if self.miss_features is None:
            return 0.0
        return (head(self.miss_features).argmax(-1) == self.wanted).float().mean().item()

    def predicted_gain(self, head: LowRankHead, alpha: float) -> float | None:
        """Δα ≈ (1 − α)·(more misses fixed) − α·(anchors broken); None when nothing was held out."""
        if self.miss_features is None or self.anchors is None:
            return None
        broken = (head(self.anchors).argmax(-1) != self.anchor_tokens).float().mean().item()
        return (1 - alpha) * (self._fixed(head) - self.fixed_before) - alpha * broken


class _OnlineSession(DraftSession):
    def __init__(self, drafter: OnlineDrafter, inner: DraftSession):
        self.drafter, self.inner = drafter, inner
        self.hidden: list[torch.Tensor] = []  # the head's input at each drafted position, [hidden] each
        self.acceptance = AcceptanceStats()  # this request's steps, for its α

    def propose(self, ids, gamma, params, generator):
        head = self.drafter.head
        head.tap = []
        try:
            draft = self.inner.propose(ids, gamma, params, generator)
        finally:
            self.hidden, head.tap = head.tap, None
        return draft

    def commit(self, ids):
        self.inner.commit(ids)

    def finish(self):
        self.inner.finish()
        self.drafter._finished(self)

    observes_target = True

    def observe(self, ids, target_probs):
        accepted, proposed = target_probs.shape[0] - 1, len(self.hidden)
        if not proposed:
            return
        self.acceptance.add(proposed, accepted)
        self.drafter.anchors.extend(self.hidden[:accepted])  # where the draft agreed: keep it so
        if accepted < proposed:  # a miss: the target's distribution where the draft went wrong
            self.drafter.add_miss(self.hidden[accepted], target_probs[-1])
