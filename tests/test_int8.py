"""The int8 precision (`dtype="int8"`) on tiny random models.

The promise on this path is about the SAME quantized model: greedy speculative decoding is
token-identical to greedy plain decoding of the int8 target, and sampling is lossless with respect
to the int8 target's own distribution. The oracle is the int8 runner recomputing the whole sequence
in one forward (no cache), which also checks that a row's logits do not depend on how many rows the
forward pass holds. Sampling: chi-square tests (tests/stats.py) against the exact distribution
enumerated from the oracle, for a draft model and for n-gram drafts: N = 1 000 sequences of 3 tokens
after γ = 2 draft tokens (so a fully accepted block's bonus token is in the tested event), 12-token
vocabulary with top-k 4 (64 sequences), significance 1e-3: any bias of total variation ≥ 0.15 is
rejected with ≥ 90 % power (each test prints its figure). (The verification rule itself is tested
with more power on float32 in test_verify.py and test_engine.py; this path changes only the
logits.) Positive control: the same test on a third of the samples rejects a verifier that draws
the bonus token from the wrong target row.
"""

import os
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_model
from distribution import assert_rejected, assert_same_distribution, bonus_from_the_wrong_row, sample_sequences

from verispec import Engine, GenerationConfig, SamplingParams
from verispec.tools.bench.memory import runner_linear_bytes, runner_weights_mib
from verispec.cli import main as cli_main
from verispec.drafters import DraftModelDrafter, ExpansionDrafter, NgramDrafter, StandDrafter, make_drafter
from verispec.errors import InvalidParameterError
from verispec.models.int8 import Int8Linear
from verispec.models.loading import load_model, parse_precision
from verispec.models.transformer import Transformer
from verispec.testing.reference import WholeSequenceOracle, reference_generate, sequence_distribution

PROMPTS = [[5, 9, 2, 7], [11, 3, 3, 3, 8, 1, 30, 12, 5], [40]]


@pytest.fixture(scope="module")
def target8(tiny_target):
    return load_model(tiny_target, "int8")


@pytest.fixture(scope="module")
def draft8(tiny_draft):
    return load_model(tiny_draft, "int8")


def test_int8_values_are_cached_once_and_requantized_when_the_weights_change(tmp_path, monkeypatch):
    from verispec.models import layer_cache

    folder = make_tiny_model(tmp_path / "m", vocab_size=12, seed=31, layers=2)
    root = tmp_path / "int8"
    store = layer_cache.Int8Store(folder, root)
    assert not store.cached
    fresh = Transformer(*_config_and_weights(folder), torch.float32, quant="int8", store=store)
    store.save()
    assert len(list(root.glob("*.safetensors"))) == 1

    def no_quantizing(weight):
        raise AssertionError("a cached load must not quantize")

    monkeypatch.setattr(layer_cache, "quantize_per_channel", no_quantizing)
    again = layer_cache.Int8Store(folder, root)
    assert again.cached
    cached = Transformer(*_config_and_weights(folder), torch.float32, quant="int8", store=again)
    ids = torch.tensor([3, 7, 1, 9, 4])
    logits = [runner.forward(runner.new_cache(8), ids, logits="all") for runner in (fresh, cached)]
    assert torch.equal(logits[0], logits[1])

    weights = next(folder.glob("*.safetensors"))
    os.utime(weights, ns=(0, weights.stat().st_mtime_ns + 10**9))  # "rewritten": the fingerprint no longer matches
    assert not layer_cache.Int8Store(folder, root).cached


def _config_and_weights(folder):
    import json

    from safetensors.torch import load_file

    from verispec.models.transformer import ModelConfig

    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    return config, load_file(next(folder.glob("*.safetensors")))


def test_int8_linear_rows_do_not_depend_on_each_other():
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64) * 0.1, torch.randn(96)
    x = torch.randn(7, 64)  # [rows, in]
    for layer in (Int8Linear.from_float(weight, bias), Int8Linear.from_float(weight, bias, use_fbgemm=False)):
        together = layer(x)  # [7, 96]
        alone = torch.cat([layer(x[i : i + 1]) for i in range(7)])
        assert torch.equal(together, alone)
        reference = x @ weight.T + bias
        assert float((together - reference).norm() / reference.norm()) < 0.03  # 7-bit activations, 8-bit weights
    fast, slow = Int8Linear.from_float(weight, bias), Int8Linear.from_float(weight, bias, use_fbgemm=False)
    torch.testing.assert_close(fast(x), slow(x), atol=1e-5, rtol=1e-5)  # same integers, float rounding apart


