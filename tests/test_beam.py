"""Beam search over the target alone: greedy at width 1, Hugging Face's beam search at width k."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from verispec.errors import InvalidParameterError, PromptError
from verispec.models.runner import LoadedModel
from verispec.models.transformer import Transformer
from verispec.engine.beam import beam_search

VOCAB, EOS = 64, 3


def _build(folder, seed: int, eos_boost: float) -> Qwen2ForCausalLM:
    """A tiny random Qwen2 with peaked next-token distributions; `eos_boost` scales the eos logit
    row so that beams end on eos at varied lengths (2.0: often enough to exercise early stopping)."""
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    hf = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(20.0)
        hf.lm_head.weight[EOS].mul_(eos_boost)
    hf.save_pretrained(folder)
    return hf


def _ours(folder, eos_ids=frozenset({EOS})) -> LoadedModel:
    return LoadedModel("tiny", folder, Transformer.from_folder(folder), tokenizer=None, eos_ids=eos_ids)


def _prompt(seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    length = int(torch.randint(1, 9, (1,), generator=g))
    return torch.randint(EOS + 1, VOCAB, (length,), generator=g).tolist()


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """(hf, ours) for seeds 2 and 3 with a boosted eos."""
    out = []
    for seed in (2, 3):
        folder = tmp_path_factory.mktemp(f"beam{seed}")
        out.append((_build(folder, seed, eos_boost=2.0), _ours(folder)))
    return out


def _hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float(), dim=-1)  # [vocab]


def test_one_beam_is_greedy_decoding(pairs):
    """Width 1 equals argmax decoding recomputed from scratch each step, stopping at eos."""
    stops = 0
    for hf, ours in pairs:
        for p in range(4):
            prompt = _prompt(10 + p)
            ids, total = list(prompt), 0.0
            for _ in range(10):
                logprobs = _hf_logprobs(hf, ids)
                ids.append(int(logprobs.argmax()))
                total += float(logprobs[ids[-1]])
                if ids[-1] == EOS:
                    break
            expected = ids[len(prompt) :]
            result = beam_search(ours, prompt, num_beams=1, max_new_tokens=10)
            assert result.token_ids == expected
            assert result.finish_reason == ("stop" if expected[-1] == EOS else "length")
            assert result.score == pytest.approx(total / len(expected), abs=1e-4)
            stops += result.finish_reason == "stop"
    assert 0 < stops < 8  # both endings were exercised


@pytest.mark.parametrize("length_penalty", [1.0, 2.0, -1.0])
def test_matches_transformers_beam_search(pairs, length_penalty):
    """Same ids and score as HF generate(num_beams=3, early_stopping=False).

    These cases were chosen so that each of: the length used in the penalty (generated tokens
    including eos), the early-stopping heuristic, and "only the top k ranked candidates may
    finish" changes the answer somewhere (checked by mutating beam.py while writing the test)."""
    for hf, ours in pairs:
        for prompt_seed in (200, 201, 202, 203, 207, 209):
            prompt = _prompt(prompt_seed)
            out = hf.generate(
                torch.tensor([prompt]), num_beams=3, do_sample=False, max_new_tokens=8, eos_token_id=EOS,
                pad_token_id=EOS, length_penalty=length_penalty, early_stopping=False,
                return_dict_in_generate=True, output_scores=True,
            )
            result = beam_search(ours, prompt, num_beams=3, max_new_tokens=8, length_penalty=length_penalty)
            assert result.token_ids == out.sequences[0, len(prompt) :].tolist(), (prompt, length_penalty)
            assert result.score == pytest.approx(float(out.sequences_scores[0]), abs=1e-4)


@pytest.fixture(scope="module")
def no_eos(pairs):
    """The seed-2 model with no eos id: every hypothesis has exactly max_new_tokens tokens."""
    hf, ours = pairs[0]
    return hf, LoadedModel("tiny", ours.folder, ours.runner, tokenizer=None, eos_ids=frozenset())


def test_wider_beams_score_at_least_greedy_without_eos(no_eos):
    """Without eos, all hypotheses have the same length, so scores compare sums of log-probs.

    Not a theorem (a wider beam can push greedy's prefix out and end lower); it holds on these
    fixed cases and would flag a scoring or selection bug. The exact guarantee is the next test."""
    _, ours = no_eos
    for p in range(4):
        prompt = _prompt(300 + p)
        greedy = beam_search(ours, prompt, num_beams=1, max_new_tokens=6)
        for k in (2, 3, 5):
            assert beam_search(ours, prompt, num_beams=k, max_new_tokens=6).score >= greedy.score - 1e-6


def test_beam_as_wide_as_the_vocabulary_finds_the_best_two_tokens(no_eos):
    """With num_beams = vocab and two new tokens, beam search is exhaustive: it must find the
    two-token continuation of highest total log-probability (brute force with the HF model)."""
    hf, ours = no_eos
    prompt = _prompt(400)
    first = _hf_logprobs(hf, prompt)  # [vocab]
    with torch.no_grad():
        batch = torch.tensor([prompt + [t] for t in range(VOCAB)])  # [vocab, len + 1]
        second = torch.log_softmax(hf(batch).logits[:, -1].float(), dim=-1)  # [vocab, vocab]
    totals = first[:, None] + second
    best = int(totals.argmax())
    result = beam_search(ours, prompt, num_beams=VOCAB, max_new_tokens=2, length_penalty=1.0)
    assert result.token_ids == list(divmod(best, VOCAB))
    assert result.score == pytest.approx(float(totals.max()) / 2, abs=1e-4)
    assert result.finish_reason == "length"


def test_rejects_bad_parameters(pairs):
    _, ours = pairs[0]
    for beams in (0, -1, 1.5, True):
        with pytest.raises(InvalidParameterError, match="num_beams"):
            beam_search(ours, [5, 6], num_beams=beams, max_new_tokens=4)
    with pytest.raises(InvalidParameterError, match="max_new_tokens"):
        beam_search(ours, [5, 6], num_beams=2, max_new_tokens=0)
    with pytest.raises(PromptError):
        beam_search(ours, [], num_beams=2, max_new_tokens=4)
    with pytest.raises(PromptError):
        beam_search(ours, [VOCAB], num_beams=2, max_new_tokens=4)
