"""The `device` setting: CPU through the same code paths as a GPU, the refusals, and a CUDA group.

On a machine with a GPU the CUDA group runs with the rest; to run just these there:
    PYTHONPATH=src python -m pytest -p no:cacheprovider -q tests/test_device.py
"""

from __future__ import annotations

import os

import pytest
import torch

from verispec import GenerationConfig, SamplingParams, load
from verispec.engine.spec import EngineSpec
from verispec.errors import InvalidParameterError
from verispec.models.device import check_device, resolve_device
from verispec.models.loading import ModelCache, load_model

PROMPTS = [[3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
GREEDY = GenerationConfig(max_new_tokens=12)
SAMPLED = GenerationConfig(max_new_tokens=12, sampling=SamplingParams(temperature=0.9, top_p=0.95), seed=7)
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusals of a machine without a GPU")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _tokens(engine, config: GenerationConfig) -> list[list[int]]:
    return [engine.generate(prompt, config).token_ids for prompt in PROMPTS]


# --- the setting itself --------------------------------------------------------------------------


def test_resolve_device_names():
    assert resolve_device("cpu") == resolve_device(None) == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(InvalidParameterError, match="device must be one of"):
        resolve_device("tpu")


def test_a_gpu_asks_cublas_for_its_reproducible_setting(monkeypatch):
    """Captures of CUDA graphs run cuBLAS from several streams, where only a fixed workspace gives the same bits
    run after run; a user's own setting is kept, and the CPU changes nothing."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert resolve_device("cpu").type == "cpu" and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    assert resolve_device("cuda").type == "cuda" and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    assert resolve_device("auto").type == "cuda" and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


@no_cuda
def test_cuda_without_a_gpu_is_refused(tiny_target):
    with pytest.raises(InvalidParameterError, match="no CUDA GPU"):
        resolve_device("cuda")
    with pytest.raises(InvalidParameterError, match="no CUDA GPU"):
        load(str(tiny_target), "none", device="cuda")


@pytest.mark.parametrize("precision", ["int8", "gguf", "gguf-wide"])
def test_cpu_only_precisions_are_refused_off_the_cpu(precision):
    check_device(precision, torch.device("cpu"))  # fine
    with pytest.raises(InvalidParameterError, match=f"dtype {precision} cannot run on cuda"):
        check_device(precision, torch.device("cuda"))


def test_engine_spec_carries_the_device():
    import argparse

    parser = argparse.ArgumentParser()
    EngineSpec.add_arguments(parser)
    spec = EngineSpec.from_args(parser.parse_args(["--device", "auto"]))
    assert spec.device == "auto" and EngineSpec().device == "cpu"
    assert spec.describe().endswith("on auto") and EngineSpec().describe().endswith("(default policy)")


# --- device="cpu" through the same code paths ----------------------------------------------------


@pytest.mark.parametrize("draft", ["none", "ngram", "model"])
def test_explicit_cpu_gives_todays_tokens(tiny_target, tiny_draft, draft):
    draft = str(tiny_draft) if draft == "model" else draft
    default = load(str(tiny_target), draft, gamma_policy="constant")
    on_cpu = load(str(tiny_target), draft, gamma_policy="constant", device="cpu")
    assert on_cpu.target.device == torch.device("cpu") and on_cpu.target.runner.embed.device.type == "cpu"
    assert _tokens(on_cpu, GREEDY) == _tokens(default, GREEDY)
    assert _tokens(on_cpu, SAMPLED) == _tokens(default, SAMPLED)


def test_cpu_hf_runner_and_float16(tiny_target):
    hf = load_model(tiny_target, "hf", device="cpu")
    assert hf.device.type == "cpu" and hf.runner.model.device.type == "cpu"
    half = ModelCache(device="cpu")(tiny_target, "float16")
    assert half.precision == "float16" and half.runner.new_cache(4).keys.dtype == torch.float16
    logits = half.runner.forward(half.runner.new_cache(8), torch.tensor([3, 4, 5]))
    assert logits.shape == (3, half.vocab_size) and bool(torch.isfinite(logits).all())


# --- on a GPU (skipped without one) --------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "hf"])
@pytest.mark.parametrize("draft", ["ngram", "model"])
def test_cuda_greedy_speculative_equals_plain(tiny_target, tiny_draft, dtype, draft):
    draft = str(tiny_draft) if draft == "model" else draft
    plain = load(str(tiny_target), "none", dtype, device="cuda")
    speculative = load(str(tiny_target), draft, dtype, gamma_policy="constant", device="cuda")
    assert speculative.target.device.type == "cuda"
    assert _tokens(speculative, GREEDY) == _tokens(plain, GREEDY)


@needs_cuda
@pytest.mark.parametrize("draft", ["none", "ngram", "model"])
def test_cuda_seeded_sampling_is_reproducible(tiny_target, tiny_draft, draft):
    draft = str(tiny_draft) if draft == "model" else draft
    engine = load(str(tiny_target), draft, gamma_policy="constant", device="cuda")
    first, second = _tokens(engine, SAMPLED), _tokens(engine, SAMPLED)
    assert first == second and all(len(ids) == SAMPLED.max_new_tokens or ids[-1] == 0 for ids in first)
