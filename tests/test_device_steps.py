"""Whole steps on the device (`engine/device_steps.py`), through the same code on a CPU.

On a CPU the captured step runs eagerly, so all but the capture is checked here: the device lookup against
the host's, greedy output against the target alone (plain and prompt lookup, runs cut by EOS, stop strings
and the length limit, the end of the context), requests taking over a storage's buffers, and which requests
take the path. The CUDA test at the end captures real graphs; on a GPU machine:
    PYTHONPATH=src python -m pytest -p no:cacheprovider -q tests/test_device_steps.py
"""

from __future__ import annotations

import random

import pytest
import torch

from verispec import Engine, GenerationConfig, SamplingParams
from verispec.drafters import NgramDrafter
from verispec.drafters.ngram import _NgramSession, lookup_on_device
from verispec.engine import device_steps
from verispec.models import transformer
from verispec.models.loading import load_model
from verispec.testing.reference import reference_generate

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# prompts that repeat themselves, so that prompt lookup drafts tokens the tiny target accepts, and one that does not
PROMPTS = [[3, 4, 5, 6, 3, 4, 5, 6, 3, 4], [7, 8, 9, 7, 8, 9, 7, 8], [10, 21, 33, 2, 17]]


@pytest.fixture
def graphs_everywhere(monkeypatch):
    """Every float runner built in the test replays its steps (eagerly on a CPU)."""
    monkeypatch.setattr(transformer, "graphs_wanted", lambda device: True)


@pytest.fixture
def model(tiny_target, graphs_everywhere):
    loaded = load_model(tiny_target)
    assert loaded.runner.step_graphs is not None
    return loaded


def _engine(model, drafter=None, gamma=4, policy="constant") -> Engine:
    return Engine(model, drafter, gamma=gamma, gamma_policy=policy)


def _generate(engine: Engine, prompt, config: GenerationConfig, expect_device: bool = True):
    generation = engine.start(prompt, config)
    assert (generation.device_steps is not None) == expect_device
    while not generation.done:
        generation.step()
    return generation.result()


