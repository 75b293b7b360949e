"""The GPU's row-invariant kernels (`models/cuda_linear.py`, `models/cuda_attention.py`): their indexing, masking
and sums through Triton's CPU interpreter on any machine, their bits and the routing of a target's layers on a GPU."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from verispec.models.cuda_linear import TILE_ROWS, RowsLinear, _block_n, row_kernels_wanted
from verispec.models.linear import PackedLinear

triton = pytest.importorskip("triton")

# run in a fresh interpreter: TRITON_INTERPRET is read when Triton is imported
INTERPRETED = textwrap.dedent("""
    import torch
    from verispec.models.cuda_linear import RowsLinear

    generator = torch.Generator().manual_seed(0)
    for dtype, bound in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        for out_features, in_features, with_bias in ((70, 200, True), (96, 128, False), (17, 64, True)):
            weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
            bias = torch.randn(out_features, generator=generator).to(dtype) if with_bias else None
            layer = RowsLinear(weight, bias)
            x = torch.randn(40, in_features, generator=generator).to(dtype)
            whole = layer(x)  # [40, out]: three tiles of rows
            reference = x.double() @ weight.double().T + (bias.double() if with_bias else 0)
            error = float((whole.double() - reference).norm() / reference.norm())
            assert whole.dtype == dtype and error < bound, (dtype, out_features, error)
            for rows in (1, 2, 5, 15, 16, 17, 31, 40):  # any rows, any other rows beside them, any place: the same bits
                assert torch.equal(layer(x[:rows]), whole[:rows]), rows
                assert torch.equal(layer(x[-rows:]), whole[-rows:]), rows
                other = torch.randn(rows, in_features, generator=generator).to(dtype)
                other[-1] = x[0]
                assert torch.equal(layer(other)[-1], whole[0]), rows
    print("every row the same bits")
""")


ATTENTION = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from verispec.models.cuda_attention import static_attention

    generator = torch.Generator().manual_seed(1)
    heads, kv_heads, head_dim, capacity = 6, 2, 32, 200  # 200: the storage ends inside a block
    randn = lambda *shape: torch.randn(*shape, generator=generator)

    def reference(q, keys, values, visible):  # float64 attention of q [heads, n, hd]
        return F.scaled_dot_product_attention(q[None].double(), keys[None].double(), values[None].double(),
                                              attn_mask=visible, enable_gqa=True)[0]

    def chain(start, n, capacity):  # [n, capacity]: query i sees slots 0 … start + i
        return torch.arange(capacity)[None, :] <= torch.arange(start, start + n)[:, None]

    for dtype, bound in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        keys, values = randn(kv_heads, capacity, head_dim).to(dtype), randn(kv_heads, capacity, head_dim).to(dtype)
        q = randn(heads, 40, head_dim).to(dtype)
        for start, n in ((0, 1), (0, 40), (63, 2), (130, 5), (160, 40)):  # a prompt, steps, 40 queries from slot 160
            slots, visible = torch.arange(start, start + n), chain(start, n, capacity)
            out = static_attention(q[:, :n], keys, values, visible, slots)
            want = reference(q[:, :n], keys, values, visible)
            error = float((out.double() - want).norm() / want.norm())
            assert out.dtype == dtype and error < bound, (dtype, start, n, error)
            for i in sorted({*range(0, n, 3), n - 1}):  # as the decode step there computes it, later slots holding anything
                later = slice(start + i + 1, None)
                keys_then, values_then = keys.clone(), values.clone()
                keys_then[:, later], values_then[:, later] = randn(kv_heads, capacity - start - i - 1, head_dim).to(dtype), 0
                alone = static_attention(q[:, i : i + 1], keys_then, values_then, visible[i : i + 1], slots[i : i + 1])
                assert torch.equal(alone[:, 0], out[:, i]), (dtype, start, n, i)
        slots, visible = torch.arange(0, 40), chain(0, 40, capacity)  # a prompt whole or in two chunks: the same bits
        chunks = [static_attention(q[:, part], keys, values, visible[part], slots[part]) for part in (slice(0, 13), slice(13, 40))]
        assert torch.equal(torch.cat(chunks, dim=1), static_attention(q, keys, values, visible, slots))
        wider = torch.cat([keys, randn(kv_heads, 56, head_dim).to(dtype)], dim=1)  # a larger storage, same first slots
        slots, visible = torch.arange(100, 104), chain(100, 4, capacity)
        padded = torch.cat([visible, torch.zeros(4, 56, dtype=torch.bool)], dim=1)
        assert torch.equal(static_attention(q[:, :4], wider, torch.cat([values, values[:, :56]], dim=1), padded, slots),
                           static_attention(q[:, :4], keys, values, visible, slots))
        tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)  # 0 → 1, 0 → 2 → 3
        visible = torch.cat([torch.ones(4, 90, dtype=torch.bool), tree, torch.zeros(4, capacity - 94, dtype=torch.bool)], 1)
        out = static_attention(q[:, :4], keys, values, visible, torch.arange(90, 94))
        want = reference(q[:, :4], keys, values, visible)
        assert float((out.double() - want).norm() / want.norm()) < bound
    print("every query the same bits")
""")


