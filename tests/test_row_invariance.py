"""Row invariance at the runner level: a row's results in a `forward_ragged` pass are the same bits
whatever else the pass holds (issue #34). The server verifies every request's rows in one pass, so
this is what makes a request's output the same alone or among others
(`test_concurrency_identity.py` checks that through the scheduler).

Checked on the float linear layer a target uses (`PackedLinear` laid out for several rows), on
whole runners (float32, bfloat16, int8, Hugging Face) with chains of 1–5 positions, a token tree and
caches of different lengths, in different orders and company; on the tiny test model and on a
random one whose 1536-wide MLP input is where oneDNN's one-row kernel on AVX-512 rounds differently
from its multi-row kernels. Positive controls: PyTorch's dynamic int8 linear (one activation scale
for the whole call) is caught, alone and as a runner's head.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from verispec.models.linear import VERIFY_ROWS, PackedLinear
from verispec.models.loading import load_model
from verispec.models.transformer import ModelConfig, Transformer

ROW_COUNTS = [*range(1, 13), 17, 40]


def rows_that_change(linear, inputs: torch.Tensor) -> list[tuple[int, int]]:
    """(rows in the call, position) where row `inputs[0]` does not give the bits it gives alone."""
    alone = linear(inputs[:1])[0]
    changed = []
    for count in ROW_COUNTS:
        for position in sorted({0, count // 2, count - 1}):
            call = torch.cat([inputs[1 : 1 + position], inputs[:1], inputs[1 + position : count]])
            if not torch.equal(linear(call)[position], alone):
                changed.append((count, position))
    return changed


class PerCallScaleInt8:
    """PyTorch's dynamic int8 linear (`quantize_dynamic`'s kernel): ONE activation scale for the whole
    call, the largest row's, so a row's result depends on the others. The positive control."""

    def __init__(self, weight: torch.Tensor):
        scale = float(weight.abs().max()) / 127
        with warnings.catch_warnings():  # quantized tensor creation warns about a future deprecation
            warnings.simplefilter("ignore")
            quantized = torch.quantize_per_tensor(weight.float(), scale, 0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(quantized, None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x.float(), self.packed).to(x.dtype)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(96, 32), (256, 1536), (1536, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_targets_linear_layer_computes_each_row_alone(dtype, shape, threads):
    """Fails when a row of a target's linear layer changes with the rows beside it in the call (as
    `F.linear` and oneDNN's one-row kernel on AVX-512 do)."""
    torch.set_num_threads(threads)  # the autouse fixture restores it
    g = torch.Generator().manual_seed(sum(shape))
    weight, bias = torch.randn(shape, generator=g).to(dtype), torch.randn(shape[0], generator=g).to(dtype)
    layer = PackedLinear(weight, bias, rows=VERIFY_ROWS)
    if not layer.row_invariant:
        pytest.skip(f"oneDNN cannot pack {dtype} weights on this CPU: the layer runs F.linear, not promised row-invariant")
    inputs = torch.randn(max(ROW_COUNTS), shape[1], generator=g).to(dtype)
    assert rows_that_change(layer, inputs) == []
    padded, plain = layer(inputs[:1]).float(), torch.nn.functional.linear(inputs[:1], weight, bias).float()  # a padded call's row
    assert float((padded - plain).norm() / plain.norm()) < (1e-6 if dtype == torch.float32 else 1e-2)


def test_the_row_check_catches_a_scale_shared_by_the_call():
    """Positive control: one activation scale per call (PyTorch's dynamic int8 linear) makes a row
    depend on a larger row beside it."""
    g = torch.Generator().manual_seed(0)
    inputs = torch.randn(max(ROW_COUNTS), 64, generator=g)
    inputs[1:] *= 10.0  # every other row is larger: the shared scale is theirs
    assert rows_that_change(PerCallScaleInt8(torch.randn(48, 64, generator=g)), inputs) != []