@pytest.mark.parametrize("residual", [True, False])
def test_fused_kernels_give_the_same_bits_as_the_torch_code(monkeypatch, residual):
    """`Int8Linear` runs its elementwise work in a compiled extension when one can be built; the
    model must not change with that, so both paths are compared bit for bit."""
    from verispec.models import int8
    from verispec.models.kernels import extension

    assert extension("int8") is not None, "the C++ extension did not build (see the warning)"
    torch.manual_seed(1)
    for rows, width in [(1, 64), (3, 1536), (33, 256), (2, 8960)]:
        layer = Int8Linear.from_float(torch.randn(48, width) * 0.05, torch.randn(48), residual=residual)
        x = torch.randn(rows, width) * 10.0 ** float(torch.randn(()))  # [rows, in]
        x[0, 5] *= 300.0  # an outlier channel, as in real activations
        if rows > 1:
            x[-1] = 0.0  # an all-zero row: absmax is clamped
        fused = layer(x)
        with monkeypatch.context() as patch:
            patch.setattr(int8, "extension", lambda name: None)
            plain = layer(x)
        assert torch.equal(fused, plain), (rows, width)


def test_a_kernel_that_cannot_be_built_means_the_torch_code_with_a_warning(monkeypatch):
    from verispec.models import kernels

    with pytest.warns(UserWarning, match="could not build verispec's no_such kernels"):
        assert kernels.extension.__wrapped__("no_such") is None  # no no_such.cpp
    monkeypatch.setenv("VERISPEC_KERNELS", "0")
    assert kernels.extension.__wrapped__("int8") is None


@pytest.mark.parametrize("name", ["int8", "kquant"])
def test_the_kernels_loops_use_torchs_threads(name):
    """`at::parallel_for` is a header: built without OpenMP an extension's loops run on one thread
    (the kquant kernels did, at half speed, until this was checked)."""
    from verispec.models.kernels import extension

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert extension(name).parallel_threads(8) == 2
        torch.set_num_threads(1)
        assert extension(name).parallel_threads(8) == 1
    finally:
        torch.set_num_threads(threads)


def test_a_finished_build_is_shared_by_every_torch_installation_of_its_release(monkeypatch):
    """The user's cache holds a build (the conftest loads it first): a process imports it without
    compiling, and a virtual environment elsewhere with the same torch release finds the same folder."""
    from verispec.models import kernels

    monkeypatch.delenv("VERISPEC_CACHE", raising=False)  # the user's cache, where the conftest built it
    source = Path(kernels.__file__).with_name("int8.cpp")
    folder = kernels._build_folder("int8", source)
    assert (folder / kernels.READY).exists()
    monkeypatch.setattr(kernels, "_compile", lambda *args: pytest.fail("compiled again"))
    assert kernels.extension.__wrapped__("int8").split_rows is not None
    monkeypatch.setattr(torch, "__file__", "/another/venv/lib/python3.11/site-packages/torch/__init__.py")
    assert kernels._build_folder("int8", source) == folder


def test_the_compiled_decoder_stack_gives_the_same_bits_as_the_python_loop(target8, monkeypatch):
    """An int8 runner decodes and verifies chains through `Int8Layers` (C++, one call per forward), server batches
    of such chains too; prefill and token trees run the Python loop. Both must be the same model."""
    import copy

    from verispec.models.transformer import Transformer

    runner = target8.runner
    assert runner._compiled_layers() is not None

    def decode(feeds: list[list[int]]) -> list[torch.Tensor]:
        cache, other = runner.new_cache(), runner.new_cache()
        runner.forward(cache, torch.tensor(PROMPTS[1]), logits="none")
        runner.forward(other, torch.tensor(PROMPTS[0]), logits="none")
        out = [runner.forward(cache, torch.tensor(feed)) for feed in feeds]
        out += runner.forward_ragged([other, cache], [torch.tensor([8, 2, 5]), torch.tensor([9])])  # a server batch
        return out + [cache.keys[:, :, : cache.length], other.values[:, :, : other.length]]

    feeds = [[5], [7, 9, 11, 13], [17], list(range(1, 9))]  # decode steps and verification passes
    compiled = decode(feeds)
    with monkeypatch.context() as patch:
        patch.setattr(Transformer, "_compiled_layers", lambda self: None)
        python = decode(feeds)
    assert all(torch.equal(a, b) for a, b in zip(compiled, python, strict=True))
    fewer = copy.copy(runner)  # as `self:layers=L` derives a draft: its own stack, of its own layers
    fewer.layers = runner.layers[:1]
    assert fewer._compiled_layers() is not runner._compiled_layers() is not None