DECODE = textwrap.dedent("""
    import os
    import sys
    import torch
    from verispec.models.loading import load_model

    folder, replayed, dtype, device = sys.argv[1:]
    runner = load_model(folder, dtype, device=torch.device(device)).runner  # a verifying target (linears for several rows)
    kernels = os.environ["VERISPEC_CUDA_KERNELS"] == "rows"  # verispec's kernels, or torch's (the control)
    assert runner._rows_attention == kernels == (runner.layers[0].qkv.rows_kernel is not None)
    assert runner.graphs == (replayed == "1")
    prompt = torch.tensor([3, 4, 5, 6, 7])
    cache = runner.new_cache(64)
    logits, tokens, plain = runner.forward(cache, prompt, logits="last"), [], []
    for _ in range(12):  # plain decoding: one position per forward
        tokens.append(logits[-1].argmax()[None])
        logits = runner.forward(cache, tokens[-1], logits="all")
        plain.append(logits[0])
    cache = runner.new_cache(64)
    runner.forward(cache, prompt, logits="last")
    wide = [row for i in range(0, 12, 4) for row in runner.forward(cache, torch.cat(tokens[i : i + 4]), logits="all")]
    print(f"the same bits at {sum(torch.equal(a, b) for a, b in zip(plain, wide))} of 12 positions")
    other, alone = runner.new_cache(64), runner.new_cache(64)  # another request's prompt beside a step of this one
    cache.truncate(len(prompt) + 8)
    runner.forward(alone, prompt, logits="none")
    runner.forward(alone, torch.cat(tokens[:8]), logits="none")
    batched = runner.forward_ragged([cache, other], [torch.cat(tokens[8:12]), torch.tensor([9, 8, 7, 6, 5, 4])])[0]
    print("batched as alone:", torch.equal(batched, runner.forward(alone, torch.cat(tokens[8:12]), logits="all")))
""")