def random_runner(precision: str) -> Transformer:
    """A random one-layer Qwen2-shaped runner (256 wide, a 1536-wide MLP input), weights in memory."""
    config = ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=256, intermediate_size=1536, num_layers=1,
                         num_heads=4, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=10000.0,
                         max_position_embeddings=512, attention_bias=True, tie_word_embeddings=False)
    g = torch.Generator().manual_seed(7)
    shapes = {"model.embed_tokens.weight": (64, 256), "model.norm.weight": (256,), "lm_head.weight": (64, 256)}
    for name, shape in {"input_layernorm.weight": (256,), "post_attention_layernorm.weight": (256,),
                        "self_attn.q_proj.weight": (256, 256), "self_attn.q_proj.bias": (256,),
                        "self_attn.k_proj.weight": (128, 256), "self_attn.k_proj.bias": (128,),
                        "self_attn.v_proj.weight": (128, 256), "self_attn.v_proj.bias": (128,),
                        "self_attn.o_proj.weight": (256, 256), "mlp.gate_proj.weight": (1536, 256),
                        "mlp.up_proj.weight": (1536, 256), "mlp.down_proj.weight": (256, 1536)}.items():
        shapes["model.layers.0." + name] = shape
    weights = {name: (1.0 + 0.1 * torch.randn(shape, generator=g)) if name.endswith("norm.weight")
               else 0.08 * torch.randn(shape, generator=g) for name, shape in shapes.items()}
    dtype = torch.bfloat16 if precision == "bfloat16" else torch.float32
    return Transformer(config, weights, dtype, quant="int8" if precision == "int8" else None, pack_rows=VERIFY_ROWS)


# per row: prefix tokens in its cache, tokens fed (chains of 1–5 positions; the last row is a token tree)
PREFIXES = [5, 1, 12, 7, 3, 9]
FEEDS = [1, 4, 1, 2, 5, 4]
TREE = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)  # root; 2 children; a grandchild


def ragged_mismatches(runner) -> list[str]:
    """Each row fed alone (as the scheduler feeds a request alone), then in passes with other rows (all,
    reversed, pairs): which rows' logits or cached keys/values differ from alone."""
    g = torch.Generator().manual_seed(11)
    vocab = runner.config.vocab_size
    prefixes = [torch.randint(2, vocab, (n,), generator=g) for n in PREFIXES]
    feeds = [torch.randint(2, vocab, (n,), generator=g) for n in FEEDS]
    positions = [None] * (len(FEEDS) - 1) + [PREFIXES[-1] + torch.tensor([0, 1, 1, 2])]
    masks = [None] * (len(FEEDS) - 1) + [TREE]

    def caches(rows):
        made = []
        for i in rows:
            cache = runner.new_cache(32)
            runner.forward(cache, prefixes[i], logits="none")
            made.append(cache)
        return made

    def kv(cache):
        if not hasattr(cache, "keys"):  # the Hugging Face runner keeps its own cache
            return []
        return [cache.keys[:, :, : cache.length], cache.values[:, :, : cache.length]]

    alone = []
    for i in range(len(FEEDS)):
        [cache] = caches([i])
        [logits] = runner.forward_ragged([cache], [feeds[i]], [positions[i]], [masks[i]])
        alone.append((logits, kv(cache)))
    problems = []
    everything = list(range(len(FEEDS)))
    for rows in [everything, everything[::-1], [0, 2], [4, 1], [5, 3], [1, 5]]:
        made = caches(rows)
        got = runner.forward_ragged(made, [feeds[i] for i in rows], [positions[i] for i in rows], [masks[i] for i in rows])
        for i, logits, cache in zip(rows, got, made):
            want_logits, want_kv = alone[i]
            if not torch.equal(logits, want_logits):
                problems.append(f"row {i} among rows {rows}: logits differ by up to {float((logits - want_logits).abs().max()):.3g}")
            elif not all(torch.equal(a, b) for a, b in zip(kv(cache), want_kv)):
                problems.append(f"row {i} among rows {rows}: cached keys/values differ")
    return problems


@pytest.mark.parametrize("precision", ["float32", "bfloat16", "int8", "hf"])
@pytest.mark.parametrize("model", ["tiny", "wide"])
def test_a_rows_logits_do_not_depend_on_the_rest_of_the_pass(tiny_target, model, precision):
    """Fails when a row's logits or cached keys/values in a `forward_ragged` pass change with the other
    rows of the pass (a kernel picked by the row count, a scale shared by the pass, padded attention)."""
    if model == "wide" and precision == "hf":
        pytest.skip("the Hugging Face runner loads folders; it is checked on the tiny model")
    runner = load_model(tiny_target, precision).runner if model == "tiny" else random_runner(precision)
    if precision == "bfloat16" and not all(layer.row_invariant for layer in [runner.lm_head, runner.layers[0].down]):
        pytest.skip("oneDNN cannot pack bfloat16 weights on this CPU: its F.linear layers are not promised row-invariant")
    assert ragged_mismatches(runner) == []


def test_the_ragged_check_catches_a_head_with_a_scale_shared_by_the_pass():
    """Positive control: the float32 runner with PyTorch's dynamic int8 head (one activation scale per
    call) gives rows that change with the pass."""
    runner = random_runner("float32")
    runner.lm_head = PerCallScaleInt8(torch.randn(64, 256, generator=torch.Generator().manual_seed(1)))
    assert ragged_mismatches(runner) != []
