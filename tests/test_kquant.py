"""The kquant precision: a GGUF file's own Q4_K / Q6_K blocks in verispec's runner (`models/kquant.py`).

The kernels are checked against the `gguf` package's own dequantization (the file's meaning of the
blocks) with the activations quantized as the kernel quantizes them, and the AVX-512 code against
the portable code (the same bits). Whole models are tiny random GGUF files written here with the
`gguf` package (random blocks, llama and qwen2 layouts), checked against verispec's float32 runner on
the dequantized weights (close), and, as for every backend, greedy speculative decoding against greedy
plain decoding of the same path (token-identical) and sampled speculation against the path's own
exact distribution (chi-square, stated power, with a positive control).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from conftest import make_tiny_model
from distribution import assert_rejected, assert_same_distribution, bonus_from_the_wrong_row, sample_sequences
from server_helpers import token_ids

from verispec import Engine, GenerationConfig, SamplingParams
from verispec.drafters import DraftModelDrafter, ExpansionDrafter, NgramDrafter, StandDrafter
from verispec.drafters.hybrid import HybridDrafter
from verispec.errors import InvalidParameterError, ModelNotFoundError
from verispec.control import CostModel
from verispec.engine.build import auto_backends
from verispec.engine.together import mixes_prompts
from verispec.models import kquant
from verispec.models.kquant import (KQUANT_TYPES, KQuantLinear, KQuantWeight, kquant_kernels, kquant_suits, settle_padding,
                                   settle_prefetch, switch_pays)
from verispec.models.gguf_weights import kquant_requantizes, kquant_runs
from verispec.models.loading import load_model, parse_precision
from verispec.models.requantize import quantize_q4_k, quantize_q6_k
from verispec.models.runner import LoadedModel
from verispec.models.transformer import ModelConfig, Transformer
from verispec.testing.reference import WholeSequenceOracle, reference_generate, sequence_distribution

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize  # noqa: E402

Q4_K, Q6_K = KQUANT_TYPES["Q4_K"], KQUANT_TYPES["Q6_K"]
_TYPES = {Q4_K: gguf.GGMLQuantizationType.Q4_K, Q6_K: gguf.GGMLQuantizationType.Q6_K}


def random_blocks(kind: int, rows: int, cols: int, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """uint8 [rows, blocks × block bytes]: random values and sub-block scales, float16 scales of a sane size."""
    size, at = (144, 0) if kind == Q4_K else (210, 208)
    blocks = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    halves = 2 if kind == Q4_K else 1  # Q4_K: d and dmin; Q6_K: d
    step = 2e-4 if kind == Q4_K else 5e-4
    blocks[:, :, at : at + 2 * halves] = (rng.random((rows, cols // 256, halves)) * step * scale).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def float_rows(kind: int, blocks: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(dequantize(blocks, _TYPES[kind]).astype(np.float32))  # [rows, cols]


# --- the kernels ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [Q4_K, Q6_K], ids=["Q4_K", "Q6_K"])
@pytest.mark.parametrize("columns", [48, 40, 200])  # 40: a tile padded with zero columns; 200: 13 tiles, stored 8 at a time
def test_the_kernel_multiplies_the_files_weights(kind, columns):
    kernels = kquant_kernels()
    rng = np.random.default_rng(kind + columns)
    blocks = random_blocks(kind, columns, 512, rng)
    weight = float_rows(kind, blocks)  # [columns, 512]
    assert torch.equal(kernels.dequantize(kind, torch.from_numpy(blocks)), weight)  # the file's meaning
    x = torch.randn(11, 512)
    q, d, sums, pair_sums = kernels.quantize_rows(x)  # what the kernel multiplies: x rounded per 256 values
    assert torch.equal(sums, q.view(11, -1, 16).int().sum(-1))
    assert torch.equal(pair_sums.view(11, -1).int(), sums.view(11, -1, 2).sum(-1))
    rounded = (q.float().view(11, 2, 256) * d[:, :, None]).view(11, 512)
    assert (rounded - x).abs().max() <= d.max() / 2 + 1e-6
    expected = rounded.double() @ weight.double().T  # [11, columns]
    bias = torch.randn(columns)
    layer = KQuantLinear(KQuantWeight(kind, torch.from_numpy(blocks), 512), bias)
    for rows in (11, 3):  # AMX's tile multiplies (from 9 rows), the vector code
        y = layer(x[:rows])
        reference = expected[:rows] + bias.double()
        assert torch.allclose(y.double(), reference, rtol=1e-5, atol=1e-5 * reference.abs().max())


def q8k_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's Q8_K of float32 rows [rows, K] in numpy's float32 arithmetic: (q, d, sums over each 16): d = absmax / 127
    (a NaN ignored), q = the product with 127 / absmax rounded to the nearest, ties to even, within ±127 (NaN: −127)."""
    blocks = x.reshape(len(x), -1, 256)
    amax = np.where(np.isnan(blocks), np.float32(0), np.abs(blocks)).max(-1, keepdims=True)  # [rows, blocks, 1]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        inverse = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
        rounded = np.rint(blocks * inverse)
    q = np.clip(np.where(np.isnan(rounded), np.float32(-127), rounded), -127, 127).astype(np.int8).reshape(x.shape)
    return q, (amax[..., 0] / np.float32(127)).astype(np.float32), q.reshape(len(x), -1, 16).astype(np.int32).sum(-1)


def test_activations_are_quantized_as_q8k_to_the_bit():
    """The vector quantizer (`quantize_block`) gives numpy's Q8_K bytes, ties, zeros, NaN and infinities included."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((6, 512)) * np.logspace(-30, 30, 6)[:, None]).astype(np.float32)
    x[1, :256] = rng.integers(-254, 255, 256) / 2  # absmax 127 (set below): scale 1, so every odd half is a tie
    x[1, 0] = 127.0
    x[2, :256] = 0.0  # a block of zeros: d = 0, q = 0
    x[3, 7], x[3, 300] = np.nan, np.inf  # a NaN left out of the maximum, quantized to −127; an infinity: every product NaN
    x[4, :256] = rng.standard_normal(256).astype(np.float32) * np.float32(1e-40)  # subnormal values
    q, d, sums, _ = kquant_kernels().quantize_rows(torch.from_numpy(x))
    expected_q, expected_d, expected_sums = q8k_reference(x)
    assert np.array_equal(q.numpy(), expected_q) and np.array_equal(sums.numpy(), expected_sums)
    assert np.array_equal(d.numpy(), expected_d)
    assert (expected_q[1, 1:256] % 2 == 0).any() and (x[1, 1:256] % 1 != 0).any()  # ties were there to round


@contextmanager
def kernels_of(name: str):
    """Run the kquant kernels `name` ("amx", "avx512", "avx2", "portable") inside the block, the fastest after."""
    kernels = kquant_kernels()
    if name not in kernels.kernels_built():
        pytest.skip(f"the {name} kernels are not built on this CPU")
    try:
        yield kernels.use_kernels(name)
    finally:
        kernels.use_kernels(kernels.kernels_built()[0])


def test_the_kernels_variable_chooses_the_code_and_refuses_what_is_not_built(monkeypatch):
    built = kquant_kernels().kernels_built()
    try:
        monkeypatch.setenv("VERISPEC_KQUANT_KERNELS", "portable")
        assert kquant_kernels().kernels_in_use() == "portable"
        monkeypatch.setenv("VERISPEC_KQUANT_KERNELS", "avx1024")
        with pytest.raises(InvalidParameterError, match="VERISPEC_KQUANT_KERNELS=avx1024.*built on this CPU are"):
            kquant_kernels()
    finally:
        monkeypatch.delenv("VERISPEC_KQUANT_KERNELS")
        kquant_kernels().use_kernels(built[0])


def test_the_kernels_can_be_built_as_another_cpu_compiles_them():
    """VERISPEC_KERNELS_MARCH=haswell: the flags (and so the build folder) of an AVX2-only CPU's build."""
    import os
    import subprocess
    import sys

    show = [sys.executable, "-c", "from verispec.models import kernels; print(kernels.FLAGS)"]
    env = {k: v for k, v in os.environ.items() if k != "VERISPEC_KERNELS_MARCH"}
    assert "-march=native" in subprocess.run(show, env=env, capture_output=True, text=True, check=True).stdout
    haswell = subprocess.run(show, env={**env, "VERISPEC_KERNELS_MARCH": "haswell"}, capture_output=True, text=True, check=True)
    assert "-march=haswell" in haswell.stdout


@pytest.mark.parametrize("name", ["amx", "avx512", "avx2"])
def test_the_vector_code_gives_the_portable_codes_bits_for_each_row_alone(name):
    rng = np.random.default_rng(3)
    layer = KQuantLinear([KQuantWeight(Q4_K, torch.from_numpy(random_blocks(Q4_K, 64, 768, rng)), 768),
                          KQuantWeight(Q6_K, torch.from_numpy(random_blocks(Q6_K, 24, 768, rng)), 768)])
    x = torch.randn(20, 768) * torch.logspace(-3, 3, 20)[:, None]  # rows of very different sizes
    x[3] = torch.where(torch.arange(768) % 2 == 0, 1.0, -1.0) * 50  # activations at ±127 (the int16 sums' worst case)
    prompt = torch.randn(137, 768)  # a prefill's rows: four pairs of 16-row groups of tile multiplies (AMX), then 9 rows
    with kernels_of("portable"):
        portable, portable_prompt = layer(x), layer(prompt)  # [20, 88], [137, 88]
    with kernels_of(name):
        assert torch.equal(layer(prompt), portable_prompt)
        fast = layer(x)
        for rows in (1, 2, 3, 7, 8, 9, 15, 16, 17):  # every tile size, a second pass over the tile (AMX: from 9 rows)
            assert torch.equal(layer(x[:rows]), fast[:rows])
        assert all(torch.equal(layer(x[i : i + 1]), fast[i : i + 1]) for i in range(20))
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            assert torch.equal(layer(x), fast)
        finally:
            torch.set_num_threads(threads)
    assert torch.equal(fast, portable)