def test_verification_costs_are_measured_apart_for_the_compiled_stack(target8, monkeypatch):
    """The γ policy's cached T(n) curve of an int8 target depends on whether the C++ stack runs: a curve
    measured with the Python loop must not stand in for the compiled one, nor the reverse."""
    import json

    from verispec.control.costs import CostModel
    from verispec.paths import cache_dir

    assert target8.runner.compiled
    CostModel.calibrated(target8, 2)
    with monkeypatch.context() as patch:
        patch.setattr(Transformer, "_compiled_layers", lambda self: None)
        CostModel.calibrated(target8, 2)
    table = json.loads((cache_dir() / "verify_costs.json").read_text())  # shared with other tests' models
    keys = [key for key in table if key.startswith(f"{target8.folder}{target8.runner.variant}")]
    assert sorted(",compiled|" in key for key in keys) == [False, True], keys


def test_verification_costs_are_measured_anew_for_a_changed_kernel_build(target8, monkeypatch):
    """A cached T(n) curve belongs to the build of the kernels it timed: the same build reads it back, another build
    (a changed kernel) measures its own (kquant's runner names its build in its variant; int8's key adds it)."""
    from verispec.control import costs
    from verispec.paths import read_table

    def curves() -> set[str]:
        return {key for key in read_table("verify_costs.json") if key.startswith(f"{target8.folder}{target8.runner.variant}")}

    costs.CostModel.calibrated(target8, 2)
    before = curves()
    costs.CostModel.calibrated(target8, 2)
    assert curves() == before and all(f"|kernels={costs.build_key('int8')}|" in key for key in before)
    monkeypatch.setattr(costs, "build_key", lambda name: "another-build")
    costs.CostModel.calibrated(target8, 2)
    assert any("|kernels=another-build|" in key for key in curves() - before)


def test_forward_rows_equal_single_position_decoding(target8):
    runner = target8.runner
    prompt, feed = torch.tensor(PROMPTS[1]), torch.tensor([4, 17, 23, 9, 31])
    cache = runner.new_cache()
    runner.forward(cache, prompt, logits="none")
    together = runner.forward(cache, feed, logits="all")  # [5, vocab]: a verification pass
    cache.truncate(len(PROMPTS[1]))
    alone = torch.cat([runner.forward(cache, feed[i : i + 1], logits="all") for i in range(len(feed))])
    assert torch.equal(together, alone)
    whole = WholeSequenceOracle(runner)(torch.cat([prompt, feed])[None]).logits[0, len(PROMPTS[1]) :]
    assert torch.equal(together, whole)
    # a server batch: other requests' rows in the same pass change nothing either
    other = runner.new_cache()
    cache.truncate(len(PROMPTS[1]))
    batched = runner.forward_ragged([cache, other], [feed, torch.tensor(PROMPTS[0])])
    assert torch.equal(batched[0], together)


@pytest.mark.parametrize("context", [30, 80, 100])
def test_tree_nodes_equal_single_position_decoding_of_their_paths(target8, context):
    """A token tree in one pass: every node's logits are bit for bit those of decoding its path one
    token at a time, so greedy tree verification on the int8 path is exact, not exact up to rounding.
    (One batched masked SDPA call rounds differently from single-token steps at these context lengths.)"""
    runner = target8.runner
    prompt, feed = (torch.arange(context) * 7) % 47 + 1, torch.tensor([4, 17, 23, 9, 31, 5])
    parents = [-1, 0, 0, 1, 2, 2]  # two branches under the root; the second forks again
    paths: list[list[int]] = []  # node -> the nodes from the root to it
    for node, parent in enumerate(parents):
        paths.append((paths[parent] if parent >= 0 else []) + [node])
    mask = torch.zeros(len(feed), len(feed), dtype=torch.bool)  # [n, n]: ancestors and self
    for node, path in enumerate(paths):
        mask[node, path] = True
    cache = runner.new_cache()
    runner.forward(cache, prompt, logits="none")
    depths = torch.tensor([len(path) - 1 for path in paths])
    together = runner.forward(cache, feed, positions=context + depths, tree_mask=mask)  # [6, vocab]
    for node, path in enumerate(paths):
        cache.truncate(context)
        alone = [runner.forward(cache, feed[i : i + 1]) for i in path][-1]  # [1, vocab]
        assert torch.equal(together[node], alone[0]), f"node {node} (path {path})"


