"""Online drafter on tiny random models: α rises on a repeated prompt stream, output stays exact,
updates are versioned on disk and a harmful update is rolled back."""

import pytest
import torch

from verispec import Engine, GenerationConfig
from verispec.drafters.online import OnlineDrafter
from verispec.testing.reference import reference_generate

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
    import verispec.drafters.online as online

    def harmful(head, *args, **kwargs):
        head.B = 50.0 * torch.randn_like(head.B)  # a wild adapter: the draft turns to noise
        return 0.0

    monkeypatch.setattr(online, "distill", harmful)
    # the target drafting for itself: α = 1 before the update, so a harmful one must show
    drafter = OnlineDrafter(target, target.vocab_size, buffer_size=10**6, eval_requests=2, holdout=0, store=tmp_path)
    engine = Engine(target, drafter, gamma=3, gamma_policy="constant")
    assert _alphas(engine, 2) == [1.0, 1.0]
    drafter.add_miss(torch.zeros(drafter.head.in_features), torch.zeros(target.vocab_size))  # no misses yet
    drafter.update()  # by hand: the buffer is too large to trigger one
    assert drafter.version == 1 and (tmp_path / "v0001.pt").exists()
    _alphas(engine, 3)  # two requests on probation, then the verdict at the next start
    assert drafter.version == 0 and torch.count_nonzero(drafter.head.B) == 0, drafter.events
    assert any("rolled back" in e for e in drafter.events)
    # the next harmful update is judged against the kept version's α (1.0), not the rejected one's
    drafter.update()
    _alphas(engine, 3)
    assert drafter.version == 0 and sum("rolled back" in e for e in drafter.events) == 2, drafter.events


def test_an_update_that_breaks_held_out_positions_never_serves(target, tmp_path, monkeypatch):
    import verispec.drafters.online as online

    def harmful(head, *args, **kwargs):
        head.B = 50.0 * torch.randn_like(head.B)
        return 0.0

    monkeypatch.setattr(online, "distill", harmful)
    drafter = OnlineDrafter(target, target.vocab_size, buffer_size=10**6, store=tmp_path)
    engine = Engine(target, drafter, gamma=3, gamma_policy="constant")
    _alphas(engine, 2)  # the target drafting itself: every drafted position becomes an anchor
    assert len(drafter.anchors) >= 8
    for token in range(8):
        drafter.add_miss(torch.randn(drafter.head.in_features), torch.eye(target.vocab_size)[token])
    drafter.update()
    assert drafter.version == 0 and torch.count_nonzero(drafter.head.B) == 0 and not list(tmp_path.glob("v*.pt"))
    assert "discarded an update" in drafter.events[-1] and "Δα -" in drafter.events[-1], drafter.events


def test_distillation_fixes_misses_and_keeps_the_anchored_positions(draft):
    from verispec.drafters.online import LowRankHead, distill

    head = LowRankHead(draft.runner.lm_head, rank=4)
    torch.manual_seed(0)
    features = torch.randn(24, head.in_features)  # [24, hidden]
    before = head(features).argmax(-1)  # [24]
    misses, anchors = features[:6], features[6:]
    wanted = (before[:6] + 1) % head.out_features  # the target disagrees at the first 6
    target = wanted[:, None], torch.ones(6, 1)  # the target's top token per miss, with probability 1
    distill(head, misses, target, steps=150, lr=0.05, anchors=anchors)
    after = head(features).argmax(-1)
    assert torch.equal(after[:6], wanted) and torch.equal(after[6:], before[6:])


def test_the_loss_is_the_exact_kl_over_the_vocabulary_though_only_some_columns_train(draft):
    """Only the misses' target tokens (and tokens B already moved) train, yet the loss is exactly
    KL(target ‖ draft) over the full vocabulary, before and after an update."""
    from verispec.drafters.online import LowRankHead, distill

    head = LowRankHead(draft.runner.lm_head, rank=4)
    torch.manual_seed(1)
    features = torch.randn(5, head.in_features)  # [5, hidden]
    probs, ids = torch.softmax(3 * torch.randn(5, head.out_features), -1).topk(3)  # the target's top 3, [5, 3]
    truncated = torch.zeros(5, head.out_features).scatter_(1, ids, probs / probs.sum(-1, keepdim=True))  # [5, vocab]

    def full_kl(rows: slice) -> float:
        draft_log_probs = torch.log_softmax(head(features[rows]), -1)  # [r, vocab]
        return float(torch.nn.functional.kl_div(draft_log_probs, truncated[rows], reduction="none").sum(-1).mean())

    first, rest = slice(0, 2), slice(2, 5)
    assert distill(head, features, (ids, probs), steps=1, lr=0.0) == pytest.approx(full_kl(slice(0, 5)), rel=1e-5)
    distill(head, features[first], (ids[first], probs[first]), steps=20, lr=0.05)  # B moves on these rows' tokens
    assert 0 < torch.count_nonzero(head.B.abs().sum(-1)) <= 6
    assert distill(head, features[rest], (ids[rest], probs[rest]), steps=1, lr=0.0) == pytest.approx(full_kl(rest), rel=1e-5)


