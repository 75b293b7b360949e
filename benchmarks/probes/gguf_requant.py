"""Does a requantized target verify flatter on ggml? Requantize the shipped Q4_K_M GGUF into other
llama.cpp types (`llama_model_quantize`, once, into the cache directory) and time T(n) for n = 1 … 16
new positions of each file, interleaved, with the CPU's flags printed.

    .venv/bin/python benchmarks/probes/gguf_requant.py --types q4_0,iq4_nl --widest 16
"""

from __future__ import annotations

import argparse
import ctypes

import llama_cpp

from verispec.control.costs import measure_verify_curve
from verispec.models.llama_cpp import LlamaCppRunner
from verispec.models.registry import DEFAULT_TARGET, gguf_file
from verispec.paths import cache_dir, cpu_flags
from verispec.progress import status

FTYPES = {"q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, "iq4_nl": llama_cpp.LLAMA_FTYPE_MOSTLY_IQ4_NL,
          "q4_k": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_S, "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}


def requantized(source, kind: str):
    out = cache_dir() / "gguf" / f"{source.stem}.{kind}.gguf"
    if not out.exists():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize, params.nthread = FTYPES[kind], True, 0
        with status(f"requantizing {source.name} to {kind} (once)"):
            if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) != 0:
                raise SystemExit(f"llama_model_quantize failed for {kind}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--types", default="q4_0", help=f"comma list of {', '.join(FTYPES)}")
    parser.add_argument("--widest", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    source = gguf_file(args.model)
    files = [source] + [requantized(source, kind) for kind in args.types.split(",")]
    runners = {f.name: LlamaCppRunner(f, exact=False) for f in files}
    print("cpu flags:", " ".join(f for f in cpu_flags().split() if f.startswith(("avx", "amx", "fma", "f16c"))))
    curves: dict[str, list[list[float]]] = {name: [] for name in runners}
    for _ in range(args.rounds):  # interleaved: the files share the machine's state
        for name, runner in runners.items():
            curves[name].append(measure_verify_curve(runner, args.widest, context=200, repeats=3))
    for name, rounds in curves.items():
        best = [min(r[i] for r in rounds) for i in range(args.widest)]  # [widest] seconds
        size = next(f for f in files if f.name == name).stat().st_size / 2**20
        print(f"{name} ({size:.0f} MiB): T(1) {best[0] * 1e3:.1f} ms; T(n)/T(1) "
              + " ".join(f"{t / best[0]:.2f}" for t in best))


if __name__ == "__main__":
    main()
