"""Online drafter on tiny random models: α rises on a repeated prompt stream, output stays exact,
updates are versioned on disk and a harmful update is rolled back."""

import pytest
import torch

from verispec import Engine, GenerationConfig
from verispec.online import OnlineDrafter
from verispec.reference import reference_generate

PROMPT = [11, 3, 3, 3, 8, 1, 30, 12, 5]


def _alphas(engine: Engine, requests: int) -> list[float]:
    config = GenerationConfig(max_new_tokens=30)
    return [engine.generate(PROMPT, config).stats.acceptance_rate for _ in range(requests)]


def test_alpha_rises_after_updates_and_output_stays_exact(target, draft, hf_target, tmp_path):
    drafter = OnlineDrafter(draft, target.vocab_size, buffer_size=8, store=tmp_path)
    engine = Engine(target, drafter, gamma=3, gamma_policy="constant")
    before = _alphas(engine, 1)  # the untouched draft
    assert drafter.version == 0 and len(drafter.buffer) >= 8  # its misses were collected
    later = _alphas(engine, 6)  # updates happen between these requests
    assert drafter.version >= 1 and sorted(p.name for p in tmp_path.glob("v*.pt"))
    assert later[-1] > max(before) + 0.2, (before, later, drafter.events)
    expected = reference_generate(hf_target, PROMPT, 30, eos_ids=target.eos_ids)
    assert engine.generate(PROMPT, GenerationConfig(max_new_tokens=30)).token_ids == expected


def test_an_update_that_lowers_alpha_is_rolled_back(target, tmp_path, monkeypatch):
    import verispec.online as online

    def harmful(head, features, target_logits, steps, lr):
        head.B = 50.0 * torch.randn_like(head.B)  # a wild adapter: the draft turns to noise
        return 0.0

    monkeypatch.setattr(online, "distill", harmful)
    # the target drafting for itself: α = 1 before the update, so a harmful one must show
    drafter = OnlineDrafter(target, target.vocab_size, buffer_size=10**6, eval_requests=2, store=tmp_path)
    engine = Engine(target, drafter, gamma=3, gamma_policy="constant")
    assert _alphas(engine, 2) == [1.0, 1.0]
    drafter.buffer.append((torch.zeros(drafter.head.in_features), torch.zeros(target.vocab_size)))  # no misses yet
    drafter.update()  # by hand: the buffer is too large to trigger one
    assert drafter.version == 1 and (tmp_path / "v0001.pt").exists()
    _alphas(engine, 3)  # two requests on probation, then the verdict at the next start
    assert drafter.version == 0 and torch.count_nonzero(drafter.head.B) == 0, drafter.events
    assert any("rolled back" in e for e in drafter.events)


def test_update_without_misses_is_a_clear_error(target, draft, tmp_path):
    with pytest.raises(ValueError, match="buffer"):
        OnlineDrafter(draft, target.vocab_size, store=tmp_path).update()