def test_int8_model_is_close_to_float32_and_four_times_smaller(target, target8):
    ids = torch.tensor(PROMPTS[1])
    fp32 = target.runner.forward(target.runner.new_cache(), ids)
    int8 = target8.runner.forward(target8.runner.new_cache(), ids)
    assert not torch.equal(fp32, int8)
    kl = torch.nn.functional.kl_div(int8.log_softmax(-1), fp32.log_softmax(-1), log_target=True, reduction="batchmean")
    assert float(kl) < 0.05
    assert target8.precision == "int8" and target.precision == "float32"
    assert runner_linear_bytes(target8.runner) < 0.4 * runner_linear_bytes(target.runner)
    assert runner_weights_mib(target8.runner) < runner_weights_mib(target.runner)


def _drafters(target8, draft8):
    return {
        "model": DraftModelDrafter(draft8, target8.vocab_size),
        "self": DraftModelDrafter(target8, target8.vocab_size),  # always accepted: bonus and lagging-draft paths
        "ngram": NgramDrafter(max_n=3),
        "tree": ExpansionDrafter(draft8, target8.vocab_size),  # token trees from the draft model
        "stand": StandDrafter(target8.vocab_size),  # token trees from the target's own distributions
    }


@pytest.mark.parametrize("gamma", [1, 3, 8])
@pytest.mark.parametrize("kind", ["model", "self", "ngram", "tree", "stand"])
def test_greedy_speculative_equals_greedy_plain_int8(target8, draft8, kind, gamma):
    engine = Engine(target8, _drafters(target8, draft8)[kind], gamma=gamma, gamma_policy="constant")
    plain = Engine(target8, None)
    oracle = WholeSequenceOracle(target8.runner)
    for prompt in PROMPTS:
        expected = plain.generate(prompt, GenerationConfig(max_new_tokens=20)).token_ids
        assert expected == reference_generate(oracle, prompt, 20, eos_ids=target8.eos_ids)
        assert engine.generate(prompt, GenerationConfig(max_new_tokens=20)).token_ids == expected


@pytest.mark.parametrize("kind", ["self", "tree"])
def test_an_int8_step_never_verifies_more_positions_than_it_scores_exactly(target8, draft8, kind, monkeypatch):
    """Past ROW_INVARIANT_POSITIONS a forward attends in one batched call, whose rounding depends on
    the number of queries, so on an int8 target the engine drafts at most that many − 1 tokens a step:
    γ 40 is capped (an always-accepted chain) and a 126-node tree keeps its first 31 nodes."""
    from verispec.models.transformer import ROW_INVARIANT_POSITIONS

    drafter = (DraftModelDrafter(target8, target8.vocab_size) if kind == "self"
               else ExpansionDrafter(draft8, target8.vocab_size, k=2, depth=6, wide=6))
    config = GenerationConfig(max_new_tokens=70)
    expected = Engine(target8, None).generate(PROMPTS[1], config).token_ids
    sizes, forward = [], target8.runner.forward
    monkeypatch.setattr(target8.runner, "forward", lambda cache, tokens, *args, **kwargs: sizes.append(len(tokens))
                        or forward(cache, tokens, *args, **kwargs))
    result = Engine(target8, drafter, gamma=40, gamma_policy="constant").generate(PROMPTS[1], config)
    assert max(sizes) == ROW_INVARIANT_POSITIONS, sizes
    assert result.token_ids == expected