def _on_the_host(engine: Engine, prompt, config: GenerationConfig, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setenv("VERISPEC_DEVICE_STEPS", "0")
        return _generate(engine, prompt, config, expect_device=False)


# --- the draft: the host's prompt lookup, in tensor operations -------------------------------------------


def _lookups(rule: _NgramSession, cases: int = 2_000):
    """(host draft, host match length, device draft, device match length) over random sequences of few tokens."""
    rng = random.Random(0)
    for _ in range(cases):
        length, gamma, max_n = rng.randint(1, 40), rng.randint(1, 6), rng.randint(1, 4)
        min_n = rng.randint(1, max_n)
        ids = [rng.randrange(rng.choice([2, 3, 5, 8])) for _ in range(length)]
        host = type(rule)(max_n, min_n, oldest=rule.oldest)
        want, matched = host.lookup(ids, gamma)
        draft, n = lookup_on_device(torch.tensor(ids + [99] * 50), torch.tensor([length]), gamma, max_n, min_n)
        yield want, matched, draft[0].tolist(), int(n)


def test_the_device_lookup_drafts_what_the_host_lookup_drafts():
    matched_long = 0
    for want, matched, draft, n in _lookups(_NgramSession(3, 1)):
        assert n == matched and len(draft) >= len(want) and draft[: len(want)] == want
        matched_long += matched >= 2
    assert matched_long > 500  # longer suffixes matched too, not only single tokens


def test_the_lookup_comparison_tells_another_rule_apart():
    """Positive control: the host's `oldest` rule (the first match, not the latest) differs from the device's."""
    differ = sum(draft[: len(want)] != want for want, _, draft, _ in _lookups(_NgramSession(3, 1, oldest=True)))
    assert differ > 100


def _distinct_continuations(buffer: list[int], length: int, gamma: int, max_n: int, min_n: int, chains: int) -> list[list[int]]:
    """The host's order of matches for a tree (`_NgramSession.tree`: longest suffix first, latest match first), each
    match's γ tokens read from `buffer` (past the sequence too, as the device does), the first `chains` distinct."""
    ids, found = buffer[:length], []
    for n in range(min(max_n, length), min_n - 1, -1):
        for end in range(length - 2, n - 2, -1):  # an n-gram ending before the last token, latest first
            continuation = buffer[end + 1 : end + 1 + gamma]
            if ids[end - n + 1 : end + 1] == ids[-n:] and continuation not in found:
                found.append(continuation)
    return found[:chains]


def test_the_device_lookup_drafts_distinct_continuations_in_the_hosts_order():
    rng, trees = random.Random(1), 0
    for _ in range(1_000):
        length, gamma, max_n, chains = rng.randint(1, 40), rng.randint(1, 6), rng.randint(1, 4), rng.randint(2, 5)
        min_n = rng.randint(1, max_n)
        buffer = [rng.randrange(rng.choice([2, 3, 5])) for _ in range(length)] + [99] * 50
        want = _distinct_continuations(buffer, length, gamma, max_n, min_n, chains)
        drafts, _ = lookup_on_device(torch.tensor(buffer), torch.tensor([length]), gamma, max_n, min_n, chains)
        assert drafts.shape == (chains, gamma) and drafts[: len(want)].tolist() == want
        trees += len(want) == chains
    assert trees > 300  # most sequences held as many distinct continuations as branches


# --- whole generations: the target's own greedy output ---------------------------------------------------


@pytest.mark.parametrize("drafter, gamma", [(None, 1), (NgramDrafter(), 1), (NgramDrafter(), 4), (NgramDrafter(), 12),
                                            (NgramDrafter(max_n=2, min_n=2), 3), (NgramDrafter(nodes=16), 4),
                                            (NgramDrafter(nodes=24), 12), (NgramDrafter(nodes=63), 3)])
def test_device_steps_decode_as_the_target_alone(model, hf_target, drafter, gamma, monkeypatch):
    engine = _engine(model, drafter, gamma)
    config = GenerationConfig(max_new_tokens=40, chat=False, ignore_eos=True)
    accepted = 0
    for prompt in PROMPTS:
        result = _generate(engine, prompt, config)
        assert result.token_ids == reference_generate(hf_target, prompt, 40)
        assert result.token_ids == _on_the_host(engine, prompt, config, monkeypatch).token_ids
        assert result.stats.new_tokens == 40 and result.stats.steps == len(result.stats.records)
        assert sum(r.accepted + 1 for r in result.stats.records) >= 40  # the last step's tokens may pass the limit
        accepted += result.stats.accepted_tokens
    if drafter is not None:
        assert accepted > 20  # prompt lookup drafted tokens the target took, several a step
    else:
        assert accepted == 0


@pytest.mark.parametrize("drafter", [NgramDrafter(), NgramDrafter(nodes=16)])
def test_a_step_without_a_match_counts_as_no_draft(model, drafter):
    """A step whose suffix matched nothing earlier feeds a guess (the shape is fixed) but proposes nothing: its record
    and α are the host lookup's, a step with a match proposes its γ (4, less in the run that reaches the limit)."""
    config = GenerationConfig(max_new_tokens=40, chat=False, ignore_eos=True)
    unmatched = 0
    for prompt in PROMPTS:
        result = _generate(_engine(model, drafter, 4), prompt, config)
        made = 1  # the prefill's token (the first record's)
        for record in result.stats.records[1:]:
            matched = _NgramSession(3, 1).lookup(prompt + result.token_ids[:made], 4)[1]
            if made < 39:  # the run this step is in drafts (one token left: a plain step)
                assert (record.proposed > 0) == (matched > 0) and record.accepted <= record.proposed <= 4
                unmatched += not matched
            made += record.accepted + 1
    assert unmatched > 0


def test_a_tree_keeps_drafts_its_first_branch_missed(model):
    """Positive control for the branches: on the same prompts a tree of four keeps more drafts than the chain that
    is its first branch (a tree that always kept its first branch would keep exactly as many)."""
    config = GenerationConfig(max_new_tokens=40, chat=False, ignore_eos=True)
    kept = [sum(_generate(_engine(model, drafter, 4), prompt, config).stats.accepted_tokens for prompt in PROMPTS)
            for drafter in (NgramDrafter(), NgramDrafter(nodes=16))]
    assert kept[1] > kept[0] + 5


@pytest.mark.parametrize("max_new", [1, 2, 3, 9, 17])
def test_a_run_of_steps_ends_where_the_request_does(model, max_new, monkeypatch):
    engine = _engine(model, NgramDrafter(), 4)
    for prompt in PROMPTS:
        config = GenerationConfig(max_new_tokens=max_new, chat=False, ignore_eos=True)
        got, want = _generate(engine, prompt, config), _on_the_host(engine, prompt, config, monkeypatch)
        assert got.token_ids == want.token_ids and len(got.token_ids) == max_new
        assert (got.text, got.finish_reason) == (want.text, want.finish_reason) == (want.text, "length")


def test_eos_and_stop_strings_end_a_run_mid_way(model, monkeypatch):
    engine = _engine(model, NgramDrafter(), 4)
    prompt = PROMPTS[0]
    free = _generate(engine, prompt, GenerationConfig(max_new_tokens=40, chat=False, ignore_eos=True)).token_ids
    eos = free[11]  # a token the target emits mid-way: as EOS it ends the answer there
    end = free.index(eos) + 1
    model.eos_ids = frozenset({eos})
    config = GenerationConfig(max_new_tokens=40, chat=False)
    got = _generate(engine, prompt, config)
    assert got.token_ids == free[:end] and got.finish_reason == "stop"
    plain = _generate(_engine(model, None), prompt, config)
    assert plain.token_ids == free[:end] and plain.stats.steps == end  # the steps replayed past the EOS are not counted
    model.eos_ids = frozenset({0})
    stop = model.tokenizer.decode([free[7]])  # a word of the answer as a stop string
    config = GenerationConfig(max_new_tokens=40, chat=False, ignore_eos=True, stop=(stop,))
    got, want = _generate(engine, prompt, config), _on_the_host(engine, prompt, config, monkeypatch)
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, "stop")
    assert stop not in got.text


