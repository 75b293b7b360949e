"""Which 4-bit CPU kernel could verify n positions for the price of one? (issue #31, step 1)

A verifier pays when one pass over n new positions costs about what one position costs: T(n)/T(1)
near 1 up to n ≈ 8, T(1) no worse than llama.cpp's, and every row's result bit-identical whatever n
is (otherwise verification at width n is not lossless against decoding one position at a time). This
probe measures exactly that for each library candidate, so that the kernel is picked by measurement:

  llama.cpp           the whole GGUF model (llama-cpp-python, the reference T(1)): llama_decode over
                      n positions after a 64-token context, logits for every position
  ik_llama.cpp        the same through ik_llama.cpp (`ik-llama-cpp-python`); `ik_llama.cpp-rtr` also
                      repacks the weights at load (ik's run-time repack into its interleaved-row types)
  onnxruntime         a stack of com.microsoft MatMulNBits (4-bit, block 32, accuracy_level 4: int8
                      activations); `onnxruntime-acc1` the same with fp32 activations
  openvino            a stack of int4 (group 32) weight-compressed MatMuls, fused by the CPU plugin into
                      FullyConnected with dynamic int8 activations (group 32); `openvino-f32act` without
  verispec-kquant     the whole GGUF model in verispec's own runner on the file's Q4_K/Q6_K blocks
                      (`--dtype kquant`, `models/kquant.py`): a forward over n positions after the
                      same context, logits for every position
  torchao             torchao's Int8DynamicActivationInt4WeightConfig (da8w4_linear_cpu, group 32);
                      `torchao-int4wo` its int4 weight-only CPU path (aten._weight_int4pack_mm_for_cpu)

The library candidates run a "decoder-matmul stack" of Qwen2.5-Coder-1.5B's shapes: every linear layer
of its 28 layers (q 1536→1536, k and v 1536→256, o 1536→1536, gate and up 1536→8960, down 8960→1536)
and the head (1536→151936), each with its own random weights in the candidate's 4-bit format (so the
weights stream from memory as a model's do) and random activations. A stack has no attention, norms or
sampling: its T(1) is a lower bound of a model built on the kernel, to set against llama.cpp's whole
model. For each n = 1 … --max-n the probe records the best of --repeats seconds per pass (all n
interleaved in each round, after a warm-up pass per n), T(n)/T(1), and whether row 0's output (the
whole model's logits of the first position; the stack's outputs of every layer) is bit-identical to
the n = 1 pass. Each candidate's result is appended to --out as one JSON line as soon as it finishes
(a missing package is a "skipped" line, a failure an "error" line; neither stops the others), and a
table of every result in --out is printed at the end, so runs with different interpreters add up.

Run it on a quiet machine, llama.cpp from the project's venv, the others from a venv that has them
(they are not the project's dependencies; torch there is the CPU build, as scripts/setup.sh installs it):

    .venv/bin/python benchmarks/probes/kernel_candidates.py --candidates llama.cpp,verispec-kquant --out kc.jsonl
    python3 -m venv /tmp/cand && /tmp/cand/bin/pip install torch==2.13.0 torchao onnx onnxruntime \\
        openvino ik-llama-cpp-python
    /tmp/cand/bin/python benchmarks/probes/kernel_candidates.py --out kc.jsonl --candidates \\
        ik_llama.cpp,ik_llama.cpp-rtr,onnxruntime,onnxruntime-acc1,openvino,openvino-f32act,torchao,torchao-int4wo

ik-llama-cpp-python's wheel is built for AVX2 only (a record's info.system_info says what a GGUF
candidate's library uses); to time ik_llama.cpp's AVX-512 kernels, build it for the CPU first:

    CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_IQK_FA_ALL_QUANTS=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 \\
        /tmp/cand/bin/pip install --force-reinstall --no-deps --no-binary ik-llama-cpp-python ik-llama-cpp-python==0.1.5

`--layers 2` times a two-layer stack (a smoke run; no verdict); `--gguf FILE` runs the GGUF candidates
on another file (e.g. one requantized by gguf_requant.py, for ggml's repack path of other 4-bit types),
recorded as `llama.cpp:FILE` so that the reference T(1) stays the shipped Q4_K_M.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 1536, 8960, 28, 151936
KV_WIDTH = 2 * 128  # 2 key/value heads of 128
GROUP = 32  # the 4-bit block (group) size every stack candidate uses
GGUF_NAME = "qwen2.5-coder-1.5b-instruct.gguf"
# verispec.paths.VECTOR_FLAGS, for the interpreters without verispec: the flags that pick kernels
VECTOR_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8",
                "amx_bf16", "asimd", "sve")
# The verdict of issue #31: a kernel is taken if it meets all three.
MAX_T1_VS_LLAMA, MAX_T8_RATIO = 1.1, 1.4


class Unavailable(Exception):
    """A candidate that cannot run in this interpreter or on this CPU (the reason is recorded)."""


# ----------------------------------------------------------------------------------------- the machine

def cpu_line() -> str:
    """verispec's CPU summary where verispec is importable, else the model name and vector flags."""
    try:
        from verispec.paths import cpu_summary
        return cpu_summary()
    except ImportError:
        info = Path("/proc/cpuinfo").read_text().splitlines()
        model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "?")
        flags = next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), [])
        return f"{model}, {os.cpu_count()} CPUs, {' '.join(f for f in VECTOR_FLAGS if f in flags)}"