def test_factory_loads_the_draft_in_the_targets_precision(target8, tiny_draft):
    drafter = make_drafter(str(tiny_draft), target8)
    assert drafter.model.precision == "int8"
    derived = make_drafter("self:layers=1,int8=1", target8)  # already int8: kept, not re-quantized
    assert derived.model.runner.quant == "int8" and len(derived.model.runner.layers) == 1
    engine = Engine(target8, drafter, gamma=3, gamma_policy="constant")
    plain = Engine(target8, None)
    config = GenerationConfig(max_new_tokens=16)
    assert engine.generate(PROMPTS[0], config).token_ids == plain.generate(PROMPTS[0], config).token_ids


# --- sampling: equal in distribution to the int8 target ------------------------------------------


@pytest.fixture(scope="module")
def small_pair8(tmp_path_factory):
    folder = tmp_path_factory.mktemp("small8")
    target = load_model(make_tiny_model(folder / "t", vocab_size=12, seed=21, layers=2), "int8")
    draft = load_model(make_tiny_model(folder / "d", vocab_size=12, seed=22, layers=1), "int8")
    target.eos_ids = frozenset()  # fixed-length sequences, so the exact distribution is a simple product
    return target, draft


PROMPT, LENGTH, GAMMA, SAMPLES = [3, 7], 3, 2, 1_000


@pytest.mark.parametrize("drafter, params", [
    ("model", SamplingParams(temperature=0.8, top_k=4)),
    ("ngram", SamplingParams(temperature=1.0, top_k=4)),
], ids=["model", "ngram"])
def test_sampled_int8_output_is_distributed_as_the_int8_target(small_pair8, drafter, params):
    target, draft = small_pair8
    chosen = DraftModelDrafter(draft, target.vocab_size) if drafter == "model" else NgramDrafter(max_n=1)
    engine = Engine(target, chosen, gamma=GAMMA, gamma_policy="constant")
    exact = sequence_distribution(WholeSequenceOracle(target.runner), PROMPT, LENGTH, params)
    assert len(exact) == 64
    result = assert_same_distribution(sample_sequences(engine, PROMPT, params, SAMPLES, LENGTH), exact)
    assert result.detectable_tv < 0.16  # the power the module doc promises