def test_streamed_events_join_to_the_text(model):
    engine = _engine(model, NgramDrafter(), 4)
    config = GenerationConfig(max_new_tokens=30, chat=False, ignore_eos=True)
    events = list(engine.stream(PROMPTS[1], config))
    result = engine.generate(PROMPTS[1], config)
    assert [event.token_id for event in events] == result.token_ids
    assert "".join(event.text for event in events) == result.text


@pytest.mark.parametrize("drafter", [NgramDrafter(), NgramDrafter(nodes=16)])
def test_the_end_of_the_context_is_reached_on_the_host(model, hf_target, drafter):
    """The tiny target's context is 128: a run of steps needs room for every token it may write, so the last
    steps go through the host, and the answer is still the target's own."""
    prompt = (PROMPTS[0] * 12)[:100]
    engine = _engine(model, drafter, 4)
    result = _generate(engine, prompt, GenerationConfig(max_new_tokens=100, chat=False, ignore_eos=True))
    assert len(result.token_ids) == 28 and result.token_ids == reference_generate(hf_target, prompt, 28)


@pytest.mark.parametrize("drafter", [NgramDrafter(), NgramDrafter(nodes=16)])
def test_a_sequence_that_outgrows_its_storage_moves_to_a_bigger_one(tmp_path, graphs_everywhere, drafter):
    """A cache sized for the request (200 + 42 tokens and a step's draft: the pool's 256 slots) moves to a storage of
    512 when a run of steps may write past it: new buffers, the sequence loaded into them, the same answer."""
    from conftest import make_tiny_model
    from transformers import AutoModelForCausalLM

    folder = make_tiny_model(tmp_path / "long", seed=4, layers=2, context=1024)
    long_model, hf = load_model(folder), AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = (PROMPTS[1] * 40)[:200]
    result = _generate(_engine(long_model, drafter, 4), prompt, GenerationConfig(max_new_tokens=42, chat=False, ignore_eos=True))
    assert result.token_ids == reference_generate(hf, prompt, 42)
    assert {key[-1] for key in long_model.runner.step_graphs.steps} == {256, 512}  # buffers by storage capacity