def has_cpu_flag(flag: str) -> bool:
    return flag in Path("/proc/cpuinfo").read_text().split()


def default_gguf() -> Path:
    base = os.environ.get("VERISPEC_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "verispec"
    return Path(base) / "gguf" / GGUF_NAME


def version_of(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


# ----------------------------------------------------------------------------------------- measuring

class Subject:
    """What the measurement needs of a candidate: one timed pass over n rows, and the first row of a
    pass's result as a flat float array (taken outside the timing)."""

    info: dict[str, Any]

    def forward(self, n: int) -> Any:
        raise NotImplementedError

    def first_row(self, result: Any) -> np.ndarray:
        raise NotImplementedError


def measure(subject: Subject, max_n: int, repeats: int) -> dict[str, Any]:
    """Best-of-`repeats` seconds per pass for n = 1 … max_n (the n interleaved in each round), and row
    0's bit identity between the n = 1 pass and every n."""
    for n in range(1, max_n + 1):  # warm-up: per-shape kernel selection, allocations, first touches
        subject.forward(n)
    rows = [subject.first_row(subject.forward(n)) for n in range(1, max_n + 1)]
    again = subject.first_row(subject.forward(1))
    seconds = [float("inf")] * max_n
    for _ in range(repeats):
        for n in range(1, max_n + 1):
            began = time.perf_counter()
            subject.forward(n)
            seconds[n - 1] = min(seconds[n - 1], time.perf_counter() - began)
    return {
        "seconds": seconds,
        "ratio": [t / seconds[0] for t in seconds],
        "row0_identical": [bool(np.array_equal(row, rows[0])) for row in rows],
        "row0_max_abs_diff": [float(np.max(np.abs(row - rows[0]))) for row in rows],
        "deterministic": bool(np.array_equal(again, rows[0])),  # the same n = 1 pass twice
    }


# ----------------------------------------------------------------------------------------- the stack

@dataclass(frozen=True)
class Linear:
    name: str
    out_features: int
    in_features: int


def stack_linears(layers: int) -> list[Linear]:
    """Every linear layer of `layers` decoder layers of Qwen2.5-Coder-1.5B, then the head."""
    per_layer = [("q", HIDDEN, HIDDEN), ("k", KV_WIDTH, HIDDEN), ("v", KV_WIDTH, HIDDEN), ("o", HIDDEN, HIDDEN),
                 ("gate", INTERMEDIATE, HIDDEN), ("up", INTERMEDIATE, HIDDEN), ("down", HIDDEN, INTERMEDIATE)]
    linears = [Linear(f"l{i}_{name}", out, inp) for i in range(layers) for name, out, inp in per_layer]
    return linears + [Linear("head", VOCAB, HIDDEN)]


@dataclass
class StackInputs:
    """Random activations: x [max_n, hidden] feeds every linear but down, h [max_n, intermediate] feeds down."""

    x: np.ndarray
    h: np.ndarray

    @classmethod
    def random(cls, max_n: int, rng: np.random.Generator) -> StackInputs:
        return cls(rng.standard_normal((max_n, HIDDEN), dtype=np.float32),
                   rng.standard_normal((max_n, INTERMEDIATE), dtype=np.float32) * 0.5)

    def of(self, linear: Linear) -> str:
        return "h" if linear.in_features == INTERMEDIATE else "x"


def random_nibbles(rng: np.random.Generator, out_features: int, in_features: int) -> np.ndarray:
    """Packed random 4-bit weights [out, in / GROUP, GROUP / 2] (two per byte): a format's quantized
    random weights, without the float weights they would be quantized from."""
    return rng.integers(0, 256, (out_features, in_features // GROUP, GROUP // 2), dtype=np.uint8)


def random_scales(rng: np.random.Generator, out_features: int, in_features: int, dtype=np.float32) -> np.ndarray:
    return (rng.random((out_features, in_features // GROUP), dtype=np.float32) * 0.01 + 0.001).astype(dtype)


def rows_of(outputs: list[np.ndarray]) -> np.ndarray:
    """Row 0 of every output, as one flat array."""
    return np.concatenate([np.asarray(out[0], dtype=np.float32).ravel() for out in outputs])


# ----------------------------------------------------------------------------------------- onnxruntime

class OnnxRuntimeStack(Subject):
    """One ONNX graph holding a MatMulNBits node per linear (weights as external data, written one
    linear at a time so that no second copy is ever in memory), run by one CPU session."""

    def __init__(self, linears: list[Linear], inputs: StackInputs, threads: int, rng: np.random.Generator,
                 accuracy_level: int):
        import onnx
        import onnxruntime as ort
        from onnx import TensorProto, helper

        self.inputs = inputs
        folder = tempfile.TemporaryDirectory(prefix="kernel_candidates_onnx_")
        nodes, initializers = [], []
        with open(Path(folder.name) / "weights.bin", "wb") as data:
            for lin in linears:
                weight = external_tensor(data, f"{lin.name}_w", TensorProto.UINT8,
                                         random_nibbles(rng, lin.out_features, lin.in_features))
                scales = external_tensor(data, f"{lin.name}_s", TensorProto.FLOAT,
                                         random_scales(rng, lin.out_features, lin.in_features).ravel())
                initializers += [weight, scales]
                nodes.append(helper.make_node(
                    "MatMulNBits", [inputs.of(lin), weight.name, scales.name], [lin.name], domain="com.microsoft",
                    K=lin.in_features, N=lin.out_features, bits=4, block_size=GROUP, accuracy_level=accuracy_level))
        graph = helper.make_graph(
            nodes, "stack",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", HIDDEN]),
             helper.make_tensor_value_info("h", TensorProto.FLOAT, ["n", INTERMEDIATE])],
            [helper.make_tensor_value_info(lin.name, TensorProto.FLOAT, ["n", lin.out_features]) for lin in linears],
            initializer=initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
        onnx.save(model, str(Path(folder.name) / "stack.onnx"))
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        self.session = ort.InferenceSession(str(Path(folder.name) / "stack.onnx"), options,
                                            providers=["CPUExecutionProvider"])
        folder.cleanup()  # the session holds the weights now
        self.info = {"accuracy_level": accuracy_level, "block_size": GROUP, "zero_points": "none (8)",
                     "providers": self.session.get_providers()}

    def forward(self, n: int) -> list[np.ndarray]:
        return self.session.run(None, {"x": self.inputs.x[:n], "h": self.inputs.h[:n]})

    def first_row(self, result: list[np.ndarray]) -> np.ndarray:
        return rows_of(result)


def external_tensor(data, name: str, data_type: int, array: np.ndarray):
    """A TensorProto whose bytes are appended to the open file `data` (ONNX external data)."""
    from onnx import TensorProto

    tensor = TensorProto(name=name, data_type=data_type, dims=array.shape, data_location=TensorProto.EXTERNAL)
    where = {"location": Path(data.name).name, "offset": str(data.tell()), "length": str(array.nbytes)}
    data.write(np.ascontiguousarray(array).tobytes())
    for key, value in where.items():
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor


# ----------------------------------------------------------------------------------------- OpenVINO

class OpenVinoStack(Subject):
    """One OpenVINO model with an int4 weight-compressed MatMul per linear: i4 constants [out, in/32, 32]
    → f16 × per-group f16 scales → [out, in] → MatMul, the pattern NNCF's INT4_SYM compression writes;
    the CPU plugin fuses each into one FullyConnected that reads the i4 weights."""

    def __init__(self, linears: list[Linear], inputs: StackInputs, threads: int, rng: np.random.Generator,
                 dynamic_quantization_group: int):
        import openvino as ov
        import openvino.opset13 as ops

        self.inputs = inputs
        params = {"x": ops.parameter([-1, HIDDEN], ov.Type.f32, name="x"),
                  "h": ops.parameter([-1, INTERMEDIATE], ov.Type.f32, name="h")}
        outputs, weights = [], []  # the weights are shared with the constants: alive until compiled
        for lin in linears:
            weights.append(ov.Tensor(ov.Type.i4, ov.Shape([lin.out_features, lin.in_features // GROUP, GROUP])))
            weights[-1].data.view(np.uint8)[:] = random_nibbles(rng, lin.out_features, lin.in_features).ravel()
            scales = random_scales(rng, lin.out_features, lin.in_features, np.float16)[..., None]
            dense = ops.multiply(ops.convert(ops.constant(weights[-1], shared_memory=True), ov.Type.f16),
                                 ops.constant(scales))
            dense = ops.reshape(dense, ops.constant(np.array([lin.out_features, lin.in_features], np.int64)), False)
            outputs.append(ops.matmul(params[inputs.of(lin)], ops.convert(dense, ov.Type.f32), False, True))
        model = ov.Model(outputs, list(params.values()), "stack")
        config = {"INFERENCE_NUM_THREADS": threads, "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY",
                  "INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": dynamic_quantization_group}
        self.compiled = ov.Core().compile_model(model, "CPU", config)
        del model, outputs, params, weights
        self.request = self.compiled.create_infer_request()
        self.info = {"config": {k: str(v) for k, v in config.items()}, "weights": "i4, group 32, f16 scales"}

    def forward(self, n: int):
        return self.request.infer({"x": self.inputs.x[:n], "h": self.inputs.h[:n]}, share_inputs=True)

    def first_row(self, result) -> np.ndarray:
        self.info["kernels"] = self.kernels()
        return rows_of(list(result.values()))

    def kernels(self) -> list[str]:
        """The FullyConnected nodes' runtime precisions and primitives (after a pass: they are chosen per shape)."""
        found = set()
        for op in self.compiled.get_runtime_model().get_ordered_ops():
            rt = op.get_rt_info()
            if rt["layerType"].astype(str) == "FullyConnected":
                found.add(f"{rt['runtimePrecision'].astype(str)}:{rt['primitiveType'].astype(str)}")
        return sorted(found)


# ----------------------------------------------------------------------------------------- torchao

class TorchStack(Subject):
    """nn.Linear layers quantized one at a time by a torchao config (the float weights of one layer
    exist only while it is quantized, the largest first), run in inference mode on bf16 activations (torchao's CPU
    recipes; its int4 CPU kernel is about 4× slower on fp32 ones)."""

    def __init__(self, linears: list[Linear], inputs: StackInputs, threads: int, rng: np.random.Generator,
                 config: Callable[[], Any]):
        import torch
        from torchao.quantization import quantize_

        torch.set_num_threads(threads)
        torch.manual_seed(int(rng.integers(1 << 31)))
        self.torch, dtype = torch, torch.bfloat16
        self.inputs = {name: torch.from_numpy(getattr(inputs, name)).to(dtype) for name in ("x", "h")}
        self.layers: list[tuple[str, Any]] = [("", None)] * len(linears)
        # the largest first: quantizing the head takes ~2 GB besides its own weights, held before the rest
        for i in sorted(range(len(linears)), key=lambda i: -linears[i].out_features * linears[i].in_features):
            layer = torch.nn.Linear(linears[i].in_features, linears[i].out_features, bias=False, dtype=dtype)
            with torch.no_grad():
                layer.weight.normal_(0.0, 0.02)
            quantize_(layer, config())
            self.layers[i] = (inputs.of(linears[i]), layer)
            release_freed_memory()
        self.info = {"config": repr(config()), "weight_type": type(self.layers[0][1].weight).__name__,
                     "activations": str(dtype), "torch_threads": torch.get_num_threads()}

    def forward(self, n: int):
        with self.torch.inference_mode():
            rows = {name: tensor[:n] for name, tensor in self.inputs.items()}
            return [layer(rows[source]) for source, layer in self.layers]

    def first_row(self, result) -> np.ndarray:
        return rows_of([out.float().numpy() for out in result])


def release_freed_memory() -> None:
    """Hand memory that glibc keeps after frees back to the system (quantizing leaves gigabytes)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def torchao_da8w4_config():
    import torch

    if "CPU" not in torch._C._dispatch_dump("torchao::da8w4_linear_cpu"):
        raise Unavailable(f"torchao {version_of('torchao')} has no CPU kernel for da8w4_linear_cpu: the PyPI wheel ships "
                          "none (only the x86 CPU build of torchao does), and the kernel needs AMX for its fast path "
                          "(without AMX, cpublas::could_pack fails and it runs scalar C++ loops)")
    if not has_cpu_flag("amx_int8"):
        print("  note: no AMX on this CPU: da8w4_linear_cpu falls back to scalar C++ loops", flush=True)
    from torchao.prototype.quantization.int4 import Int8DynamicActivationInt4WeightConfig
    return partial(Int8DynamicActivationInt4WeightConfig, group_size=GROUP)


def torchao_int4wo_config():
    from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
    return partial(PrototypeInt4WeightOnlyConfig, group_size=GROUP)


# ----------------------------------------------------------------------------------------- GGUF models

@dataclass
class GgufBinding:
    """The few llama.h calls the whole-model measurement makes, from llama-cpp-python or ik-llama-cpp-python
    (ik_llama.cpp keeps the older KV-cache API: llama_kv_cache_seq_rm on the context)."""

    api: Any  # the module with the ctypes functions and structs
    lib: ctypes.CDLL
    seq_rm: Callable[[Any, int, int, int], Any]
    library: str


def llama_cpp_binding() -> GgufBinding:
    import llama_cpp
    from llama_cpp._logger import set_verbose

    set_verbose(False)
    seq_rm = lambda ctx, seq, p0, p1: llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx), seq, p0, p1)
    return GgufBinding(llama_cpp, llama_cpp.llama_cpp._lib, seq_rm, llama_cpp.llama_cpp._lib._name)


def ik_llama_cpp_binding() -> GgufBinding:
    from ik_llama_cpp import _ctypes_api as api

    lib = api._lib
    lib.llama_kv_cache_seq_rm.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32]
    lib.llama_kv_cache_seq_rm.restype = ctypes.c_bool
    return GgufBinding(api, lib, lib.llama_kv_cache_seq_rm, lib._name)


LOG_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
_quiet = LOG_CALLBACK(lambda level, text, data: None)  # kept alive: llama.cpp holds the pointer


def silence(lib: ctypes.CDLL) -> None:
    """llama.cpp's (and ggml's) log to nowhere: loading a model prints hundreds of lines."""
    lib.llama_log_set.argtypes, lib.llama_log_set.restype = [LOG_CALLBACK, ctypes.c_void_p], None
    lib.llama_log_set(_quiet, None)


class GgufModel(Subject):
    """The whole model: a `context`-token prompt decoded once, then each pass removes what follows it
    from the KV cache and decodes n new positions (logits for all of them, as verification needs)."""

    def __init__(self, binding: GgufBinding, path: Path, threads: int, rng: np.random.Generator, context: int,
                 max_n: int, model_params: dict[str, Any], context_params: dict[str, Any]):
        if not path.exists():
            raise Unavailable(f"no GGUF file at {path} (scripts/setup.sh or `verispec` download it)")
        api, self.api, self.binding, self.context = binding.api, binding.api, binding, context
        silence(binding.lib)
        api.llama_backend_init()
        params = api.llama_model_default_params()
        for key, value in model_params.items():
            setattr(params, key, value)
        self.model = api.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise RuntimeError(f"could not load {path}")
        self.vocab = api.llama_vocab_n_tokens(api.llama_model_get_vocab(self.model))
        cparams = api.llama_context_default_params()
        cparams.n_ctx = (context + max_n + 255) // 256 * 256
        cparams.n_batch = cparams.n_ubatch = 512
        cparams.n_threads = cparams.n_threads_batch = threads
        for key, value in context_params.items():
            setattr(cparams, key, value)
        self.ctx = api.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("could not create a llama.cpp context")
        tokens = rng.integers(100, 20000, context + max_n).tolist()  # a prompt, then the positions to verify
        self.batch = api.llama_batch_init(max(context, max_n), 0, 1)
        self.fill(tokens[:context], start=0, logits=False)
        self.decode(context)
        self.fill(tokens[context:], start=context, logits=True)
        lib = binding.lib
        lib.llama_print_system_info.restype = ctypes.c_char_p
        self.info = {"gguf": path.name, "library": binding.library, "context": context, "vocab": self.vocab,
                     "model_params": model_params, "context_params": context_params,
                     "system_info": lib.llama_print_system_info().decode().strip()}

    def fill(self, tokens: list[int], start: int, logits: bool) -> None:
        for i, token in enumerate(tokens):
            self.batch.token[i], self.batch.pos[i], self.batch.logits[i] = token, start + i, logits
            self.batch.n_seq_id[i], self.batch.seq_id[i][0] = 1, 0
        if not logits:  # a prompt: only its last position's logits
            self.batch.logits[len(tokens) - 1] = True

    def decode(self, n: int) -> None:
        self.batch.n_tokens = n
        status = self.api.llama_decode(self.ctx, self.batch)
        if status != 0:
            raise RuntimeError(f"llama_decode of {n} tokens failed (status {status})")

    def forward(self, n: int) -> None:
        self.binding.seq_rm(self.ctx, 0, self.context, -1)
        self.decode(n)

    def first_row(self, result: None) -> np.ndarray:
        return np.ctypeslib.as_array(self.api.llama_get_logits_ith(self.ctx, 0), shape=(self.vocab,)).copy()

    def __del__(self):
        if getattr(self, "ctx", None):
            self.api.llama_batch_free(self.batch)
            self.api.llama_free(self.ctx)
            free_model = getattr(self.api, "llama_model_free", None) or self.api.llama_free_model
            free_model(self.model)


class VerispecKQuant(Subject):
    """The whole GGUF model in verispec's kquant runner: a `context`-token prompt in the cache, then each
    pass truncates back to it and runs n new positions (logits for all, as verification needs)."""

    def __init__(self, path: Path, threads: int, rng: np.random.Generator, context: int, max_n: int):
        import torch

        from verispec.models.loading import load_model

        torch.set_num_threads(threads)
        self.torch, self.context = torch, context
        self.runner = load_model(str(path), "kquant").runner
        tokens = rng.integers(100, 20000, context + max_n).tolist()
        self.cache = self.runner.new_cache(context + max_n + 8)
        self.runner.forward(self.cache, torch.tensor(tokens[:context]), logits="none")
        self.new = torch.tensor(tokens[context:])
        self.info = {"gguf": path.name, "library": "verispec kquant", "context": context,
                     "compiled_stack": self.runner.compiled}

    def forward(self, n: int):
        self.cache.truncate(self.context)
        return self.runner.forward(self.cache, self.new[:n])  # [n, vocab]

    def first_row(self, result) -> np.ndarray:
        return result[0].numpy().copy()


# ----------------------------------------------------------------------------------------- candidates

@dataclass(frozen=True)
class Candidate:
    package: str  # the importable module it needs
    distributions: tuple[str, ...]  # whose versions are recorded
    build: Callable[..., Subject]  # (args, rng, inputs) -> Subject
    whole_model: bool = False


def stack(kind: type, **options) -> Callable[..., Subject]:
    def build(args, rng, inputs):
        resolved = {k: v() if callable(v) else v for k, v in options.items()}  # e.g. a config check that may skip
        return kind(stack_linears(args.layers), inputs, args.threads, rng, **resolved)
    return build


def gguf(binding: Callable[[], GgufBinding], model_params: dict | None = None,
         context_params: dict | None = None) -> Callable[..., Subject]:
    def build(args, rng, inputs):
        return GgufModel(binding(), args.gguf, args.threads, rng, args.context, args.max_n,
                         model_params or {}, context_params or {})
    return build


def verispec_kquant(args, rng, inputs):
    return VerispecKQuant(args.gguf, args.threads, rng, args.context, args.max_n)


CANDIDATES: dict[str, Candidate] = {
    "llama.cpp": Candidate("llama_cpp", ("llama-cpp-python",), gguf(llama_cpp_binding), whole_model=True),
    "ik_llama.cpp": Candidate("ik_llama_cpp", ("ik-llama-cpp-python",), gguf(ik_llama_cpp_binding), whole_model=True),
    "ik_llama.cpp-rtr": Candidate("ik_llama_cpp", ("ik-llama-cpp-python",), whole_model=True,
                                  build=gguf(ik_llama_cpp_binding, {"use_mmap": False, "repack_tensors": True})),
    "verispec-kquant": Candidate("verispec", ("torch",), verispec_kquant, whole_model=True),
    "onnxruntime": Candidate("onnxruntime", ("onnxruntime", "onnx"), stack(OnnxRuntimeStack, accuracy_level=4)),
    "onnxruntime-acc1": Candidate("onnxruntime", ("onnxruntime", "onnx"), stack(OnnxRuntimeStack, accuracy_level=1)),
    "openvino": Candidate("openvino", ("openvino",), stack(OpenVinoStack, dynamic_quantization_group=GROUP)),
    "openvino-f32act": Candidate("openvino", ("openvino",), stack(OpenVinoStack, dynamic_quantization_group=0)),
    "torchao": Candidate("torchao", ("torchao", "torch"), stack(TorchStack, config=torchao_da8w4_config)),
    "torchao-int4wo": Candidate("torchao", ("torchao", "torch"), stack(TorchStack, config=torchao_int4wo_config)),
}


def run_candidate(name: str, args, inputs: StackInputs) -> dict[str, Any]:
    """One candidate's record: measured, skipped (with the reason) or failed (with the error)."""
    candidate = CANDIDATES[name]
    if candidate.whole_model and args.gguf != default_gguf():  # e.g. ggml's repack path for another type
        name = f"{name}:{args.gguf.name}"  # never mistaken for the reference
    record: dict[str, Any] = {
        "candidate": name, "python": sys.executable, "threads": args.threads, "max_n": args.max_n,
        "repeats": args.repeats, "layers": LAYERS if candidate.whole_model else args.layers,
        "whole_model": candidate.whole_model, "cpu": cpu_line(), "host": platform.node(),
        "when": datetime.datetime.now().isoformat(timespec="seconds"),
        "versions": {d: version_of(d) for d in candidate.distributions},
    }
    if importlib.util.find_spec(candidate.package) is None:
        return record | {"status": "skipped", "reason": f"package {candidate.package!r} is not installed in {sys.executable}"}
    began = time.perf_counter()
    subject = None
    try:
        subject = candidate.build(args, np.random.default_rng(args.seed), inputs)
        record["setup_seconds"] = time.perf_counter() - began
        record |= measure(subject, args.max_n, args.repeats)
        record["info"] = subject.info
        record["status"] = "ok"
    except Unavailable as reason:
        record |= {"status": "skipped", "reason": str(reason)}
    except Exception as error:  # one candidate's failure never loses the others' results
        record |= {"status": "error", "error": f"{type(error).__name__}: {error}",
                   "traceback": traceback.format_exc(limit=-4)}
    finally:
        del subject
        gc.collect()
    return record


# ----------------------------------------------------------------------------------------- reporting

def describe(record: dict[str, Any]) -> str:
    if record["status"] != "ok":
        return f"{record['candidate']}: {record['status']}: {record.get('reason') or record.get('error')}"
    ratios = " ".join(f"{r:.2f}" for r in record["ratio"])
    identical = "".join("=" if same else "x" for same in record["row0_identical"])
    return (f"{record['candidate']}: T(1) {record['seconds'][0] * 1e3:.2f} ms, T(n)/T(1) {ratios}\n"
            f"  row 0 identical to n=1 for n=1..{record['max_n']}: {identical}"
            f"  (deterministic: {record['deterministic']}, largest |diff| {max(record['row0_max_abs_diff']):.3g})")


def first_break(record: dict[str, Any]) -> str:
    """The smallest n whose row 0 differs from the n = 1 pass, or "none"."""
    return next((str(n) for n, same in enumerate(record["row0_identical"], 1) if not same), "none")


def latest_records(path: Path) -> dict[str, dict]:
    """The latest record of each candidate in `path`; a measurement outlives a later skip or error (the
    same candidate listed by a run in another interpreter)."""
    latest: dict[str, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            earlier = latest.get(record["candidate"])
            if record["status"] == "ok" or earlier is None or earlier["status"] != "ok":
                latest[record["candidate"]] = record
    return latest


def verdict(record: dict[str, Any], reference: float | None) -> str:
    """Issue #31's test: T(1) ≤ 1.1× llama.cpp's, T(8)/T(1) ≤ 1.4, row 0 bit-identical at every n."""
    if not record["whole_model"] and record["layers"] != LAYERS:
        return "n/a (partial stack)"
    if reference is None or record["max_n"] < 8:
        return "n/a (no llama.cpp T(1))" if reference is None else "n/a (max-n < 8)"
    failing = [what for what, ok in (("T(1)", record["seconds"][0] <= MAX_T1_VS_LLAMA * reference),
                                     ("T(8)/T(1)", record["ratio"][7] <= MAX_T8_RATIO),
                                     ("rows", all(record["row0_identical"]))) if not ok]
    if failing:
        return "fails " + ", ".join(failing)
    return "meets #31" + ("" if record["whole_model"] else " (as a stack: a lower bound)")


def summary(path: Path) -> str:
    """A table of every candidate's latest result in `path`, with issue #31's verdict."""
    latest = latest_records(path)
    base = latest.get("llama.cpp")
    reference = base["seconds"][0] if base and base["status"] == "ok" else None
    width = max([len(name) for name in latest] + [len("candidate")])
    lines = [f"{'candidate':<{width}} {'what':<11} {'T(1) ms':>8} {'vs llama':>8} {'T(8)/T(1)':>9} {'T(16)/T(1)':>10} "
             f"{'breaks at n':>11}  verdict"]
    for name, record in latest.items():
        if record["status"] != "ok":
            lines.append(f"{name:<{width}} {record['status']}: {(record.get('reason') or record.get('error', ''))[:110]}")
            continue
        seconds, ratio = record["seconds"], record["ratio"]
        what = "model" if record["whole_model"] else f"stack/{record['layers']}L"
        comparable = reference and (record["whole_model"] or record["layers"] == LAYERS)
        lines.append(f"{name:<{width}} {what:<11} {seconds[0] * 1e3:>8.2f} {fmt(seconds[0] / reference if comparable else None):>8} "
                     f"{fmt(ratio[7] if len(ratio) >= 8 else None):>9} {fmt(ratio[15] if len(ratio) >= 16 else None):>10} "
                     f"{first_break(record):>11}  {verdict(record, reference)}")
    return "\n".join(lines)


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


# ----------------------------------------------------------------------------------------- main

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--candidates", default=",".join(CANDIDATES), help=f"comma list of {', '.join(CANDIDATES)}")
    parser.add_argument("--max-n", type=int, default=16, help="the widest pass (rows, or positions)")
    parser.add_argument("--repeats", type=int, default=7, help="timed passes per n (the best counts)")
    parser.add_argument("--out", type=Path, default=Path("kernel_candidates.jsonl"), help="JSON lines, appended")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--layers", type=int, default=LAYERS, help="decoder layers of a stack (the head is always in)")
    parser.add_argument("--gguf", type=Path, default=default_gguf(), help="the whole-model candidates' GGUF file")
    parser.add_argument("--context", type=int, default=64, help="tokens decoded before the timed passes (GGUF)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    names = [name.strip() for name in args.candidates.split(",") if name.strip()]
    unknown = [name for name in names if name not in CANDIDATES]
    if unknown:
        parser.error(f"unknown candidates {unknown}; choose from {', '.join(CANDIDATES)}")
    if not 1 <= args.layers <= LAYERS:
        parser.error(f"--layers must be 1..{LAYERS}")

    print(f"cpu: {cpu_line()}")
    print(f"python {platform.python_version()} ({sys.executable}), {args.threads} threads, n = 1..{args.max_n}, "
          f"best of {args.repeats}, stack of {args.layers} layers + head", flush=True)
    inputs = StackInputs.random(args.max_n, np.random.default_rng(args.seed + 1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name in names:
        print(f"- {name} …", flush=True)
        record = run_candidate(name, args, inputs)
        with args.out.open("a") as out:
            out.write(json.dumps(record) + "\n")
        print("  " + describe(record).replace("\n", "\n  "), flush=True)
    print(f"\nall results in {args.out} (the latest of each candidate):\n{summary(args.out)}")


if __name__ == "__main__":
    main()
