"""The runner seam (`models/runner.py`): every backend reports a typed `RunnerConfig` and declares its
capabilities, `Cache.clone` gives an independent copy on every backend, and a token-tree drafter is
refused when an engine takes it for a runner that scores chains only.

The own runner and the Hugging Face runner run on tiny random models; the llama.cpp runner on the
shipped SmolLM2-135M GGUF (marked `real`).
"""

from __future__ import annotations

import pytest
import torch

from test_hf_runner import make_hf_model
from verispec import Engine, GenerationConfig
from verispec.drafters import MergeDrafter, NgramDrafter, StandDrafter
from verispec.drafters.tree import ExpansionDrafter
from verispec.errors import InvalidParameterError, VerispecError
from verispec.models.hf_runner import HFRunner
from verispec.models.loading import load_model, load_tokenizer
from verispec.models.runner import LoadedModel, RunnerConfig


@pytest.fixture(scope="module")
def phi3_folder(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("seam") / "phi3", "phi3", seed=1, layers=2)


@pytest.fixture(scope="module")
def chains_only(phi3_folder) -> LoadedModel:
    """A Phi-3 whose forward drops the custom 4-D mask: its runner finds at load that it scores chains only."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(phi3_folder, dtype=torch.float32)
    forward = model.forward
    model.forward = lambda *args, attention_mask=None, **kwargs: forward(*args, **kwargs)  # noqa: E731
    return LoadedModel("phi3-chains", phi3_folder, HFRunner(model), load_tokenizer(phi3_folder), frozenset({0}))


# --- typed config and declared capabilities ------------------------------------------------------------


def test_every_runner_reports_a_typed_config_and_its_capabilities(tiny_target, phi3_folder):
    import json

    hf_config = json.loads((tiny_target / "config.json").read_text())
    own, hf = load_model(tiny_target), load_model(tiny_target, "hf")
    for model in (own, hf):
        config = model.runner.config
        assert isinstance(config, RunnerConfig) and config.model_type == "qwen2"
        assert (config.vocab_size, config.num_layers, config.num_heads, config.num_kv_heads) == (
            hf_config["vocab_size"], hf_config["num_hidden_layers"], hf_config["num_attention_heads"],
            hf_config["num_key_value_heads"])
        assert config.head_dim == hf_config["hidden_size"] // hf_config["num_attention_heads"]
        assert model.runner.supports_trees and not model.runner.compiled and model.runner.weight_bytes > 0
    assert (own.precision, hf.precision, hf.runner.variant) == ("float32", "hf", ",hf")
    assert own.runner.linear_bytes < own.runner.weight_bytes
    assert hf.runner.linear_bytes is None and hf.runner.cache_bytes_per_position is None
    cfg = own.runner.config
    assert own.runner.cache_bytes_per_position == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    phi3 = load_model(phi3_folder).runner.config
    assert (phi3.model_type, phi3.num_heads, phi3.num_kv_heads, phi3.head_dim) == ("phi3", 4, 2, 8)


# --- Cache.clone ----------------------------------------------------------------------------------------


def _clone_is_independent(runner, atol: float = 0.0) -> None:
    """A clone continues as the original would (as a fresh cache fed the same way does: equal bits on a
    cache of its own), and feeding either leaves the other as it was."""
    prefix, a, b = torch.tensor([5, 9, 2, 7, 11, 3]), torch.tensor([8, 1]), torch.tensor([4, 6, 12])
    cache = runner.new_cache(32)
    runner.forward(cache, prefix, logits="none")
    twin = cache.clone()
    assert twin is not cache and twin.length == cache.length == len(prefix)
    got_b = runner.forward(twin, b)  # [3, vocab]
    got_a = runner.forward(cache, a)  # [2, vocab]
    for fed, got in ((a, got_a), (b, got_b)):
        fresh = runner.new_cache(32)
        runner.forward(fresh, prefix, logits="none")
        torch.testing.assert_close(got, runner.forward(fresh, fed), rtol=0, atol=atol)  # [n, vocab]
        fresh.release()
    assert cache.length == len(prefix) + len(a) and twin.length == len(prefix) + len(b)
    cache.release(), twin.release()


def test_clone_on_the_own_runner(target):
    _clone_is_independent(target.runner)


def test_clone_on_the_hf_runner(phi3_folder):
    _clone_is_independent(load_model(phi3_folder).runner)


# --- token trees on a runner that scores chains only ------------------------------------------------------


def test_a_chains_only_runner_says_so_at_load(chains_only):
    assert not chains_only.runner.supports_trees


@pytest.mark.parametrize("make", [
    lambda model: StandDrafter(model.vocab_size),
    lambda model: MergeDrafter.model_and_ngram(model, model.vocab_size),
])
def test_a_tree_drafter_is_refused_when_the_engine_is_built(chains_only, make):
    with pytest.raises(InvalidParameterError, match="token trees.*chains only"):
        Engine(chains_only, make(chains_only))


def test_a_tree_expansion_needs_a_draft_model_that_scores_trees(chains_only):
    with pytest.raises(InvalidParameterError, match="chains only"):
        ExpansionDrafter(chains_only, chains_only.vocab_size, k=2, depth=2)


def test_a_requested_tree_drafter_is_refused_before_the_request_runs(chains_only):
    engine = Engine(chains_only, NgramDrafter(), gamma=2, gamma_policy="constant")  # a chain drafter is fine
    assert len(engine.generate([5, 9, 2, 7], GenerationConfig(max_new_tokens=4)).token_ids) == 4
    with pytest.raises(InvalidParameterError, match="chains only") as refused:
        engine.start([5, 9, 2, 7], GenerationConfig(max_new_tokens=4, drafter="stand"))
    assert refused.value.param == "drafter"
    # a chain-shaped STAND (one child per node) drafts chains: accepted
    assert engine.generate([5, 9, 2, 7], GenerationConfig(max_new_tokens=4, drafter="stand:k=1")).token_ids


# --- llama.cpp ------------------------------------------------------------------------------------------


@pytest.mark.real
def test_llama_cpp_measures_exact_widths_only_when_asked_and_clones_caches():
    from verispec.models.llama_cpp import LlamaCppRunner
    from verispec.models.registry import gguf_file

    runner = LlamaCppRunner(gguf_file("smollm2-135m-instruct"))
    with pytest.raises(VerispecError, match="not measured"):
        runner.exact_positions  # noqa: B018 - reading it never measures
    short, _ = runner.measure_exact_widths(long=False)  # what loading measures: the long one is left for decoding
    with pytest.raises(VerispecError, match="prepare_decoding"):
        runner.exact_positions_long  # noqa: B018
    runner.prepare_decoding()
    short, long = runner.measure_exact_widths()
    assert runner.exact_positions == short >= 1 and runner.exact_positions_long == long >= 1
    config = runner.config
    assert config.model_type == "llama" and config.num_kv_heads <= config.num_heads and config.head_dim == 64
    assert runner.precision == "gguf" and runner.supports_trees and runner.weight_bytes == runner.path.stat().st_size
    _clone_is_independent(runner)
    wide = LlamaCppRunner(gguf_file("smollm2-135m-instruct"), exact=False)
    assert wide.exact_positions is None and wide.precision == "gguf-wide"
    _clone_is_independent(wide, atol=1e-3)  # one shared context (the clone a sequence copy): other cells round apart


def test_a_llama_cpp_build_with_amx_kernels_loads_without_extra_buffers():
    """ggml's AMX kernels crash on some AMX Xeons (llama.cpp#20824): a build that has them loads weights
    without extra buffer types; any other build keeps llama.cpp's defaults. Fails without the check."""
    from types import SimpleNamespace

    from verispec.models.llama_cpp import model_params

    def build(info: bytes):
        return SimpleNamespace(llama_model_default_params=lambda: SimpleNamespace(use_extra_bufts=True),
                               llama_print_system_info=lambda: info)

    assert not model_params(build(b"CPU : AVX512_VNNI = 1 | AMX_INT8 = 1 | REPACK = 1 | ")).use_extra_bufts
    assert model_params(build(b"CPU : AVX2 = 1 | AVX512_VNNI = 1 | REPACK = 1 | ")).use_extra_bufts


def test_the_bench_warns_before_loading_a_llama_cpp_build_with_amx_kernels(monkeypatch, tmp_path):
    """llama-cpp-python's `Llama` (the bench's llama.cpp baseline) takes no parameter that avoids the AMX kernels:
    the bench says so before it loads, so a crash that follows is explained. Fails without the warning."""
    from types import SimpleNamespace

    from verispec.tools.bench import compare

    def refuse(**_):
        raise RuntimeError("not loaded in this test")

    amx = SimpleNamespace(llama_print_system_info=lambda: b"CPU : AMX_INT8 = 1 | ", Llama=refuse)
    monkeypatch.setattr(compare, "require_llama_cpp", lambda: amx)
    with pytest.warns(UserWarning, match="llama-cpp: ggml's AMX kernels crash"), pytest.raises(RuntimeError, match="not loaded"):
        compare.LlamaCppMethod.load("llama-cpp", tmp_path / "model.gguf", frozenset(), 0.0)
