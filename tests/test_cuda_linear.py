"""The GPU's row-invariant linear (`models/cuda_linear.py`): the kernel's indexing, masking and bias through
Triton's CPU interpreter on any machine, its bits and the routing of a target's layers on a GPU."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from verispec.models.cuda_linear import MAX_ROWS, RowsLinear, _block_n, rows_kernel_wanted
from verispec.models.linear import PackedLinear

triton = pytest.importorskip("triton")

# run in a fresh interpreter: TRITON_INTERPRET is read when Triton is imported
INTERPRETED = textwrap.dedent("""
    import torch
    from verispec.models.cuda_linear import MAX_ROWS, RowsLinear

    generator = torch.Generator().manual_seed(0)
    for dtype, bound in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        for out_features, in_features, with_bias in ((70, 200, True), (96, 128, False), (17, 64, True)):
            weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
            bias = torch.randn(out_features, generator=generator).to(dtype) if with_bias else None
            layer = RowsLinear(weight, bias)
            x = torch.randn(MAX_ROWS, in_features, generator=generator).to(dtype)
            whole = layer(x)  # [16, out]
            reference = x.double() @ weight.double().T + (bias.double() if with_bias else 0)
            error = float((whole.double() - reference).norm() / reference.norm())
            assert whole.dtype == dtype and error < bound, (dtype, out_features, error)
            for rows in range(1, MAX_ROWS + 1):  # any rows, any other rows beside them: the same bits
                assert torch.equal(layer(x[:rows]), whole[:rows]), rows
                other = torch.randn(rows, in_features, generator=generator).to(dtype)
                other[0] = x[0]
                assert torch.equal(layer(other)[0], whole[0]), rows
            for rows in (0, MAX_ROWS + 1):
                try:
                    layer(torch.zeros(rows, in_features, dtype=dtype))
                except ValueError as error:
                    assert "rows" in str(error)
                else:
                    raise AssertionError(f"{rows} rows were taken")
    print("every row the same bits")
""")


def test_the_kernel_gives_each_row_the_same_bits_at_any_rows_in_the_interpreter():
    """Against a float64 product (float32 and bfloat16 operands; column counts off the blocks, a bias or none),
    and bit-identical for a row alone or among up to 16 others: what makes a decode step and a verification
    agree. (The interpreter's dot is numpy's, whose sums depend on a row's place in the tile, and it widens
    bfloat16 to float32 first; the GPU test checks the matrix units, a row at any place.)"""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "every row the same bits" in result.stdout


def test_the_blocking_depends_on_the_weight_only():
    """Column blocks: the widest that still gives every multiprocessor a program (never chosen by the rows)."""
    assert _block_n(151936, 132) == 64 and _block_n(6000, 132) == 32 and _block_n(960, 132) == 16
    assert RowsLinear(torch.zeros(960, 64)).block_n == 16


def test_only_a_verifying_target_on_cuda_asks_for_the_kernel(monkeypatch):
    """Off by default; on with VERISPEC_CUDA_LINEAR=rows for CUDA devices only; a CPU layer never routes to it."""
    cuda = torch.device("cuda")
    monkeypatch.delenv("VERISPEC_CUDA_LINEAR", raising=False)
    assert not rows_kernel_wanted(cuda)
    monkeypatch.setenv("VERISPEC_CUDA_LINEAR", "rows")
    assert rows_kernel_wanted(cuda) and not rows_kernel_wanted(torch.device("cpu"))
    assert PackedLinear(torch.randn(8, 8), rows=4).rows_kernel is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_targets_layer_on_the_gpu_gives_each_row_the_same_bits(monkeypatch):
    """On the GPU (bfloat16, the matrix units): a verifying target's layer routes ≤ 16 rows to the kernel, and a
    position's output is the same bits at 1 … 16 rows; a draft's layer (one row) stays cuBLAS."""
    monkeypatch.setenv("VERISPEC_CUDA_LINEAR", "rows")
    generator = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(1536, 576, device="cuda", generator=generator, dtype=torch.bfloat16)
    target, draft = PackedLinear(weight, rows=4), PackedLinear(weight, rows=1)
    assert target.rows_kernel is not None and draft.rows_kernel is None
    x = torch.randn(MAX_ROWS, 576, device="cuda", generator=generator, dtype=torch.bfloat16)
    whole = target(x)
    reference = x.double() @ weight.double().T
    assert float((whole.double() - reference).norm() / reference.norm()) < 1e-2
    for rows in range(1, MAX_ROWS + 1):
        assert torch.equal(target(x[:rows]), whole[:rows]) and torch.equal(target(x[-rows:]), whole[-rows:])