def test_requests_take_over_a_storage_and_its_buffers(model, hf_target):
    """A later request gets a released storage back (its graphs and buffers with it) and loads its own sequence;
    two requests stepped in turns each keep their own."""
    engine = _engine(model, NgramDrafter(), 4)
    config = GenerationConfig(max_new_tokens=24, chat=False, ignore_eos=True)
    want = [reference_generate(hf_target, prompt, 24) for prompt in PROMPTS]
    assert [_generate(engine, prompt, config).token_ids for prompt in PROMPTS] == want
    assert len(model.runner.step_graphs.steps) == 1  # one storage, handed from request to request
    first, second = engine.start(PROMPTS[0], config), engine.start(PROMPTS[1], config)
    while not (first.done and second.done):
        for generation in (first, second):
            if not generation.done:
                generation.step()
    assert [first.result().token_ids, second.result().token_ids] == want[:2]


def test_only_simple_greedy_requests_take_the_device_path(model, monkeypatch):
    from verispec.drafters.tree import ExpansionDrafter

    def takes(drafter=None, **config) -> bool:
        generation = _engine(model, drafter).start(PROMPTS[0], GenerationConfig(max_new_tokens=4, chat=False, **config))
        generation.close()
        return generation.device_steps is not None

    assert takes() and takes(NgramDrafter())
    assert not takes(sampling=SamplingParams(temperature=0.7))
    assert not takes(sampling=SamplingParams(repetition_penalty=1.3))
    assert not takes(sampling=SamplingParams(logit_bias=((5, 2.0),)))
    assert not takes(logprobs=2)
    assert not takes(min_tokens=2)
    assert not takes(response_format={"type": "grammar", "grammar": 'root ::= ("t2" | "t3")+'})
    assert takes(NgramDrafter(nodes=8)) and not takes(NgramDrafter(oldest=1))
    assert not takes(ExpansionDrafter(model, model.vocab_size))
    monkeypatch.setenv("VERISPEC_DEVICE_STEPS", "0")
    assert not takes()


def test_a_runner_that_does_not_replay_its_steps_keeps_the_host_path(tiny_target):
    launched = load_model(tiny_target)
    assert launched.runner.step_graphs is None
    generation = Engine(launched, NgramDrafter(), gamma=4, gamma_policy="constant").start(PROMPTS[0], GenerationConfig(chat=False))
    assert generation.device_steps is None
    generation.close()


def test_one_call_replays_a_run_of_steps(model):
    """`step()` replays STEPS_PER_SYNC steps before the host reads back: plain decoding emits one token a step."""
    generation = _engine(model, None).start(PROMPTS[2], GenerationConfig(max_new_tokens=30, chat=False, ignore_eos=True))
    generation.step()  # the first token, from the prefill
    generation.step()
    assert len(generation.output_ids) == 1 + device_steps.STEPS_PER_SYNC == generation.stats.steps
    generation.close()


# --- on a GPU: real graphs ---------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("drafter", [None, NgramDrafter(), NgramDrafter(nodes=16)])
def test_cuda_device_steps_equal_host_steps(tiny_target, drafter, monkeypatch):
    model = load_model(tiny_target, "float32", device="cuda")
    assert model.runner.step_graphs is not None and model.runner.step_graphs.capture
    engine = Engine(model, drafter, gamma=4, gamma_policy="constant")
    config = GenerationConfig(max_new_tokens=40, chat=False, ignore_eos=True)
    for _ in range(2):  # the second round replays the first round's captures
        for prompt in PROMPTS:
            assert _generate(engine, prompt, config).token_ids == _on_the_host(engine, prompt, config, monkeypatch).token_ids
    assert model.runner.step_graphs.captured_steps >= 1