def _interpret(script: str, *args: str, **env: str) -> str:
    """stdout of `script` run under Triton's CPU interpreter (a fresh process: Triton reads the flag on import;
    TRITON_INTERPRET="0" in `env`: on the GPU)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path), **env}
    result = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=600)
    if env["TRITON_INTERPRET"] == "1" and "InterpreterError: TypeError('only 0-dimensional arrays" in result.stderr:
        pytest.skip("this Triton's interpreter indexes with 1-element arrays, which numpy ≥ 2.4 refuses "
                    "(triton-lang/triton#9171, fixed after Triton 3.6): the GPU tests check the kernels here")
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_the_linear_gives_each_row_the_same_bits_at_any_rows_in_the_interpreter():
    """Against a float64 product (float32 and bfloat16 operands; column counts off the blocks, a bias or none),
    and bit-identical for a row alone, among others (up to three tiles), at any place: what makes a decode step and a
    verification agree. (The interpreter sums float32 products row by row; the GPU test checks the matrix units.)"""
    assert "every row the same bits" in _interpret(INTERPRETED)


def test_the_attention_gives_each_query_the_same_bits_as_its_decode_step_in_the_interpreter():
    """Against float64 attention (chains crossing blocks, the storage's last block, a token tree, grouped heads),
    and bit-identical to the decode step at the query's position whatever the later slots hold, whatever
    the storage's capacity past the step."""
    assert "every query the same bits" in _interpret(ATTENTION)


def test_the_kernels_refuse_what_they_cannot_compute():
    """No rows, no queries or a head size that is no power of two: refused before any launch."""
    from verispec.models.cuda_attention import static_attention

    with pytest.raises(ValueError, match="row"):
        RowsLinear(torch.zeros(8, 64))(torch.zeros(0, 64))
    for n, head_dim in ((0, 32), (4, 48)):
        with pytest.raises(ValueError, match="query or more"):
            static_attention(torch.zeros(6, n, head_dim), torch.zeros(2, 64, head_dim), torch.zeros(2, 64, head_dim),
                             torch.ones(n, 64, dtype=torch.bool), torch.arange(n))


def test_the_blocking_depends_on_the_weight_only():
    """Column blocks: the widest that still gives every multiprocessor a program (never chosen by the rows)."""
    assert _block_n(151936, 132) == 64 and _block_n(6000, 132) == 32 and _block_n(960, 132) == 16
    assert RowsLinear(torch.zeros(960, 64)).block_n == 16


def test_only_a_verifying_target_on_cuda_asks_for_the_kernel(monkeypatch):
    """Off by default; on with VERISPEC_CUDA_KERNELS=rows for CUDA devices only; a CPU layer never routes to it."""
    cuda = torch.device("cuda")
    monkeypatch.delenv("VERISPEC_CUDA_KERNELS", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not row_kernels_wanted(cuda)
    monkeypatch.setenv("VERISPEC_CUDA_KERNELS", "rows")
    assert row_kernels_wanted(cuda) and not row_kernels_wanted(torch.device("cpu"))
    assert PackedLinear(torch.randn(8, 8), rows=4).rows_kernel is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_targets_layer_on_the_gpu_gives_each_row_the_same_bits(monkeypatch):
    """On the GPU (bfloat16, the matrix units): a verifying target's layer routes to the kernel, and a position's
    output is the same bits at 1 … 35 rows, at any place; a draft's layer (one row) stays cuBLAS."""
    monkeypatch.setenv("VERISPEC_CUDA_KERNELS", "rows")
    generator = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(1536, 576, device="cuda", generator=generator, dtype=torch.bfloat16)
    target, draft = PackedLinear(weight, rows=4), PackedLinear(weight, rows=1)
    assert target.rows_kernel is not None and draft.rows_kernel is None
    x = torch.randn(2 * TILE_ROWS + 3, 576, device="cuda", generator=generator, dtype=torch.bfloat16)
    whole = target(x)
    reference = x.double() @ weight.double().T
    assert float((whole.double() - reference).norm() / reference.norm()) < 1e-2
    for rows in range(1, x.shape[0] + 1):
        assert torch.equal(target(x[:rows]), whole[:rows]) and torch.equal(target(x[-rows:]), whole[-rows:])


@pytest.mark.parametrize("replayed", [False, True], ids=["launched", "replayed"])
def test_a_target_on_the_kernels_scores_a_position_alike_at_every_width(tmp_path, replayed):
    """A whole target on the row-invariant kernels (interpreted, float32; a power-of-two head size): the logits of
    a position verified four at a time are the same bits as plain decoding's, launched or through the static
    forward that a GPU replays, and a step batched with another request's prompt (`forward_ragged`, as a server
    batches) the same as alone. Control: the same runner on torch's kernels (oneDNN, SDPA, whose blocking follows
    the queries) does not keep every position's bits."""
    from tests.conftest import make_tiny_model

    folder = make_tiny_model(tmp_path / "target", seed=3, layers=2, hidden=64)  # 4 heads of 16
    graphs = "everywhere" if replayed else "0"
    out = _interpret(DECODE, str(folder), str(int(replayed)), "float32", "cpu", VERISPEC_CUDA_KERNELS="rows",
                     VERISPEC_CUDA_GRAPHS=graphs)
    assert "the same bits at 12 of 12 positions" in out and "batched as alone: True" in out
    control = _interpret(DECODE, str(folder), str(int(replayed)), "float32", "cpu", VERISPEC_CUDA_KERNELS="torch",
                         VERISPEC_CUDA_GRAPHS=graphs)
    assert "the same bits at " in control and "the same bits at 12 of 12 positions" not in control


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("replayed", [False, True], ids=["launched", "replayed"])
def test_a_target_on_the_gpu_kernels_scores_a_position_alike_at_every_width(tmp_path, replayed):
    """The same on a GPU, compiled, in bfloat16 (the matrix units), launched and as captured CUDA graphs."""
    from tests.conftest import make_tiny_model

    folder = make_tiny_model(tmp_path / "target", seed=3, layers=2, hidden=64)
    out = _interpret(DECODE, str(folder), str(int(replayed)), "bfloat16", "cuda", TRITON_INTERPRET="0",
                     VERISPEC_CUDA_KERNELS="rows", VERISPEC_CUDA_GRAPHS="1" if replayed else "0")
    assert "the same bits at 12 of 12 positions" in out and "batched as alone: True" in out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_attention_on_the_gpu_gives_each_query_its_decode_steps_bits():
    """On the GPU (bfloat16): close to SDPA, and each of 16 queries the same bits as alone at its position."""
    from verispec.models.cuda_attention import static_attention

    generator = torch.Generator(device="cuda").manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, device="cuda", generator=generator, dtype=torch.bfloat16)  # noqa: E731
    keys, values, q = randn(3, 512, 64), randn(3, 512, 64), randn(9, 16, 64)
    slots = torch.arange(300, 316, device="cuda")
    visible = torch.arange(512, device="cuda")[None, :] <= slots[:, None]  # [16, 512]
    out = static_attention(q, keys, values, visible, slots)
    want = torch.nn.functional.scaled_dot_product_attention(q[None].float(), keys[None].float(), values[None].float(),
                                                            attn_mask=visible, enable_gqa=True)[0]
    assert float((out.float() - want).norm() / want.norm()) < 2e-2
    for i in range(16):
        alone = static_attention(q[:, i : i + 1], keys, values, visible[i : i + 1], slots[i : i + 1])
        assert torch.equal(alone[:, 0], out[:, i]), i
