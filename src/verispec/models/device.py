"""Where a torch runner computes: the `device` setting ("cpu", "cuda", "cuda:N" or "auto") as a torch device.

One decision for every entry point (`load(device=…)`, the CLI's --device, `verispec serve`, `batch`,
`bench`, Ray): "auto" is CUDA when torch sees a GPU and the CPU otherwise; "cuda" without a GPU, and a
CPU-only backend (llama.cpp's gguf / gguf-wide, the fbgemm int8 kernels) on CUDA, are refused with an
error that says what to change. On a GPU cuBLAS is asked for its reproducible setting. The CPU is the
default, and on it nothing moves: every tensor a step makes is created where it always was (`.to(cpu)` of a
CPU tensor is the tensor itself).
"""

from __future__ import annotations

import os

import torch

from verispec.errors import InvalidParameterError

__all__ = ["CPU", "DEVICES", "CPU_ONLY_PRECISIONS", "resolve_device", "check_device", "synchronize", "device_tag"]

CPU = torch.device("cpu")
DETERMINISTIC_CUBLAS = ":4096:8"  # CUBLAS_WORKSPACE_CONFIG on a GPU (`_with_deterministic_cublas`)
DEVICES = ("cpu", "cuda", "auto")  # the names the CLI offers ("cuda:N" is accepted too)
CPU_ONLY_PRECISIONS = {
    "int8": "its int8 kernels (fbgemm) run on the CPU only",
    "kquant": "its k-quant kernels are CPU code",
    "gguf": "llama.cpp runs here on the CPU (its CPU build)",
    "gguf-wide": "llama.cpp runs here on the CPU (its CPU build)",
}


def resolve_device(device: str | torch.device | None = "cpu") -> torch.device:
    """`device` as a torch device: None or "cpu" → CPU; "auto" → CUDA when torch sees a GPU, else CPU;
    "cuda" / "cuda:N" → that GPU. InvalidParameterError for CUDA without a GPU or an unknown name."""
    if device is None:
        return CPU
    if isinstance(device, torch.device):
        name = str(device)
    else:
        name = str(device).strip().lower()
    if name == "auto":
        return _with_deterministic_cublas(torch.device("cuda")) if torch.cuda.is_available() else CPU
    try:
        resolved = torch.device(name)
    except RuntimeError:
        resolved = None
    if resolved is None or resolved.type not in ("cpu", "cuda"):
        raise InvalidParameterError(f"device must be one of {', '.join(DEVICES)} (or cuda:N), got {device!r}")
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidParameterError(
                f"device {name!r}: torch sees no CUDA GPU here (torch {torch.__version__}, "
                f"built with CUDA {torch.version.cuda or 'none'}): use --device cpu, or auto to take a GPU only when there is one"
            )
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise InvalidParameterError(f"device {name!r}: torch sees {torch.cuda.device_count()} GPU(s)")
        return _with_deterministic_cublas(resolved)
    return resolved


def _with_deterministic_cublas(device: torch.device) -> torch.device:
    """`device`, with cuBLAS asked for one fixed workspace per handle (unless the user chose a setting): cuBLAS
    promises the same bits run after run only then when several streams share it, as captures of CUDA graphs
    do (NVIDIA's reproducibility notes; PyTorch's "Reproducibility"). Read when cuBLAS first starts in this
    process, so it is set before the first step."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", DETERMINISTIC_CUBLAS)
    return device


def check_device(precision: str, device: torch.device) -> None:
    """Refuse a precision whose backend cannot run on `device` (InvalidParameterError saying why)."""
    if device.type != "cpu" and precision in CPU_ONLY_PRECISIONS:
        raise InvalidParameterError(
            f"dtype {precision} cannot run on {device}: {CPU_ONLY_PRECISIONS[precision]}; "
            "use --device cpu, or --dtype float32, bfloat16, float16 or hf on the GPU"
        )


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (a GPU runs asynchronously): before reading a timer. Nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_tag(device: torch.device) -> str:
    """What keeps a runner's measured costs on one device apart from another's: "" on the CPU (the keys
    costs were cached under before devices existed), ",cuda:<GPU name>" on a GPU."""
    if device.type == "cpu":
        return ""
    return f",{device.type}:{torch.cuda.get_device_name(device)}"
