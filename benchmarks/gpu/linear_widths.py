"""Where a GPU step's T(2)/T(1) comes from: each kind of kernel of a decoder layer timed at 1 … --max-m rows.

On an H100, SmolLM2-135M's replayed step costs 2.03 ms at one position and 2.34 at two, then stays nearly flat
(1.27× at 64; BENCHMARKS.md "GPU"): speculation there is bounded by that first step. This times, for the
shapes of a shipped model (`configs.json`), each linear layer (`F.linear`, bfloat16: cuBLAS picks a
matrix-vector kernel for one row, a matrix kernel for more) and the static attention (`F.scaled_dot_product_attention`
over a whole pooled storage under a mask, as `Transformer.forward_static` calls it) at M = 1 … --max-m query rows
(each linear also as W @ xᵀ, the rows as the product's small side: cuBLAS chooses its kernel by shape),
each as the median of --repeats replays of a CUDA graph of --calls back-to-back calls (launch costs out), and the
same linears with `torch.compile(mode="max-autotune-no-cudagraphs")` where --compile is given, and on a GPU
verispec's row-invariant Triton kernel (`models/cuda_linear.py`). Each record also says whether
row 0 got the same bits as alone (cuBLAS, the Triton kernel, the attention). One JSON line per (kernel, M).
On the GPU machine: PYTHONPATH=src python benchmarks/gpu/linear_widths.py --model smollm2-135m-instruct
Smoke test on a CPU (no graphs, tiny shapes): --device cpu --tiny.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from verispec.models.cuda_linear import RowsLinear

CONFIGS = Path(__file__).with_name("configs.json")
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 512}


def shapes(config: dict) -> dict[str, tuple[int, int]]:
    """{linear: (in features, out features)} of one decoder layer, and the output head."""
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    return {"qkv": (hidden, (heads + 2 * kv_heads) * head_dim), "o": (heads * head_dim, hidden),
            "gate_up": (hidden, 2 * config["intermediate_size"]), "down": (config["intermediate_size"], hidden),
            "head": (hidden, config["vocab_size"])}


def timed(run, device: torch.device, calls: int, repeats: int) -> float:
    """Seconds per call of `run()`: a CUDA graph of `calls` calls replayed `repeats` times (the median), or on a
    CPU the calls run directly."""
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                run()
        replay = graph.replay
    else:
        def replay():
            for _ in range(calls):
                run()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        replay()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a name in configs.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="shrunk shapes (a CPU smoke test)")
    parser.add_argument("--max-m", type=int, default=16)
    parser.add_argument("--capacity", type=int, default=512, help="the pooled storage the attention runs over")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile(max-autotune) linears")
    parser.add_argument("--out", type=Path, default=Path("linear_widths.jsonl"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = {**json.loads(CONFIGS.read_text())[args.model], **(TINY if args.tiny else {})}
    records = []

    def emit(record: dict) -> None:
        records.append(record)
        print(json.dumps(record), flush=True)
        args.out.write_text("".join(json.dumps(r) + "\n" for r in records))

    emit({"kind": "env", "model": args.model, "device": str(device), "torch": torch.__version__,
          "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None, "dtype": str(dtype)})
    compiled = torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False) if args.compile else None
    for name, (inputs, outputs) in shapes(config).items():
        weight = torch.randn(outputs, inputs, device=device, dtype=dtype)  # [out, in]
        rows = RowsLinear(weight) if device.type == "cuda" else None  # the row-invariant Triton kernel (cuda_linear.py)
        first = torch.randn(1, inputs, device=device, dtype=dtype)  # [1, in]: the row whose bits are compared
        for m in range(1, args.max_m + 1):
            x = torch.cat([first, torch.randn(m - 1, inputs, device=device, dtype=dtype)])  # [m, in]
            record = {"kind": "linear", "name": name, "in": inputs, "out": outputs, "m": m,
                      "seconds": timed(lambda: F.linear(x, weight), device, args.calls, args.repeats),
                      # the same product with the rows as the small side of W @ xᵀ: another cuBLAS kernel choice
                      "weight_first_seconds": timed(lambda: (weight @ x.T).T, device, args.calls, args.repeats),
                      # row 0 as alone: whether cuBLAS gives it the same bits at m rows
                      "same_bits": torch.equal(F.linear(x, weight)[0], F.linear(first, weight)[0])}
            if compiled is not None:
                record["compiled_seconds"] = timed(lambda: compiled(x, weight), device, args.calls, args.repeats)
            if rows is not None:
                record["rows_kernel_seconds"] = timed(lambda: rows(x), device, args.calls, args.repeats)
                record["rows_kernel_same_bits"] = torch.equal(rows(x)[0], rows(first)[0])
            emit(record)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    keys = torch.randn(1, kv_heads, args.capacity, head_dim, device=device, dtype=dtype)  # [1, kv_heads, capacity, hd]
    values = torch.randn_like(keys)
    first = torch.randn(1, heads, 1, head_dim, device=device, dtype=dtype)  # [1, heads, 1, hd]
    attend = lambda q, mask: F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)  # noqa: E731
    for m in range(1, args.max_m + 1):
        q = torch.cat([first, torch.randn(1, heads, m - 1, head_dim, device=device, dtype=dtype)], dim=2)  # [1, heads, m, hd]
        mask = torch.ones(m, args.capacity, dtype=torch.bool, device=device)  # [m, capacity]
        mask[:, args.capacity // 2:] = False
        emit({"kind": "attention", "m": m, "capacity": args.capacity,
              "seconds": timed(lambda: attend(q, mask), device, args.calls, args.repeats),
              "same_bits": torch.equal(attend(q, mask)[:, :, 0], attend(first, mask[:1])[:, :, 0])})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