@pytest.mark.parametrize("name", ["amx", "avx512", "avx2"])
def test_prefetching_for_few_rows_moves_no_value(name):
    kernels = kquant_kernels()
    rng = np.random.default_rng(5)
    layer = KQuantLinear([KQuantWeight(Q4_K, torch.from_numpy(random_blocks(Q4_K, 64, 768, rng)), 768),
                          KQuantWeight(Q6_K, torch.from_numpy(random_blocks(Q6_K, 24, 768, rng)), 768)])
    x = torch.randn(3, 768)
    previous = kernels.prefetch_few_rows()
    with kernels_of(name):
        assert name == kernels.kernels_in_use()
        try:
            assert kernels.set_prefetch_few_rows(True) and kernels.prefetch_few_rows()
            prefetched = [layer(x[:rows]) for rows in (1, 2, 3)]
            assert not kernels.set_prefetch_few_rows(False) and not kernels.prefetch_few_rows()
            assert all(torch.equal(layer(x[:rows]), y) for rows, y in zip((1, 2, 3), prefetched))
        finally:
            kernels.set_prefetch_few_rows(previous)


def test_prefetching_for_few_rows_is_measured_once_and_kept_where_it_pays(monkeypatch, tmp_path):
    """`switch_pays` keeps the setting under which the layers ran faster (a layer slow without it, then one slow
    with it: the control); `settle_prefetch` measures only a model large enough to stream from memory, once, and a
    later model takes the kept choice unmeasured."""
    kernels = kquant_kernels()
    if kernels.kernels_in_use() == "portable":
        pytest.skip("the portable code never prefetches")

    class Layer:
        in_features = 8

        def __init__(self, slow_with: bool):
            self.slow_with = slow_with

        def __call__(self, x):
            time.sleep(0.004 if kernels.prefetch_few_rows() == self.slow_with else 0.0)

    previous = kernels.prefetch_few_rows()
    try:
        assert switch_pays(kernels.set_prefetch_few_rows, [Layer(slow_with=False)], rounds=3)[0]
        assert not switch_pays(kernels.set_prefetch_few_rows, [Layer(slow_with=True)], rounds=3)[0]
        monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
        measured = []
        monkeypatch.setattr(kquant, "switch_pays", lambda switch, linears: (measured.append(linears), (True, 0.9))[1])
        assert not settle_prefetch(["small"], kquant.PREFETCH_MEASURED_FROM - 1) and not measured
        assert settle_prefetch(["large"], kquant.PREFETCH_MEASURED_FROM) and measured == [["large"]]
        assert settle_prefetch(["small"], 0) and kernels.prefetch_few_rows() and len(measured) == 1
        (tmp_path / "file").write_text("not a folder")
        monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "file"))  # nowhere to keep it: measured, used, not kept
        assert settle_prefetch(["large"], kquant.PREFETCH_MEASURED_FROM) and len(measured) == 2
    finally:
        kernels.set_prefetch_few_rows(previous)


def test_skipping_padded_sub_blocks_is_measured_on_the_first_padded_model_and_kept(monkeypatch, tmp_path):
    """`settle_padding` measures only the padded layers (inputs not a multiple of 256) of the first model that has
    some, keeps skipping unless reading them whole is faster, and a later model takes the kept choice unmeasured."""
    kernels = kquant_kernels()

    class Layer:
        def __init__(self, in_features: int):
            self.in_features = in_features

    padded, whole = Layer(576), Layer(1536)
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    measured, faster = [], {"read whole": False}
    monkeypatch.setattr(kquant, "switch_pays", lambda switch, linears: (measured.append(linears), (faster["read whole"], 0.8))[1])
    previous = kernels.skip_padding()
    try:
        assert settle_padding([whole]) and kernels.skip_padding() and not measured  # nothing padded: skipping, unmeasured
        assert settle_padding([whole, padded]) and measured == [[padded]]  # measured: skipping was faster
        faster["read whole"] = True
        assert settle_padding([padded]) and len(measured) == 1  # kept: not measured again
        monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "other"))
        assert not settle_padding([padded]) and not kernels.skip_padding() and len(measured) == 2
        assert not settle_padding([whole]) and not kernels.skip_padding()  # a later model takes the kept choice
    finally:
        kernels.set_skip_padding(previous)


@pytest.mark.parametrize("kind", [Q4_K, Q6_K])
def test_an_input_narrower_than_its_super_blocks_is_multiplied_as_its_zero_padded_copy(kind):
    """A requantized layer's rows are padded with zeros to whole super-blocks (896 → 1024 inputs): the kernel
    quantizes the narrower input as if padded (no padded copy is made) and skips the sub-blocks past it or reads them
    too (`set_skip_padding`; their weights here are random, not zeros), bit for bit the padded product either way: in
    the vector code (3 rows) and the AMX tiles (11), with each kernel built here."""
    kernels = kquant_kernels()
    blocks = torch.from_numpy(random_blocks(kind, 32, 512, np.random.default_rng(3)))
    layer = KQuantLinear(KQuantWeight(kind, blocks, 512))
    previous = kernels.skip_padding()
    try:
        for name, (width, rows), skip in itertools.product(kernels.kernels_built(), itertools.product((300, 257, 511, 320), (3, 11)),
                                                           (True, False)):
            x = torch.randn(rows, width)  # the second super-block part-filled
            padded = torch.cat([x, torch.zeros(rows, 512 - width)], dim=1)
            with kernels_of(name):
                assert kernels.set_skip_padding(skip) == skip
                got = kernels.linear(x, layer.packed, layer.kinds, layer.columns, None)
                assert torch.equal(got, kernels.linear(padded, layer.packed, layer.kinds, layer.columns, None)), (name, width, rows, skip)
    finally:
        kernels.set_skip_padding(previous)


def test_bad_shapes_are_clear_errors():
    kernels = kquant_kernels()
    blocks = torch.from_numpy(random_blocks(Q4_K, 16, 256, np.random.default_rng(0)))
    layer = KQuantLinear(KQuantWeight(Q4_K, blocks, 256))
    with pytest.raises(ValueError, match="takes 256 inputs, not 200"):
        layer(torch.randn(2, 200))
    with pytest.raises(RuntimeError, match="another input width"):
        kernels.linear(torch.randn(2, 512), layer.packed, layer.kinds, layer.columns, None)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        kernels.quantize_rows(torch.randn(2, 200))
    with pytest.raises(RuntimeError, match="Q4_K"):
        kernels.repack(2, blocks)
    with pytest.raises(ValueError, match="one input width"):
        KQuantLinear([KQuantWeight(Q4_K, blocks, 256), KQuantWeight(Q4_K, blocks, 512)])