def test_the_int8_test_catches_a_wrong_bonus(small_pair8, monkeypatch):
    import verispec.engine.shapes as engine_module

    monkeypatch.setattr(engine_module, "verify_sampled", bonus_from_the_wrong_row)
    target, draft = small_pair8
    params = SamplingParams(temperature=0.8, top_k=4)
    engine = Engine(target, DraftModelDrafter(draft, target.vocab_size), gamma=GAMMA, gamma_policy="constant")
    exact = sequence_distribution(WholeSequenceOracle(target.runner), PROMPT, LENGTH, params)
    assert_rejected(sample_sequences(engine, PROMPT, params, SAMPLES // 3, LENGTH), exact)


# --- bad input -----------------------------------------------------------------------------------


def test_unsupported_precisions_are_clear_errors(tiny_target, capsys):
    assert parse_precision("INT8").quant == "int8" and parse_precision(torch.bfloat16).name == "bfloat16"
    with pytest.raises(InvalidParameterError, match="float32, bfloat16, int8"):
        parse_precision("int4")
    with pytest.raises(InvalidParameterError, match="int4"):
        load_model(tiny_target, "int4")
    with pytest.raises(ValueError, match="float32 activations"):
        Transformer.from_folder(tiny_target, torch.bfloat16, quant="int8")
    bf16 = load_model(tiny_target, "bfloat16")
    with pytest.raises(InvalidParameterError, match="float32"):
        make_drafter("self:int8=1", bf16)
    with pytest.raises(SystemExit):
        cli_main(["generate", "t3", "--raw", "--target", str(tiny_target), "--dtype", "int4"])
    assert "int8" in capsys.readouterr().err  # argparse lists the choices


def test_every_command_offers_int8():
    from verispec.cli import build_parser

    parser = build_parser()
    for argv in (["generate", "x"], ["serve"], ["design"], ["analyze"], ["quality"]):
        assert parser.parse_args([*argv, "--dtype", "int8"]).dtype == "int8"


def test_cli_generates_with_int8(capsys, tiny_target, tiny_draft):
    import json

    common = ["generate", "t11 t3 t3 t8", "--raw", "--json", "--target", str(tiny_target), "--dtype", "int8",
              "--max-new-tokens", "10", "--gamma-policy", "constant"]
    assert cli_main([*common, "--draft", str(tiny_draft)]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert cli_main([*common, "--draft", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == plain["token_ids"]


def test_quality_report_compares_int8_with_float32(tiny_text_pair, tmp_path, capsys):
    import json

    questions = tmp_path / "q.jsonl"
    rows = [{"question_id": 1, "category": "rag", "turns": ["t3 t4 t5"]}, {"question_id": 2, "category": "qa", "turns": ["t9 t8"]}]
    questions.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "quality.json"
    argv = ["quality", "--target", str(tiny_text_pair[0]), "--questions", str(questions), "--raw", "--max-new-tokens", "6",
            "--json", str(out)]
    assert cli_main(argv) == 0
    assert "| overall | 2 |" in capsys.readouterr().out
    summary = json.loads(out.read_text())["summary"]
    overall = summary["overall"]
    assert set(summary["per_category"]) == {"rag", "qa"}
    assert 0 <= overall["mean_kl"] < 0.05 and 0 <= overall["top1_agreement"] <= 1 and overall["positions"] > 0
    assert cli_main([*argv[:-2], "--reference", "int8"]) == 2  # the same precision twice: a clear error
    assert "both int8" in capsys.readouterr().err


# --- benchmark: per-method precision, the optional llama.cpp baseline ------------------------------


def test_bench_methods_take_a_precision_and_llama_cpp_is_optional(monkeypatch):
    from verispec.tools.bench import compare

    assert compare.parse_method("vs:none[int8]").precision == "int8"
    spec = compare.parse_method("vs:model@constant[fp32]")
    assert (spec.drafter, spec.policy, spec.precision) == ("model", "constant", "float32")
    assert compare.parse_method("vs:ngram:max_n=3").precision is None
    with pytest.raises(InvalidParameterError, match="dtype must be one of"):
        compare.parse_method("vs:none[int4]")
    assert compare.parse_method("llama-cpp").is_llama_cpp
    assert compare.split_methods("hf-plain,llama-cpp,vs:stand:k=2,depth=5[int8]") == [
        "hf-plain", "llama-cpp", "vs:stand:k=2,depth=5[int8]"]
    assert compare.parse_method("llama-cpp-pld").is_llama_cpp
    assert compare.parse_method("vs:model[gguf]").precision == "gguf"


def test_llama_cpp_needs_a_gguf_target(tiny_target):
    from verispec.errors import ModelNotFoundError
    from verispec.models.registry import gguf_file

    with pytest.raises(ModelNotFoundError, match="shipped model name or a .gguf file"):
        gguf_file(str(tiny_target))


def test_bench_runs_int8_methods_beside_float32(tiny_text_pair, tmp_path, monkeypatch, capsys):
    import json

    from verispec.tools.bench import compare

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "rag", "turns": ["t10 t11 t12 t10 t11"]}))
    target, draft = tiny_text_pair
    out = tmp_path / "bench.json"
    argv = ["bench", "--target", str(target), "--draft", str(draft), "--questions", str(questions),
            "--methods", "hf-plain,vs:none,vs:none[int8],vs:model@constant[int8]",
            "--max-new-tokens", "8", "--json", str(out)]
    assert cli_main(argv) == 0
    data = json.loads(out.read_text())
    runs = {r["method"]: r["token_ids"] for r in data["runs"]}
    assert set(runs) == {"hf-plain", "vs:none", "vs:none[int8]", "vs:model@constant[int8]"}
    assert runs["vs:model@constant[int8]"] == runs["vs:none[int8]"]  # exact on the int8 path
    methods = data["methods"]
    assert methods["vs:none[int8]"]["weights_mib"] < methods["vs:none"]["weights_mib"]


def test_a_float32_target_drafts_in_int8_unless_the_spec_says_otherwise(tiny_target, tiny_draft):
    target = load_model(tiny_target)
    assert make_drafter(f"model:{tiny_draft}", target).model.precision == "int8"
    assert make_drafter(f"model:{tiny_draft},int8=0", target).model.precision == "float32"
    assert make_drafter(f"model:{tiny_draft},int8=1", target).model.precision == "int8"
    bf16 = load_model(tiny_target, "bfloat16")
    assert make_drafter(f"model:{tiny_draft}", bf16).model.precision == "bfloat16"