def test_update_without_misses_is_a_clear_error(target, draft, tmp_path):
    with pytest.raises(ValueError, match="buffer"):
        OnlineDrafter(draft, target.vocab_size, store=tmp_path).update()


def test_online_is_a_drafter_spec_that_learns_across_concurrent_requests(target, draft, tmp_path, monkeypatch):
    """`online:…` from the factory (as the CLI, server and bench build it); α is recorded per request
    when it finishes, also when requests overlap as in the server's batches."""
    from verispec.drafters import make_drafter
    from verispec.models.loading import ModelCache, load_model

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    models = ModelCache(load_model(draft.name, "int8"), frozen=True)  # a float32 target drafts in int8
    models.default_draft = draft.name
    drafter = make_drafter("online:rank=4,buffer_size=8,eval_requests=1", target, load=models)
    assert isinstance(drafter, OnlineDrafter) and drafter.buffer_size == 8 and drafter.head.A.shape[0] == 4
    engine = Engine(target, drafter, gamma=3, gamma_policy="constant")
    first, second = (engine.start(PROMPT, GenerationConfig(max_new_tokens=30)) for _ in range(2))
    while not (first.done and second.done):  # interleaved, like two rows of one batch
        first.step()
        second.step()
    assert len(drafter.alphas) == 2 and drafter.alphas[0] == pytest.approx(first.stats.acceptance_rate)
    _alphas(engine, 3)
    assert drafter.version >= 1 and list((tmp_path / "online").glob("*/v*.pt"))
    with pytest.raises(Exception, match="unknown online drafter option 'rnak'"):
        make_drafter("online:rnak=4", target, load=models)


def test_the_stream_benchmark_compares_frozen_and_online_side_by_side(target, draft, tmp_path):
    from verispec.tools.bench.online import plot_stream, run_stream
    from verispec.drafters import DraftModelDrafter

    frozen = Engine(target, DraftModelDrafter(draft, target.vocab_size), gamma=3, gamma_policy="constant")
    online = Engine(target, OnlineDrafter(draft, target.vocab_size, buffer_size=8, store=tmp_path), gamma=3, gamma_policy="constant")
    rows = run_stream(frozen, online, [PROMPT] * 5, max_new_tokens=20)
    assert [r["request"] for r in rows] == list(range(5)) and all(r["same_text"] for r in rows)
    assert rows[-1]["online_version"] >= 1 and rows[-1]["online_alpha"] > rows[0]["frozen_alpha"]
    # a request is flagged when it started with an update, kept or discarded
    assert [r["request"] for r in rows if r["trained"]] and not rows[0]["trained"]
    assert sum(r["trained"] for r in rows) == online.drafter.trainings
    assert plot_stream(rows, tmp_path / "alpha.png").stat().st_size > 1000


def test_online_can_distil_the_targets_own_first_layers(target, hf_target, tmp_path, monkeypatch):
    """`online:self_layers=L`: the draft is the target's first L layers (weights shared; the target's own
    head untouched by the adapter); it learns and the output stays the target's."""
    from verispec.drafters import make_drafter

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    drafter = make_drafter("online:self_layers=1,rank=4,buffer_size=8,eval_requests=1", target)
    assert isinstance(drafter, OnlineDrafter) and drafter.model.runner.config.num_layers == 1
    assert drafter.model.runner.layers[0] is target.runner.layers[0] and target.runner.lm_head is drafter.head.base
    engine = Engine(target, drafter, gamma=3, gamma_policy="constant")
    alphas = _alphas(engine, 6)
    assert drafter.version >= 1 and alphas[-1] > alphas[0], (alphas, drafter.events)
    expected = reference_generate(hf_target, PROMPT, 30, eos_ids=target.eos_ids)
    assert engine.generate(PROMPT, GenerationConfig(max_new_tokens=30)).token_ids == expected
    with pytest.raises(Exception, match="self_layers"):
        make_drafter("online:self_layers=x", target)