@pytest.mark.parametrize("heads", [6, 12, 14])  # query heads per KV head: 3, 6 (as Qwen2.5-1.5B), 7 (scored 4 at a time)
@pytest.mark.parametrize("head_dim", [128, 64, 48])  # 128 and 64: the vector code where built; 48: the portable code
def test_the_exact_attention_is_attention_and_each_position_is_computed_alone(head_dim, heads):
    """`attend` (kernels/attention.h): every new position of a chain gets the bits it gets alone, a
    token-tree node the bits of the same path laid out as a chain, and all are softmax attention."""
    attend = kquant_kernels().attend
    torch.manual_seed(0)
    kv_heads, start, n, scale = 2, 37, 5, head_dim**-0.5
    keys, values = torch.randn(kv_heads, 64, head_dim), torch.randn(kv_heads, 64, head_dim)  # [kv_heads, capacity, d]
    q = torch.randn(heads, n, head_dim)
    chain = attend(q, keys, values, start, None, scale)  # [heads, n, d]
    for i in range(n):
        seen_keys = keys[:, : start + i + 1].double().repeat_interleave(heads // kv_heads, 0)  # [heads, seen, d]
        seen_values = values[:, : start + i + 1].double().repeat_interleave(heads // kv_heads, 0)
        weights = (torch.einsum("hd,hsd->hs", q[:, i].double(), seen_keys) * scale).softmax(-1)
        torch.testing.assert_close(chain[:, i].double(), torch.einsum("hs,hsd->hd", weights, seen_values), atol=1e-5, rtol=0)
        assert torch.equal(attend(q[:, i : i + 1], keys, values, start + i, None, scale), chain[:, i : i + 1])
    causal = torch.cat([torch.ones(n, start, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()], 1)
    assert torch.equal(attend(q, keys, values, start, causal, scale), chain)
    # a tree: node 3 is a child of node 0 (slots start+0, start+3); as a chain its path is slots start, start+1
    tree = causal.clone()
    tree[3, start + 1 : start + 3] = False
    path_keys, path_values = keys.clone(), values.clone()
    path_keys[:, start + 1], path_values[:, start + 1] = keys[:, start + 3], values[:, start + 3]
    node = attend(q, keys, values, start, tree, scale)[:, 3:4]
    assert torch.equal(node, attend(q[:, 3:4], path_keys, path_values, start + 1, None, scale))
    for name in kquant_kernels().kernels_built()[1:]:  # the slower code (other CPUs) gives the same bits
        with kernels_of(name):
            assert torch.equal(attend(q, keys, values, start, tree, scale)[:, 3:4], node)
            assert torch.equal(attend(q, keys, values, start, None, scale), chain)
    with pytest.raises(RuntimeError, match="mask is"):
        attend(q, keys, values, start, causal[:, 1:], scale)
    with pytest.raises(RuntimeError, match="do not match the cache"):
        attend(q, keys, values, 62, None, scale)  # 62 + 5 slots > capacity 64
    blind = causal.clone()
    blind[2] = False  # a position that sees nothing has no softmax: an error, not NaNs
    with pytest.raises(RuntimeError, match="at least one slot"):
        attend(q, keys, values, start, blind, scale)


@pytest.mark.parametrize("head_dim", [128, 64])
def test_the_exact_attention_scores_blocks_of_slots_with_gaps_and_tails_as_the_portable_code_does(head_dim):
    """Over hundreds of slots the vector code scores 16 at a time: consecutive blocks, blocks with gaps (a token
    tree's), and a last short block all give the portable code's bits, and attention."""
    attend = kquant_kernels().attend
    torch.manual_seed(1)
    heads, kv_heads, start, n, scale = 12, 2, 300, 19, head_dim**-0.5  # n: runs of 8, 8 and 3 positions a task
    keys, values = torch.randn(kv_heads, 320, head_dim), torch.randn(kv_heads, 320, head_dim)  # [kv_heads, capacity, d]
    q = torch.randn(heads, n, head_dim)
    mask = torch.rand(n, start + n) < 0.7  # [n, start + n]: each row sees a scattered set of slots
    mask[:, 0] = True
    mask[0, :200] = True  # and one sees long runs of consecutive ones as well
    expected = {None: attend(q, keys, values, start, None, scale), "mask": attend(q, keys, values, start, mask, scale)}
    for i in range(n):
        seen = mask[i].nonzero()[:, 0]
        seen_keys = keys[:, seen].double().repeat_interleave(heads // kv_heads, 0)  # [heads, seen, d]
        weights = (torch.einsum("hd,hsd->hs", q[:, i].double(), seen_keys) * scale).softmax(-1)
        reference = torch.einsum("hs,hsd->hd", weights, values[:, seen].double().repeat_interleave(heads // kv_heads, 0))
        torch.testing.assert_close(expected["mask"][:, i].double(), reference, atol=1e-5, rtol=0)
    with kernels_of("portable"):
        assert torch.equal(attend(q, keys, values, start, None, scale), expected[None])
        assert torch.equal(attend(q, keys, values, start, mask, scale), expected["mask"])


# --- tiny GGUF models ----------------------------------------------------------------------------

HIDDEN, HEADS, KV_HEADS, LAYERS = 256, 4, 2, 2


def write_tiny_gguf(path, arch: str, vocab: int, seed: int) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A random `arch` model as a GGUF file of Q4_K and Q6_K blocks (v and down in Q6_K, as Q4_K_M
    files keep some), and the same weights dequantized under Hugging Face names (query/key rows in
    Hugging Face order: a llama file stores them permuted, as llama.cpp's converter does)."""
    rng = np.random.default_rng(seed)
    head_dim = HIDDEN // HEADS
    config = ModelConfig(model_type=arch, vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                         num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=head_dim,
                         rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256,
                         attention_bias=arch == "qwen2", tie_word_embeddings=False)
    writer = gguf.GGUFWriter(str(path), arch)
    floats: dict[str, torch.Tensor] = {}

    def quantized(hf: str, name: str, kind: int, rows: int, cols: int, scale: float = 1.0, heads: int | None = None):
        blocks = random_blocks(kind, rows, cols, rng, scale)
        floats[hf] = float_rows(kind, blocks)
        if heads is not None and arch == "llama":  # llama.cpp's converter permutes q and k rows for its RoPE
            blocks = blocks.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(blocks.shape)
        writer.add_tensor(name, blocks, raw_dtype=_TYPES[kind])

    def plain(hf: str, name: str, values: np.ndarray):
        floats[hf] = torch.from_numpy(values)
        writer.add_tensor(name, values)

    quantized("model.embed_tokens.weight", "token_embd.weight", Q4_K, vocab, HIDDEN, scale=20.0)
    for i in range(LAYERS):
        hf, blk = f"model.layers.{i}.", f"blk.{i}."
        plain(hf + "input_layernorm.weight", blk + "attn_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        plain(hf + "post_attention_layernorm.weight", blk + "ffn_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        quantized(hf + "self_attn.q_proj.weight", blk + "attn_q.weight", Q4_K, HIDDEN, HIDDEN, heads=HEADS)
        quantized(hf + "self_attn.k_proj.weight", blk + "attn_k.weight", Q4_K, KV_HEADS * head_dim, HIDDEN, heads=KV_HEADS)
        quantized(hf + "self_attn.v_proj.weight", blk + "attn_v.weight", Q6_K, KV_HEADS * head_dim, HIDDEN)
        if arch == "qwen2":
            for p, width in (("q", HIDDEN), ("k", KV_HEADS * head_dim), ("v", KV_HEADS * head_dim)):
                plain(hf + f"self_attn.{p}_proj.bias", blk + f"attn_{p}.bias", (0.1 * rng.standard_normal(width)).astype(np.float32))
        quantized(hf + "self_attn.o_proj.weight", blk + "attn_output.weight", Q4_K, HIDDEN, HIDDEN)
        quantized(hf + "mlp.gate_proj.weight", blk + "ffn_gate.weight", Q4_K, 2 * HIDDEN, HIDDEN)
        quantized(hf + "mlp.up_proj.weight", blk + "ffn_up.weight", Q4_K, 2 * HIDDEN, HIDDEN)
        quantized(hf + "mlp.down_proj.weight", blk + "ffn_down.weight", Q6_K, HIDDEN, 2 * HIDDEN)
    plain("model.norm.weight", "output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    quantized("lm_head.weight", "output.weight", Q6_K, vocab, HIDDEN, scale=0.5)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return config, floats


def kquant_model(path, config: ModelConfig, tokenizer) -> LoadedModel:
    return LoadedModel(str(path), path, Transformer.from_gguf(path, config), tokenizer, frozenset({0}))


@pytest.fixture(scope="module")
def tiny_draft48(tmp_path_factory):
    """A float32 draft of the same 48-word vocabulary, whose word-level tokenizer the tiny files use too."""
    folder = tmp_path_factory.mktemp("kq-draft") / "d"
    return load_model(make_tiny_model(folder, vocab_size=48, seed=2, layers=1, arch="llama"))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory, tiny_draft48):
    """(the kquant model, the float32 model of the same dequantized weights)."""
    path = tmp_path_factory.mktemp("kquant") / f"{request.param}.gguf"
    config, floats = write_tiny_gguf(path, request.param, vocab=48, seed=7)
    reference = Transformer(config, floats, torch.float32, pack=False)
    tokenizer = tiny_draft48.tokenizer
    return kquant_model(path, config, tokenizer), LoadedModel("float", path, reference, tokenizer, frozenset({0}))


PROMPTS = [[5, 9, 2, 7], [11, 3, 3, 3, 8, 1, 30, 12, 5], [40]]


def test_the_file_runs_as_its_dequantized_weights_do(tiny):
    """The blocks, names, head and (llama) row order are read right: the logits are close to float32
    on the same weights (int8 activations are the only difference)."""
    model, reference = tiny
    ids = torch.tensor(PROMPTS[1])
    got = model.runner.forward(model.runner.new_cache(), ids)
    want = reference.runner.forward(reference.runner.new_cache(), ids)
    assert 1 < float(want.std()) < 20  # logits of a useful size: neither uniform nor one-hot
    assert float((got - want).norm() / want.norm()) < 0.15  # random weights: 2–7 % measured
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="batchmean")
    assert float(kl) < 0.02
    assert model.precision == "kquant" and model.runner.row_invariant


def test_the_tiles_are_repacked_once_per_file_and_again_when_it_changes(tmp_path, monkeypatch):
    """A second load reads the tiles the first one repacked (none repacked: same logits, bit for bit); a
    file rewritten (another modification time) is repacked again."""
    from verispec.models import kquant

    path = tmp_path / "t.gguf"
    config, _ = write_tiny_gguf(path, "qwen2", vocab=16, seed=3)
    ids = torch.tensor(PROMPTS[1][:6])
    logits = lambda runner: runner.forward(runner.new_cache(), ids, logits="all")  # noqa: E731
    fresh = logits(Transformer.from_gguf(path, config))
    repacked, repack = [], kquant.KQuantTiles.repack
    monkeypatch.setattr(kquant.KQuantTiles, "repack", classmethod(lambda cls, weight: repacked.append(weight) or repack(weight)))
    assert torch.equal(logits(Transformer.from_gguf(path, config)), fresh) and not repacked
    os.utime(path, ns=(0, path.stat().st_mtime_ns + 10**9))
    assert torch.equal(logits(Transformer.from_gguf(path, config)), fresh) and len(repacked) == 4 * LAYERS + 1  # + the head

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "file"))  # a cache directory that cannot be made
    (tmp_path / "file").write_text("not a folder")
    with pytest.warns(RuntimeWarning, match="could not keep prepared layers"):
        assert torch.equal(logits(Transformer.from_gguf(path, config)), fresh)  # the load itself goes on


def test_forward_rows_equal_single_position_decoding(tiny):
    runner = tiny[0].runner
    prompt, feed = torch.tensor(PROMPTS[1]), torch.tensor([4, 17, 23, 9, 31])
    cache = runner.new_cache()
    runner.forward(cache, prompt, logits="none")
    together = runner.forward(cache, feed)  # [5, vocab]: a verification pass
    cache.truncate(len(PROMPTS[1]))
    alone = torch.cat([runner.forward(cache, feed[i : i + 1]) for i in range(len(feed))])
    assert torch.equal(together, alone)
    other = runner.new_cache()
    cache.truncate(len(PROMPTS[1]))
    batched = runner.forward_ragged([cache, other], [feed, torch.tensor(PROMPTS[0])])  # a server batch
    assert torch.equal(batched[0], together)


def test_a_prompt_chunk_among_verification_rows_is_computed_as_alone(tiny):
    """What lets a server's prompt chunk ride in the decoding requests' pass (`engine/together.mixes_prompts`): with
    per-row logits (a 40-token chunk wanting its last, another none, two verifications all), each row's logits and
    keys/values are the bits it gets in a pass of its own, and the head scores only what was asked for."""
    runner = tiny[0].runner
    assert mixes_prompts(runner) and not mixes_prompts(tiny[1].runner)  # the float32 twin promises neither
    g = torch.Generator().manual_seed(5)
    prefixes = [torch.randint(2, 48, (n,), generator=g) for n in (9, 0, 30, 3)]
    feeds = [torch.randint(2, 48, (n,), generator=g) for n in (4, 40, 1, 17)]
    modes = ["all", "last", "all", "none"]

    def cached(i):
        cache = runner.new_cache(128)
        if len(prefixes[i]):
            runner.forward(cache, prefixes[i], logits="none")
        return cache

    alone = []
    for i, mode in enumerate(modes):
        cache = cached(i)
        alone.append((runner.forward(cache, feeds[i], logits=mode), cache))
    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [1, 2]):
        caches = [cached(i) for i in order]
        got = runner.forward_ragged(caches, [feeds[i] for i in order], logits=[modes[i] for i in order])
        for i, logits, cache in zip(order, got, caches):
            want, want_cache = alone[i]
            assert (logits is None) == (modes[i] == "none") and (want is None or torch.equal(logits, want)), (i, order)
            assert torch.equal(cache.keys[:, :, : cache.length], want_cache.keys[:, :, : want_cache.length])
            assert torch.equal(cache.values[:, :, : cache.length], want_cache.values[:, :, : want_cache.length])
    with pytest.raises(ValueError, match="once or once per row"):
        runner.forward_ragged([cached(0), cached(2)], [feeds[0], feeds[2]], logits=["all"])


@pytest.mark.parametrize("piece", [None, 32])
def test_a_prompt_fed_in_chunks_leaves_the_cache_it_leaves_whole(tiny, piece, monkeypatch):
    """kquant's attention is row-invariant at every width, prefill included: a server's chunked prefill
    gives the bits of a whole one (so the request's output cannot depend on how it was chunked), and a whole one
    the bits of its own pieces (`_prefill_piece`: 32 here, where the CPU's default would hold all 90)."""
    runner = tiny[0].runner
    if piece is not None:
        from verispec.models import transformer

        monkeypatch.setattr(transformer, "AMX_PREFILL_PIECE", piece)
        monkeypatch.setattr(Transformer, "_prefill_piece", lambda self: piece)
    prompt = torch.randint(0, runner.config.vocab_size, (90,), generator=torch.Generator().manual_seed(3))  # [90]
    whole = runner.new_cache()
    whole_logits = runner.forward(whole, prompt, logits="last")
    chunked = runner.new_cache()
    for first, last in [(0, 7), (7, 47), (47, 48), (48, 90)]:  # 7, 40 (wider than a verification), 1, 42
        chunked_logits = runner.forward(chunked, prompt[first:last], logits="last")
    assert torch.equal(chunked_logits, whole_logits)
    assert torch.equal(chunked.keys[:, :, :90], whole.keys[:, :, :90]) and torch.equal(chunked.values[:, :, :90], whole.values[:, :, :90])


@pytest.mark.parametrize("gamma", [1, 4])
@pytest.mark.parametrize("kind", ["model", "self", "ngram", "tree", "stand"])
def test_greedy_speculative_equals_greedy_plain(tiny, tiny_draft48, kind, gamma):
    model = tiny[0]
    drafter = {
        "model": lambda: DraftModelDrafter(tiny_draft48, model.vocab_size),
        "self": lambda: DraftModelDrafter(model, model.vocab_size),  # always accepted: the bonus path
        "ngram": lambda: NgramDrafter(max_n=3),
        "tree": lambda: ExpansionDrafter(tiny_draft48, model.vocab_size),
        "stand": lambda: StandDrafter(model.vocab_size),
    }[kind]()
    engine, plain = Engine(model, drafter, gamma=gamma, gamma_policy="constant"), Engine(model, None)
    for prompt in PROMPTS:
        expected = plain.generate(prompt, GenerationConfig(max_new_tokens=20)).token_ids
        assert expected == reference_generate(WholeSequenceOracle(model.runner), prompt, 20, eos_ids=model.eos_ids)
        assert engine.generate(prompt, GenerationConfig(max_new_tokens=20)).token_ids == expected


def test_requests_stepped_together_get_what_they_get_alone(tiny, tmp_path, monkeypatch):
    """kquant through `Engine.generate_batch` (the server's step): four requests, greedy and seeded sampled, with a kquant
    draft of another file; the draft's forwards and the target's verifications share passes of several rows (the C++
    stack), and every request's tokens are those it gets alone."""
    model = tiny[0]
    config, _ = write_tiny_gguf(tmp_path / "draft.gguf", "llama", vocab=48, seed=9)
    draft = kquant_model(tmp_path / "draft.gguf", config, model.tokenizer)
    engine = Engine(model, DraftModelDrafter(draft, model.vocab_size), gamma=3, gamma_policy="constant")
    prompts = [*PROMPTS, [7, 7, 7, 2]]
    configs = [GenerationConfig(max_new_tokens=12, ignore_eos=True, seed=i,
                                sampling=SamplingParams(temperature=1.0 if i % 2 else 0.0)) for i in range(len(prompts))]
    alone = [engine.generate(prompt, c).token_ids for prompt, c in zip(prompts, configs)]
    shared = {"draft": [], "target": []}
    for name, runner in (("draft", draft.runner), ("target", model.runner)):
        monkeypatch.setattr(runner, "forward_ragged", lambda caches, *rest, ragged=runner.forward_ragged, seen=shared[name], **kw:
                            seen.append(len(caches)) or ragged(caches, *rest, **kw))
    assert [r.token_ids for r in engine.generate_batch(prompts, configs, max_batch=4)] == alone
    assert max(shared["draft"]) > 1 and max(shared["target"]) == 4


# --- sampling: equal in distribution to the kquant target ----------------------------------------

PROMPT, LENGTH, GAMMA, SAMPLES = [3, 7], 3, 2, 1_000  # 64 sequences; 1,000 samples find a bias of TV ≥ 0.12, 4,000 of 0.06 (90 % power)


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kquant-small")
    config, _ = write_tiny_gguf(folder / "t.gguf", "qwen2", vocab=12, seed=21)
    draft = load_model(make_tiny_model(folder / "d", vocab_size=12, seed=22, layers=1, arch="llama"))
    target = kquant_model(folder / "t.gguf", config, draft.tokenizer)
    target.eos_ids = frozenset()  # fixed-length sequences
    return target, draft


PARAMS = SamplingParams(temperature=0.8, top_k=4)


def _sampling_case(small_pair) -> tuple[Engine, dict]:
    """The draft-model engine on the kquant target, and the target's exact distribution of LENGTH tokens."""
    target, draft = small_pair
    engine = Engine(target, DraftModelDrafter(draft, target.vocab_size), gamma=GAMMA, gamma_policy="constant")
    return engine, sequence_distribution(WholeSequenceOracle(target.runner), PROMPT, LENGTH, PARAMS)


def test_sampled_output_is_distributed_as_the_kquant_target(small_pair):
    engine, exact = _sampling_case(small_pair)
    assert len(exact) == 64
    result = assert_same_distribution(sample_sequences(engine, PROMPT, PARAMS, 4 * SAMPLES, LENGTH), exact)
    assert result.detectable_tv < 0.07  # power against the wrong bonus below (its bias here: TV ≈ 0.06–0.1)


def test_unseeded_sampled_requests_sized_for_their_batch_are_distributed_as_the_target(small_pair, monkeypatch):
    """A sampled request without a seed promises its draws in distribution only, so together with others its γ is
    sized for the batch as a greedy one's is (`control/batch.py`; a seeded one keeps its γ): SAMPLES such requests
    through `generate_batch`, 8 at a time on a pass priced steep enough to cut drafts, are the target's exact
    distribution, and cuts happened (the positive control: alone each speculative step drafts its γ)."""
    import verispec.engine.loop as loop

    target, draft = small_pair
    engine = Engine(target, DraftModelDrafter(draft, target.vocab_size), gamma=GAMMA, gamma_policy="analytic")
    steep = CostModel([1.0, 1.0, 1.0, 1.0, 4.0, 7.0], 0.01, 1.0)  # γ 2 pays alone; 8 rows of 3 positions do not
    monkeypatch.setattr(engine, "costs_for", lambda *args, **kwargs: steep)
    seeds = itertools.count(1)
    monkeypatch.setattr(loop.secrets, "randbits", lambda bits: next(seeds))  # "unseeded", reproducibly here
    config = GenerationConfig(max_new_tokens=LENGTH, sampling=PARAMS)
    # each request's first step after the prefill's token, with two tokens left: γ 1 alone (a draft and its check)
    drafted = lambda results: [result.stats.records[1].proposed for result in results]  # noqa: E731
    alone = drafted([engine.generate(PROMPT, config) for _ in range(8)])
    assert alone and min(alone) >= 1  # every speculative step drafts alone
    seeded = [GenerationConfig(max_new_tokens=LENGTH, sampling=PARAMS, seed=i) for i in range(8)]
    assert min(drafted(engine.generate_batch([PROMPT] * 8, seeded, max_batch=8))) >= 1  # seeded: γ as alone
    results = engine.generate_batch([PROMPT] * SAMPLES, config, max_batch=8)
    assert drafted(results).count(0) > SAMPLES // 2  # together most of those steps were cut to plain ones
    exact = sequence_distribution(WholeSequenceOracle(target.runner), PROMPT, LENGTH, PARAMS)
    assert_same_distribution([tuple(result.token_ids) for result in results], exact)


def test_the_kquant_test_catches_a_wrong_bonus(small_pair, monkeypatch):
    import verispec.engine.shapes as engine_module

    monkeypatch.setattr(engine_module, "verify_sampled", bonus_from_the_wrong_row)
    engine, exact = _sampling_case(small_pair)
    assert_rejected(sample_sequences(engine, PROMPT, PARAMS, 4 * SAMPLES, LENGTH), exact)


# --- what the precision accepts ------------------------------------------------------------------


def test_a_file_with_other_block_types_is_a_clear_error(tmp_path):
    path = tmp_path / "q8.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 34), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    config, _ = write_tiny_gguf(tmp_path / "ok.gguf", "qwen2", vocab=16, seed=1)
    with pytest.raises(ModelNotFoundError, match="Q8_0.*--dtype gguf"):
        Transformer.from_gguf(path, config)
    assert not kquant_suits(path) and not kquant_runs(path)  # so `--dtype auto` plans llama.cpp alone for it
    assert kquant_requantizes(path) and not kquant_requantizes(tmp_path / "ok.gguf")  # as a draft: requantized
    assert kquant_runs(tmp_path / "ok.gguf")
    fast = kquant_kernels().kernels_built()[0] != "portable"
    assert kquant_suits(tmp_path / "ok.gguf") == fast
    assert auto_backends(str(tmp_path / "ok.gguf")) == (["gguf", "kquant"] if fast else ["gguf"])
    with pytest.raises(ModelNotFoundError, match="kquant run a GGUF file"):
        load_model("not-a-file.txt", "kquant")
    assert parse_precision("kquant").quant == "kquant"
    cut = tmp_path / "cut.gguf"
    cut.write_bytes((tmp_path / "ok.gguf").read_bytes()[:-1000])  # a download that stopped early
    with pytest.raises(ModelNotFoundError, match="ends inside tensor"):
        Transformer.from_gguf(cut, config)


def test_the_compiled_decoder_stack_gives_the_same_bits_as_the_python_loop(tiny, monkeypatch):
    """Decode steps, chain verifications, token trees, prompt pieces (more rows than a verification: the
    element-wise work shared out over threads) and server batches of several rows (chains, a tree and a prompt in
    one pass) run `KQuantLayers` (C++, `kernels/decoder.h`): the same model as the Python loop."""
    runner = tiny[0].runner
    assert runner._compiled_layers() is not None and runner.compiled
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)  # [4, 4]: two branches

    def decode(feeds: list[list[int]]) -> list[torch.Tensor]:
        cache, other, third = runner.new_cache(), runner.new_cache(), runner.new_cache()
        runner.forward(cache, torch.tensor(PROMPTS[1]), logits="none")
        runner.forward(other, torch.tensor(PROMPTS[0]), logits="none")
        out = [runner.forward(cache, torch.tensor(feed)) for feed in feeds]
        positions = cache.length + torch.tensor([0, 1, 1, 2])
        out.append(runner.forward(cache, torch.tensor([3, 4, 5, 6]), positions=positions, tree_mask=tree))
        batch = runner.forward_ragged([other, cache, third], [torch.tensor([8, 2, 5]), torch.tensor([9]), torch.tensor(PROMPTS[1])])
        positions = other.length + torch.tensor([0, 1, 1, 2])
        batch += runner.forward_ragged([cache, other], [torch.tensor([1]), torch.tensor([3, 4, 5, 6])], [None, positions], [None, tree])
        return out + batch + [cache.keys[:, :, : cache.length], other.values[:, :, : other.length], third.keys[:, :, : third.length]]

    feeds = [[5], [7, 9, 11, 13], [17], list(range(1, 9)), [i % 40 + 1 for i in range(70)]]
    compiled = decode(feeds)
    with monkeypatch.context() as patch:
        patch.setattr(Transformer, "_compiled_layers", lambda self: None)
        python = decode(feeds)
    assert all(torch.equal(a, b) for a, b in zip(compiled, python, strict=True))


def test_a_rows_logits_do_not_depend_on_the_rest_of_the_pass(tiny):
    """kquant's server batches (several rows through the C++ stack, chains and a tree on caches of different lengths):
    each row's logits and keys/values are the bits it gets alone (`test_row_invariance.py`'s check)."""
    from test_row_invariance import ragged_mismatches

    assert tiny[0].runner.compiled
    assert ragged_mismatches(tiny[0].runner) == []


def test_a_derived_draft_shares_the_files_head_tiles(tiny):
    """`self:layers=1,vocab=20` on a kquant target: the head's first tiles, shared, scoring ids < 20 with
    the full head's bits; as a draft, greedy output stays the target's own."""
    from verispec.drafters import make_drafter

    model = tiny[0]
    drafter = make_drafter("self:layers=1,vocab=20", model)
    head, cut = model.runner.lm_head, drafter.model.runner.lm_head.head
    assert cut.packed[0].data_ptr() == head.packed[0].data_ptr() and cut.out_features == 20
    x = torch.randn(3, HIDDEN)
    assert torch.equal(cut(x), head(x)[:, :20])
    config = GenerationConfig(max_new_tokens=16)
    expected = Engine(model, None).generate(PROMPTS[1], config).token_ids
    assert Engine(model, drafter, gamma=3, gamma_policy="constant").generate(PROMPTS[1], config).token_ids == expected


# --- requantized drafts: a file of other block types (`models/requantize.py`) ---------------------


@pytest.mark.parametrize("quantize, kind, error", [(quantize_q4_k, "Q4_K", 0.1), (quantize_q6_k, "Q6_K", 0.03)])
def test_the_quantizers_write_blocks_the_gguf_package_reads_back(quantize, kind, error):
    rng = np.random.default_rng(0)
    weights = (rng.standard_normal((24, 512)) * 0.05).astype(np.float32)  # [rows, K]
    weights[:, 320:] = 0.0  # a padded row's tail: whole sub-blocks of zeros (896 = 28 × 32)
    weights[5] = 0.0  # a row of zeros (scales 0: no division by zero)
    weights[6, :320] += 0.2  # a row of positive weights (Q4_K's min is then 0)
    blocks = quantize(weights)
    back = dequantize(blocks, gguf.GGMLQuantizationType[kind]).reshape(weights.shape)
    assert blocks.shape == (24, 2 * (144 if kind == "Q4_K" else 210)) and np.isfinite(back).all()
    assert np.linalg.norm(back - weights) / np.linalg.norm(weights) < error  # 7.8 % and 1.9 % measured
    assert not back[:, 320:].any() and not back[5].any()  # zeros stay exact zeros
    shuffled = quantize(weights[::-1].copy())[::-1]  # each row's blocks are its own
    assert np.array_equal(shuffled, blocks)


def write_legacy_gguf(path, vocab: int, seed: int, hidden: int = 96) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A random qwen2 model as the shipped 0.5B draft is stored: widths that are not multiples of 256,
    Q5_0 and Q8_0 blocks (the `gguf` package's own quantizers); and its weights as the file means them."""
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    config = ModelConfig(model_type="qwen2", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=hidden // 4, rms_norm_eps=1e-6,
                         rope_theta=10000.0, max_position_embeddings=256, attention_bias=True, tie_word_embeddings=False)
    writer = gguf.GGUFWriter(str(path), "qwen2")
    floats: dict[str, torch.Tensor] = {}

    def blocks(hf: str, name: str, rows: int, cols: int, kind: str, scale: float):
        kind = gguf.GGMLQuantizationType[kind]
        raw = quantize((rng.standard_normal((rows, cols)) * scale).astype(np.float32), kind)
        floats[hf] = torch.from_numpy(dequantize(raw, kind).astype(np.float32))
        writer.add_tensor(name, raw, raw_dtype=kind)

    def plain(hf: str, name: str, values: np.ndarray):
        floats[hf] = torch.from_numpy(values)
        writer.add_tensor(name, values)

    kv = 2 * config.head_dim
    blocks("model.embed_tokens.weight", "token_embd.weight", vocab, hidden, "Q5_0", 1.0)
    for i in range(2):
        hf, blk = f"model.layers.{i}.", f"blk.{i}."
        plain(hf + "input_layernorm.weight", blk + "attn_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        plain(hf + "post_attention_layernorm.weight", blk + "ffn_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        for p, rows, kind in (("q", hidden, "Q5_0"), ("k", kv, "Q5_0"), ("v", kv, "Q8_0")):
            blocks(hf + f"self_attn.{p}_proj.weight", blk + f"attn_{p}.weight", rows, hidden, kind, 0.1)
            plain(hf + f"self_attn.{p}_proj.bias", blk + f"attn_{p}.bias", (0.1 * rng.standard_normal(rows)).astype(np.float32))
        blocks(hf + "self_attn.o_proj.weight", blk + "attn_output.weight", hidden, hidden, "Q5_0", 0.1)
        blocks(hf + "mlp.gate_proj.weight", blk + "ffn_gate.weight", 2 * hidden, hidden, "Q5_0", 0.1)
        blocks(hf + "mlp.up_proj.weight", blk + "ffn_up.weight", 2 * hidden, hidden, "Q5_0", 0.1)
        blocks(hf + "mlp.down_proj.weight", blk + "ffn_down.weight", hidden, 2 * hidden, "Q8_0", 0.1)
    plain("model.norm.weight", "output_norm.weight", np.ones(hidden, dtype=np.float32))
    blocks("lm_head.weight", "output.weight", vocab, hidden, "Q8_0", 0.3)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    return config, floats


def test_a_draft_of_other_blocks_runs_requantized_and_speculation_stays_exact(tiny, tmp_path, monkeypatch):
    """The shipped 0.5B's case: Q5_0/Q8_0 blocks 96 wide run requantized (padded to 256), close to the
    file's own weights; the copy is made once and cached; and as a draft it leaves greedy speculative
    output equal to plain decoding of the kquant target."""
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "legacy.gguf"
    config, floats = write_legacy_gguf(path, vocab=48, seed=5)
    with pytest.raises(ModelNotFoundError, match="Q5_0, Q8_0"):
        Transformer.from_gguf(path, config)
    runner = Transformer.from_gguf(path, config, requantize=True)
    assert runner.variant.endswith(",requantized") and len(list((tmp_path / "cache" / "kquant").glob("*.safetensors"))) == 1
    reference = Transformer(config, floats, torch.float32, pack=False)
    ids = torch.tensor(PROMPTS[1])
    got, want = runner.forward(runner.new_cache(), ids), reference.forward(reference.new_cache(), ids)
    assert float((got - want).norm() / want.norm()) < 0.25
    again = Transformer.from_gguf(path, config, requantize=True)  # from the cache: the same blocks
    assert torch.equal(again.forward(again.new_cache(), ids), got)
    target = tiny[0]
    draft = LoadedModel("legacy", path, runner, target.tokenizer, frozenset({0}))
    engine, plain = Engine(target, DraftModelDrafter(draft, target.vocab_size), gamma=3, gamma_policy="constant"), Engine(target, None)
    settings = GenerationConfig(max_new_tokens=20)
    assert engine.generate(PROMPTS[0], settings).stats.proposed_tokens > 0  # the draft takes part
    for prompt in PROMPTS:
        assert engine.generate(prompt, settings).token_ids == plain.generate(prompt, settings).token_ids


# --- prompt caching: exact on a prefix-invariant runner (`models/prefixes.py`) --------------------


def test_a_shared_prefix_is_reused_and_the_output_is_what_a_fresh_engine_gives(tiny):
    model, floats = tiny
    assert model.runner.prefix_invariant and not floats.runner.prefix_invariant
    assert Engine(floats, None).prefixes is None  # float32 prefills a prompt in other roundings than its chunks
    head = list(range(3, 23))  # 20 tokens, as a chat template's system prompt
    first, second = head + [30, 31, 32], head + [40, 41]
    greedy, sampled = GenerationConfig(max_new_tokens=12), GenerationConfig(max_new_tokens=12, seed=4,
                                                                         sampling=SamplingParams(temperature=0.9))
    for drafter in (None, NgramDrafter(max_n=3)):
        for config in (greedy, sampled):
            engine = Engine(model, drafter, gamma=3, gamma_policy="constant")
            engine.generate(first, config)
            again = engine.generate(second, config)
            fresh = Engine(model, drafter, gamma=3, gamma_policy="constant").generate(second, config)
            assert again.stats.cached_tokens == 20 and fresh.stats.cached_tokens == 0
            assert again.token_ids == fresh.token_ids
            turn = second + again.token_ids + [44, 45]  # the conversation's next turn: all of it cached but the new tokens
            assert engine.generate(turn, config).stats.cached_tokens == len(second) + len(again.token_ids) - 1


def test_a_draft_models_sessions_reuse_its_prefill_and_draft_the_same(tiny, monkeypatch):
    """A kquant draft's sessions share a prompt cache of their own (`draft_prefix_store`): the next turn of a
    conversation copies what the last request fed the draft and prefills only the rest, and its proposals (so the
    steps, acceptance and output) are those of a draft prefilled from nothing."""
    from verispec.drafters import base
    from verispec.drafters.draft_model import DraftModelDrafter
    from verispec.models.prefixes import draft_prefix_store

    model, floats = tiny
    assert draft_prefix_store(floats) is None  # a float32 draft: nothing stored
    prompt = list(range(3, 23)) + [30, 31, 32]
    config = GenerationConfig(max_new_tokens=12)

    def conversation() -> tuple[int, list[int], list[tuple[int, int]], int]:
        """Two turns; (the second's prompt tokens, its output, its steps' (proposed, accepted), the draft's prefill)."""
        engine = Engine(model, DraftModelDrafter(model, model.vocab_size), gamma=3, gamma_policy="constant")
        engine.prefixes = None  # the target prefills every turn whole: only the draft's store at work
        turn = prompt + engine.generate(prompt, config).token_ids + [44, 45]
        generation = engine.start(turn, config)
        fed, feed = [], base.ModelSession._feed
        with monkeypatch.context() as patch:  # the draft's first feed of this turn is its prefill (after the first token)
            patch.setattr(base.ModelSession, "_feed", lambda self, tokens, logits="last": fed.append(len(tokens)) or feed(self, tokens, logits))
            while not generation.done:
                generation.step()
        result = generation.result()
        return len(turn), result.token_ids, [(r.proposed, r.accepted) for r in result.stats.records], fed[0]

    draft_prefix_store(model)._entries.clear()
    turn, stored, stored_steps, stored_prefill = conversation()
    with monkeypatch.context() as patch:
        patch.setattr(base, "draft_prefix_store", lambda model: None)
        _, fresh, fresh_steps, fresh_prefill = conversation()
    assert stored == fresh and stored_steps == fresh_steps
    assert fresh_prefill == turn - 1 and stored_prefill <= turn - len(prompt)  # the draft fed only what is new


def test_the_prompt_cache_outlives_the_process_when_saved(tiny, monkeypatch):
    """`save()` (what `verispec generate` does after its answer) leaves the recent entries, within its byte budget,
    for a new engine: it prefills only what follows them and answers what an engine without them answers; a store
    of another stamp (another kernel build, model file or thread count) or a damaged file starts empty."""
    import json

    from safetensors import safe_open

    from verispec.models import prefixes
    from verispec.models.prefixes import PrefixStore

    model = tiny[0]
    monkeypatch.setattr(prefixes, "DISK_BUDGET", 21 * model.runner.cache_bytes_per_position)  # the entry's first 21
    head = list(range(3, 23))
    first, second, config = head + [30, 31, 32], head + [40, 41], GenerationConfig(max_new_tokens=12)
    engine = Engine(model, None)
    file = engine.prefixes.file
    try:
        engine.generate(first, config)
        engine.prefixes.save()
        with safe_open(file, framework="pt") as saved:
            assert json.loads(saved.metadata()["tokens"]) == [first[:21]]  # of 35 positions (prompt and answer)
        later = Engine(model, NgramDrafter(max_n=3), gamma=3, gamma_policy="constant")
        again = later.generate(second, config)
        alone = Engine(model, NgramDrafter(max_n=3), gamma=3, gamma_policy="constant")
        alone.prefixes = PrefixStore(model.runner)  # in memory only, empty
        fresh = alone.generate(second, config)
        assert again.stats.cached_tokens == 20 and fresh.stats.cached_tokens == 0 and again.token_ids == fresh.token_ids
        assert PrefixStore(model.runner, file=file, stamp="another kernel build").positions == 0
        file.write_bytes(b"damaged")
        assert Engine(model, None).prefixes.positions == 0
    finally:
        file.unlink(missing_ok=True)  # the module's other engines start without it


def test_a_server_leaves_its_prompt_cache_when_it_stops(tiny):
    """What `verispec serve` read at its start it also writes when it stops: the prompts it served."""
    import json

    import httpx
    from safetensors import safe_open
    from server_helpers import LocalServer

    from verispec.serving.http import create_app

    model = tiny[0]
    engine = Engine(model, None)
    file = engine.prefixes.file
    prompt = list(range(3, 30))
    try:
        with LocalServer(create_app(engine, model_name="tiny")) as server:
            reply = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 4,
                                                                     "temperature": 0}, timeout=60)
            assert reply.status_code == 200, reply.text
            assert not file.exists()
        with safe_open(file, framework="pt") as saved:
            (kept,) = json.loads(saved.metadata()["tokens"])
        assert kept[: len(prompt)] == prompt
    finally:
        file.unlink(missing_ok=True)  # the module's other engines start without it


def test_a_prefill_in_chunks_continues_a_cached_prefix_exactly(tiny):
    """The server's path: a request prefilled a chunk at a time after the cached tokens."""
    from verispec.engine.loop import Generation

    model = tiny[0]
    engine = Engine(model, None)
    prompt = list(range(5, 40))
    engine.generate(prompt[:30] + [2, 2], GenerationConfig(max_new_tokens=4))
    generation = Generation(engine, prompt, GenerationConfig(max_new_tokens=10), prefill=False)
    generation.prefill_step(2)  # the cached prefix is taken at the first step, then a chunk follows it
    assert generation.cache.length == 32 and generation.stats.cached_tokens == 30
    while not generation.prefill_step(2):
        pass
    while not generation.done:
        generation.step()
    assert generation.result().token_ids == Engine(model, None).generate(prompt, GenerationConfig(max_new_tokens=10)).token_ids


def test_the_prefix_store_keeps_its_budget_and_drops_the_oldest(tiny):
    from verispec.models.prefixes import MIN_REUSE, PrefixStore

    runner = tiny[0].runner
    per_position = runner.cache_bytes_per_position
    store = PrefixStore(runner, budget=100 * per_position)

    def cache_of(tokens):
        cache = runner.new_cache(len(tokens) + 4)
        runner.forward(cache, torch.tensor(tokens), logits="none")
        return cache

    a, b, c = [1] * 40, [2] * 40, [3] * 40
    for tokens in (a, b):
        store.keep(tokens, cache_of(tokens))
    assert store.positions == 80
    store.keep(a[:30], cache_of(a[:30]))  # already held (a prefix of an entry): nothing new
    assert store.positions == 80
    store.keep(c, cache_of(c))  # 120 > 100 positions: the oldest (a) goes
    assert store.positions == 80 and store.take(a + [5], 64) is None
    taken = store.take(b + [5], 64)
    assert taken.length == 40 and taken.capacity == 64
    assert store.take(b[:20], 64).length == 19  # the last prompt token is always fed
    assert store.take(b[: MIN_REUSE - 1] + [9, 9], 64) is None  # too short a match to copy
    store.keep(b + [6] * 20, cache_of(b + [6] * 20))  # extends b: replaces it
    assert store.positions == 100
    store.keep([7] * 120, cache_of([7] * 120))  # larger than the whole budget: never stored
    assert store.positions == 100
    running = cache_of(b + [6] * 30)  # a running request's cache: the tokens it holds count, not those it is given
    assert store.take(b + [6] * 40, 80, running=[(b + [6] * 40, running)]).length == 70  # longer than the entry's 60
    assert store.take(b + [6] * 40, 80, running=[(b, cache_of(b))]).length == 60  # shorter: the entry's
    assert store.positions == 100  # running caches are read, never kept


def _served_together(engine: Engine, prompts: list[list[int]], config: GenerationConfig, prefill_chunk: int | None = 4):
    """(scheduler, jobs, each job's token ids): `prompts` submitted at once to a real scheduler's thread, chunks of
    `prefill_chunk` (None: `prefill_chunks`, as a server measures them)."""
    from verispec.serving.http.scheduler import Scheduler

    scheduler = Scheduler(engine, max_batch=8, prefill_chunk=prefill_chunk)

    async def run():
        jobs = [scheduler.submit(list(prompt), config) for prompt in prompts]
        scheduler.start()
        try:
            return jobs, await token_ids(jobs)
        finally:
            scheduler.stop()

    return scheduler, *asyncio.run(run())


@pytest.mark.parametrize("drafter", ["plain", "ngram", "hybrid"])
def test_a_server_with_prompt_caching_gives_each_request_its_answer_alone(tiny, tiny_draft48, drafter):
    """Requests sharing a system-prompt-like head, all at once through the real scheduler (chunked
    prefill after the cached head, shared passes): each answer equals a fresh engine's answer alone; `hybrid` as the
    plan builds it, its draft reading a long prompt's start and end (a window of 8 here), its prefill chunked too."""
    model = LoadedModel("kq", tiny[0].folder, tiny[0].runner, tiny[0].tokenizer, frozenset())  # no eos: full lengths
    head = list(range(3, 23))  # 20 tokens
    prompts = [head + [30 + i] * (i + 1) for i in range(4)]
    config = GenerationConfig(max_new_tokens=12)
    alone = [Engine(model, None).generate(prompt, config).token_ids for prompt in prompts]
    drafters = {"plain": lambda: None, "ngram": lambda: NgramDrafter(max_n=3),
                "hybrid": lambda: HybridDrafter(DraftModelDrafter(tiny_draft48, model.vocab_size), window=8)}
    engine = Engine(model, drafters[drafter](), gamma=3, gamma_policy="constant")
    engine.generate(head + [44, 45], config)  # leaves the head in the store
    scheduler, jobs, answers = _served_together(engine, prompts, config)
    assert [job.generation.stats.cached_tokens for job in jobs] == [20] * 4
    # they shared passes: all four, but a draft's prefill is a prefill turn of its own per request, so with `hybrid`
    # the first may finish its 12 tokens before the last begins
    shared = max(len(turn.stepped) for turn in scheduler.turns)
    assert shared == 4 or (drafter == "hybrid" and shared >= 2)
    assert answers == alone
    assert drafter == "plain" or sum(job.generation.stats.proposed_tokens for job in jobs) > 0  # the drafts were judged


def test_a_quiet_server_prefills_in_larger_chunks_and_answers_the_same(tiny, monkeypatch):
    """On kquant (prefix-invariant) a prompt fed while no request decodes goes in the idle chunk (sized to
    IDLE_PREFILL_BUDGET_SECONDS: 128 tokens here), one fed while another request decodes in the busy chunk (16):
    the answer is the same both ways and a fresh engine's alone, greedy and sampled."""
    import verispec.serving.http.scheduler as scheduling

    monkeypatch.setattr(scheduling, "prefill_seconds_per_token", lambda model, chunk: 0.15 / 16)
    monkeypatch.setattr(scheduling, "riding_seconds", lambda model, chunk: chunk * 0.15 / 16)  # alone or riding alike
    model = LoadedModel("kq", tiny[0].folder, tiny[0].runner, tiny[0].tokenizer, frozenset())  # no eos: full lengths
    long, short = [3 + (i * 5) % 44 for i in range(100)], [7, 8, 9]
    engine = Engine(model, None)
    try:
        for config in (GenerationConfig(max_new_tokens=30), GenerationConfig(max_new_tokens=30, seed=3,
                                                                             sampling=SamplingParams(temperature=1.0))):
            alone = Engine(model, None).generate(long, config).token_ids
            answers, chunks = [], []
            for prompts in ([long], [short, long]):  # alone; beside a short prompt that decodes while it prefills
                engine.prefixes._entries.clear()
                scheduler, jobs, tokens = _served_together(engine, prompts, config, prefill_chunk=None)
                assert (scheduler.prefill_chunk, scheduler.idle_prefill_chunk) == (16, 128)
                answers.append(tokens[-1])
                chunks.append([turn.prefilled[jobs[-1].id] for turn in scheduler.turns if jobs[-1].id in turn.prefilled])
            assert chunks == [[100], [16] * 6 + [4]]
            assert answers == [alone, alone]
    finally:
        engine.prefixes.file.unlink(missing_ok=True)


@pytest.mark.parametrize("drafter", ["plain", "ngram", "hybrid"])
def test_a_prompt_chunk_rides_in_the_decoding_requests_pass_and_changes_no_answer(tiny, tiny_draft48, drafter):
    """On kquant a busy server feeds a prompt's chunks in the pass that verifies the decoding requests (`Turn.mixed`):
    a 100-token prompt beside two short ones already decoding, greedy and seeded sampled, every answer equal to a
    fresh engine's alone; the chunk with the prompt's last token gives the first token in that pass (a draft's own
    prefill, `hybrid`'s, goes in a pass of its own)."""
    model = LoadedModel("kq", tiny[0].folder, tiny[0].runner, tiny[0].tokenizer, frozenset())  # no eos: full lengths
    long = [3 + (i * 5) % 44 for i in range(100)]
    prompts = [[7, 8, 9], [20, 21, 22, 20], long]
    drafters = {"plain": lambda: None, "ngram": lambda: NgramDrafter(max_n=3),
                "hybrid": lambda: HybridDrafter(DraftModelDrafter(tiny_draft48, model.vocab_size), window=8)}
    for config in (GenerationConfig(max_new_tokens=30), GenerationConfig(max_new_tokens=30, seed=3,
                                                                         sampling=SamplingParams(temperature=1.0))):
        alone = [Engine(model, drafters[drafter](), gamma=3, gamma_policy="constant").generate(p, config).token_ids
                 for p in prompts]
        engine = Engine(model, drafters[drafter](), gamma=3, gamma_policy="constant")
        engine.prefixes = None  # each prompt fed whole, never taken from the store
        scheduler, jobs, answers = _served_together(engine, prompts, config, prefill_chunk=16)
        rides = [(turn.prefilled[jobs[2].id], turn.mixed, len(turn.stepped)) for turn in scheduler.turns
                 if jobs[2].id in turn.prefilled]
        assert [ride for ride in rides if ride[0]] == [(16, True, 2)] * 6 + [(4, True, 2)], rides
        assert all(not mixed for fed, mixed, _ in rides if not fed)  # a draft's own prefill: a pass of its own
        riding = sum(sum(turn.prefilled.values()) for turn in scheduler.turns if turn.mixed)
        assert riding >= 100 and f"verispec_prompt_tokens_riding_total {riding}\n" in scheduler.metrics.render()
        assert answers == alone


def test_a_riding_prompt_chunk_that_fails_fails_its_request_only(tiny):
    """A pass whose prompt row breaks (here: any pass holding a row that wants no logits for every position, and that
    row's forward alone) falls back to each row alone: the riding request fails, the decoding ones go on as alone."""
    model = LoadedModel("kq", tiny[0].folder, tiny[0].runner, tiny[0].tokenizer, frozenset())  # no eos: full lengths
    runner = model.runner
    short, long = [7, 8, 9], [3 + (i * 5) % 44 for i in range(40)]
    config = GenerationConfig(max_new_tokens=12)
    alone = Engine(model, None).generate(short, config).token_ids
    engine = Engine(model, None)
    engine.prefixes = None
    ragged, forward = runner.forward_ragged, runner.forward
    broken = {}

    def ragged_breaking(caches, feeds, positions=None, masks=None, logits="all"):
        if not isinstance(logits, str) and "none" in logits:
            broken.setdefault("cache", caches[list(logits).index("none")])
            raise RuntimeError("a broken prompt row")
        return ragged(caches, feeds, positions, masks, logits)

    def forward_breaking(cache, *args, **kwargs):
        if cache is broken.get("cache"):
            raise RuntimeError("a broken prompt row, alone too")
        return forward(cache, *args, **kwargs)

    runner.forward_ragged, runner.forward = ragged_breaking, forward_breaking
    try:
        from verispec.serving.http.scheduler import Scheduler

        scheduler = Scheduler(engine, max_batch=8, prefill_chunk=8)

        async def run():
            jobs = [scheduler.submit(list(prompt), config) for prompt in (short, long)]
            scheduler.start()
            try:
                return await asyncio.gather(*(token_ids([job]) for job in jobs), return_exceptions=True)
            finally:
                scheduler.stop()

        first, second = asyncio.run(run())
    finally:
        del runner.forward_ragged, runner.forward
    assert first == [alone]
    assert isinstance(second, RuntimeError) and "alone too" in str(second)
    assert scheduler.active_count == 0 and scheduler.reserved_tokens == 0


def test_a_prompt_prefilled_meanwhile_is_reused_by_a_request_admitted_before(tiny):
    """A server's n choices: both admitted, then the first prefilled: the second takes its prompt from the first's
    running cache at its first prefill step (all but the last token) and answers as the first does."""
    from verispec.engine.loop import Generation

    model = tiny[0]
    engine = Engine(model, None)
    prompt, config = list(range(5, 45)), GenerationConfig(max_new_tokens=8)
    first = Generation(engine, prompt, config, prefill=False)
    second = Generation(engine, prompt, config, prefill=False)
    try:
        while not first.prefill_step(16):
            pass
        second.prefill_step(16, running=[(first.ids, first.cache)])
        assert second.cache.length == len(prompt) and second.stats.cached_tokens == len(prompt) - 1
        for generation in (first, second):
            while not generation.done:
                generation.step()
        assert first.result().token_ids == second.result().token_ids
    finally:
        engine.prefixes.file.unlink(missing_ok=True)


def test_requests_over_one_document_prefill_it_once(tiny):
    """Four requests sharing a 40-token document, each with its own question, submitted together (chunks of 4):
    the first to begin prefills the document, the others wait until its cache holds it, copy it from there
    and prefill only their question; each answers as a fresh engine alone does (greedy, and sampled)."""
    model = LoadedModel("kq", tiny[0].folder, tiny[0].runner, tiny[0].tokenizer, frozenset())  # no eos: full lengths
    document = [3 + (i * 7) % 44 for i in range(40)]
    prompts = [document + [30 + i] * (2 + 3 * i) for i in range(4)]  # questions of 2, 5, 8 and 11 tokens
    configs = [GenerationConfig(max_new_tokens=6), GenerationConfig(max_new_tokens=6, seed=7,
                                                                   sampling=SamplingParams(temperature=1.0))]

    def prompt_lookup() -> Engine:
        return Engine(model, NgramDrafter(max_n=3), gamma=3, gamma_policy="constant")

    engine = prompt_lookup()
    try:
        for config in configs:
            engine.prefixes._entries.clear()
            alone = [prompt_lookup().generate(prompt, config).token_ids for prompt in prompts]
            scheduler, jobs, answers = _served_together(engine, prompts, config)
            fed = sum(sum(turn.prefilled.values()) for turn in scheduler.turns)
            assert fed == sum(map(len, prompts)) - 3 * len(document), [turn.prefilled for turn in scheduler.turns]
            assert sorted(job.generation.stats.cached_tokens for job in jobs) == [0, 40, 40, 40]
            assert "verispec_prompt_tokens_cached_total 120" in scheduler.metrics.render()
            assert answers == alone
    finally:
        engine.prefixes.file.unlink(missing_ok=True)


def test_a_prompt_others_wait_for_is_prefilled_before_shorter_ones(tiny):
    """Worker turns by hand (chunks of 4): A begins a 40-token document; B shares it and waits; E, a short unrelated
    prompt, would go first by the fewest-tokens rule, but A goes on while B waits for it (E only when passed over
    STARVATION_TURNS turns), until A holds the document; then B, passed over longest, starts from A's cache."""
    from verispec.serving.http.scheduler import STARVATION_TURNS, Scheduler

    assert STARVATION_TURNS == 4  # the expected order below counts on it
    engine = Engine(tiny[0], None)
    scheduler, loop = Scheduler(engine, prefill_chunk=4), asyncio.new_event_loop()
    config = GenerationConfig(max_new_tokens=2)
    document = [3 + (i * 7) % 44 for i in range(40)]
    a = scheduler.submit(document + [30, 31], config, loop)
    scheduler._admit()
    assert list(scheduler._prefill()) == [a.id]
    b, e = scheduler.submit(document + [32] * 5, config, loop), scheduler.submit([40, 41, 42, 43, 44, 45, 46, 47], config, loop)
    scheduler._admit()
    names = {a.id: "a", b.id: "b", e.id: "e"}
    fed = [names[next(iter(scheduler._prefill()))] for _ in range(7)]
    assert fed == ["a"] * 5 + ["e"] + ["a"], fed  # fewest tokens first would have fed E first, twice
    fed = [names[next(iter(scheduler._prefill()))] for _ in range(4)]
    assert fed == ["a"] * 3 + ["b"], fed  # A reaches 40 tokens, then B (waiting since turn 1) goes
    assert a.generation.cache.length == 40 and b.generation.stats.cached_tokens == 40
    loop.close()


def test_a_servers_n_choices_prefill_their_prompt_once(tiny):
    """n = 3 over a 40-token prompt in chunks of 4: the first choice prefills it (10 turns), the others wait, then
    take it from the prompt cache (one turn each); every choice answers as the request alone does."""
    import httpx
    from server_helpers import LocalServer

    from verispec.serving.http import create_app

    model = tiny[0]
    engine = Engine(model, None)
    prompt = [3 + (i * 7) % 44 for i in range(40)]  # 40 tokens of the 48-token vocabulary
    app = create_app(engine, model_name="tiny", prefill_chunk=4)
    try:
        with LocalServer(app) as server:
            reply = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 4,
                                                                     "temperature": 0, "n": 3}, timeout=60).json()
            prefills = [turn.prefilled for turn in app.state.scheduler.turns if turn.prefilled]
        assert len(prefills) == 10 + 2, (prefills, reply)
        alone = Engine(model, None)
        alone.prefixes._entries.clear()
        text = model.tokenizer.decode(alone.generate(prompt, GenerationConfig(max_new_tokens=4)).token_ids, skip_special_tokens=True)
        assert [choice["text"] for choice in reply["choices"]] == [text] * 3
    finally:
        engine.prefixes.file.unlink(missing_ok=True)
