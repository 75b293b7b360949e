"""A draft model that reads only the end of a long prompt (`hybrid:…,window=W`, `base.window_cut`).

The draft's cache holds the prompt's first SINK tokens and its last W, nothing between, and follows the
committed sequence after that; greedy output stays the reference's (what a draft reads never changes
the output), with a draft of the target's tokenizer and one of another; the windowed draft still
proposes. Sampling: the window changes only the draft's context, and the draft reports the q it drew
from whatever it read, so the rejection rule stays exact (the hybrid's chi-square test in
test_cross_vocab.py covers sampled drafts through the text; here one with a window, same bounds).
"""

import pytest
from distribution import assert_same_distribution, sample_sequences
from test_cross_vocab import pair  # noqa: F401 (the fixture: a tiny target and a draft of another tokenizer)

from verispec import Engine, GenerationConfig, SamplingParams
from verispec.drafters import make_drafter
from verispec.drafters.base import SINK, window_cut
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.hybrid import HybridDrafter
from verispec.testing.reference import reference_generate, sequence_distribution

LONG = [5, 9, 2, 7, 11, 3, 8, 1, 30, 12, 5, 11, 3, 3, 20, 21, 22, 23, 24, 25, 26, 27, 40, 41]  # 24 tokens


def test_the_cut_keeps_the_sinks_and_the_last_window():
    assert window_cut(24, 8) == (SINK, 16)
    assert window_cut(24, None) is None and window_cut(24, 0) is None
    assert window_cut(SINK + 8, 8) is None  # nothing between the sinks and the window: read it all


def test_a_windowed_draft_reads_the_prompts_start_and_end(target, draft, hf_target):
    session = DraftModelDrafter(draft, target.vocab_size, window=8).start(LONG)
    assert session.cached == LONG[:SINK] + LONG[16:-1]  # the last prompt token comes with the first step
    assert session.cache.length == SINK + 7
    engine = Engine(target, DraftModelDrafter(draft, target.vocab_size, window=8), gamma=3, gamma_policy="constant")
    result = engine.generate(LONG, GenerationConfig(max_new_tokens=20))
    assert result.token_ids == reference_generate(hf_target, LONG, 20, eos_ids=target.eos_ids)
    assert result.stats.proposed_tokens > 0


@pytest.mark.parametrize("window", [1, 6, 100])
def test_hybrid_with_a_window_is_the_reference(target, draft, hf_target, window):
    drafter = HybridDrafter(DraftModelDrafter(draft, target.vocab_size), window=window)
    assert drafter.model_drafter.window == window and drafter.name.endswith(f",window={window}")
    engine = Engine(target, drafter, gamma=2, gamma_policy="constant")
    for prompt in (LONG, LONG[:6], [40]):
        expected = reference_generate(hf_target, prompt, 16, eos_ids=target.eos_ids)
        assert engine.generate(prompt, GenerationConfig(max_new_tokens=16)).token_ids == expected


def test_hybrid_through_the_text_with_a_window(pair):  # noqa: F811
    target, _, hf, _, draft_dir = pair
    drafter = make_drafter(f"hybrid:draft={draft_dir},window=3,min_match=3", target)
    assert drafter.model_drafter.window == 3
    prompt = [11, 3, 3, 3, 8, 1, 4, 10, 5, 9, 2, 7, 6]
    engine = Engine(target, drafter, gamma=3, gamma_policy="constant")
    result = engine.generate(prompt, GenerationConfig(max_new_tokens=16))
    assert result.token_ids == reference_generate(hf, prompt, 16, eos_ids=target.eos_ids)
    assert result.stats.proposed_tokens > 0
    params = SamplingParams(temperature=1.0, top_k=3)
    short = prompt[:9]  # 9 tokens: the draft reads the first SINK and the last 3
    samples = sample_sequences(Engine(target, drafter, gamma=2, gamma_policy="constant"), short, params, 1_200, 3)
    assert assert_same_distribution(samples, sequence_distribution(hf, short, 3, params)).detectable_tv < 0.12
