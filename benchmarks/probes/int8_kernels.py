"""Microbenchmark of CPU linear kernels for the quantized model path (issue #8).

For each weight shape of Qwen2.5-Coder-1.5B (and 0.5B with --draft) and each row count M (the
positions of one forward: 1 = decode, γ+1 = verification), every candidate computes y = x Wᵀ on the
same x. The candidates run interleaved (one call each, in rotating order, repeated) and the report
gives medians in ms, plus each candidate's time relative to packed fp32 at the same M.

Candidates:
  fp32-packed     PackedLinear: fp32 weights prepacked for oneDNN (today's path)
  fbgemm-dyn      quantized.linear_dynamic: int8 per-channel weights, per-TENSOR dynamic activations
                  (not batch-invariant: a row's result depends on the other rows of the call)
  fbgemm-row      the same fbgemm kernel with per-ROW activation scales: each row is divided by its
                  absmax, quantized with one fixed scale (1/63, zero point 64: 7-bit, so AVX2's int16
                  pair sums cannot saturate), multiplied back after (batch-invariant)
  int-mm-row      per-row int8 activations, torch._int_mm (int8×int8→int32), scales applied after
  w8-pack-mm      torch._weight_int8pack_mm: int8 weight-only, fp32 activations
  int8-residual   verispec's `Int8Linear`: fbgemm-row plus a second 7-bit row per row holding the
                  rounding error (≈14-bit activations), both rows in one call (batch-invariant)
  onednn-q        onednn.qlinear_pointwise with prepacked int8 weights, per-row normalised activations
                  like fbgemm-row (uint8 input, fixed scale)

    python benchmarks/probes/int8_kernels.py --threads 2 --repeats 15 [--draft] [--check] [--candidates fbgemm-row,…]

--check also prints whether each batch-invariant candidate gives bit-identical rows for M=1 and M=5.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from verispec.models.int8 import Int8Linear
from verispec.models.linear import PackedLinear

SHAPES_15B = {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960), "head": (151936, 1536)}
SHAPES_05B = {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864), "head": (151936, 896)}


def _per_channel(weight: torch.Tensor):
    scales = (weight.abs().amax(dim=1) / 127.0).clamp_min(1e-12)  # [out]
    q = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)  # [out, in]
    return q, scales


def candidates(weight: torch.Tensor) -> dict:
    out_features, in_features = weight.shape
    q, scales = _per_channel(weight)
    found = {}

    packed = PackedLinear(weight)
    found["fp32-packed"] = packed

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qw = torch.quantize_per_channel(weight, scales.double(), torch.zeros(out_features, dtype=torch.long), 0, torch.qint8)
    prepacked = torch.ops.quantized.linear_prepack(qw, None)
    found["fbgemm-dyn"] = lambda x: torch.ops.quantized.linear_dynamic(x, prepacked, True)

    def fbgemm_row(x):
        absmax = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)  # [M, 1]
        y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(x / absmax, 1.0 / 63.0, 64, prepacked)
        return y * absmax

    found["fbgemm-row"] = fbgemm_row
    residual = Int8Linear.from_float(weight)  # verispec's layer: per-row 7-bit + 7-bit residual rows, one fbgemm call
    found["int8-residual"] = residual

    qt = q.t().contiguous()  # [in, out]

    def int_mm_row(x):
        row_scale = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / 127.0  # [M, 1]
        xq = torch.round(x / row_scale).to(torch.int8)
        return torch._int_mm(xq, qt) * (row_scale * scales)  # [M, out]

    found["int-mm-row"] = int_mm_row
    found["w8-pack-mm"] = lambda x: torch._weight_int8pack_mm(x, q, scales)

    try:
        onednn_w = torch.ops.onednn.qlinear_prepack(q, None)
        w_scales, w_zp = scales.float(), torch.zeros(out_features, dtype=torch.long)

        def onednn_q(x):
            absmax = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
            xq = torch.round(x / absmax * 63.0 + 64.0).to(torch.uint8)
            y = torch.ops.onednn.qlinear_pointwise(xq, 1.0 / 63.0, 64, onednn_w, w_scales, w_zp, None, 1.0, 0,
                                                   torch.float32, "none", [], "")
            return y * absmax

        found["onednn-q"] = onednn_q
    except Exception as e:  # noqa: BLE001
        print(f"onednn-q unavailable: {e}")
    return found


CLOCK = time.perf_counter  # --cpu-time: time.process_time (CPU seconds of all threads; robust to descheduling)


def timed(fn, x) -> float:
    start = CLOCK()
    fn(x)
    return CLOCK() - start


def bench_shape(name, shape, rows, repeats, check, keep=None):
    torch.manual_seed(0)
    weight = torch.randn(shape) * 0.02
    cands = candidates(weight)
    if keep:
        cands = {c: fn for c, fn in cands.items() if c in keep or c == "fp32-packed"}
    print(f"\n{name} {shape[0]}×{shape[1]}: median ms (ratio to fp32-packed)")
    print("M".rjust(4) + "".join(c.rjust(20) for c in cands))
    for m in rows:
        x = torch.randn(m, shape[1])
        usable = {}
        for c, fn in cands.items():
            try:
                fn(x)
                usable[c] = fn
            except RuntimeError as e:
                usable[c] = None
                print(f"  {c} fails at M={m}: {str(e).splitlines()[0][:100]}")
        times = {c: [] for c in usable if usable[c] is not None}
        for c in times:  # warm-up: first calls allocate and pack
            for _ in range(3):
                usable[c](x)
        for r in range(repeats):
            order = list(times)
            order = order[r % len(order):] + order[: r % len(order)]
            for c in order:
                times[c].append(timed(usable[c], x))
        base = statistics.median(times["fp32-packed"])
        line = f"{m:4d}"
        for c in cands:
            if c not in times:
                line += "n/a".rjust(20)
                continue
            med = statistics.median(times[c])
            line += f"{med * 1e3:9.3f} ({med / base:4.2f}×)".rjust(20)
        print(line)
    if check:
        x = torch.randn(5, shape[1])
        for c in ("fbgemm-row", "int8-residual", "int-mm-row", "w8-pack-mm", "onednn-q", "fbgemm-dyn", "fp32-packed"):
            if c not in cands:
                continue
            try:
                together = cands[c](x)
                alone = torch.cat([cands[c](x[i : i + 1]) for i in range(5)])
                print(f"  {c}: rows of M=5 bit-identical to M=1 calls: {torch.equal(together, alone)}"
                      f" (max diff {float((together - alone).abs().max()):.3g})")
            except RuntimeError as e:
                print(f"  {c}: {str(e).splitlines()[0][:100]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rows", default="1,2,3,5,8,16")
    parser.add_argument("--shapes", default=None, help="comma list of qkv,o,gate_up,down,head (default all)")
    parser.add_argument("--candidates", default=None, help="comma list of candidates to run (default all)")
    parser.add_argument("--draft", action="store_true", help="the 0.5B draft's shapes instead of the 1.5B target's")
    parser.add_argument("--check", action="store_true", help="check batch invariance (M=5 vs five M=1 calls)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time with process CPU seconds (all threads) instead of wall time: on a loaded machine "
                             "descheduling inflates wall time at random, CPU time much less")
    args = parser.parse_args()
    global CLOCK
    if args.cpu_time:
        CLOCK = time.process_time
    torch.set_num_threads(args.threads)
    shapes = SHAPES_05B if args.draft else SHAPES_15B
    names = args.shapes.split(",") if args.shapes else list(shapes)
    print(f"torch {torch.__version__}, {args.threads} threads, {torch.backends.cpu.get_cpu_capability()}, "
          f"{args.repeats} interleaved repeats, {'CPU' if args.cpu_time else 'wall'} time")
    with torch.inference_mode():
        for name in names:
            bench_shape(name, shapes[name], [int(r) for r in args.rows.split(",")], args.repeats, args.check,
                        args.candidates.split(",") if args.candidates else None)


if __name__ == "__main__":
    main()
