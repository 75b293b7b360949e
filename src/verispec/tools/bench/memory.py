"""Memory measurements for the benchmark: resident set size (RSS) and the bytes of loaded weights.

Every method runs in the same process, so the process's RSS high-water mark covers all loaded models
at once. What is attributed to one method is therefore:
  weights_mib     the bytes of the weight tensors of the models the method uses (measured on the
                  loaded tensors, not read from a config);
  peak_extra_mib  how far RSS rose above its level just before a generation, at most, during that
                  generation: KV caches, activations, logits (Linux only: the kernel's peak RSS,
                  VmHWM, is reset before each generation through /proc/self/clear_refs);
and memory_mib = weights_mib + peak_extra_mib estimates the method's peak footprint alone.
`process_peak_rss_mib()` (getrusage ru_maxrss) is the whole run's high-water mark.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import torch

from verispec.models.hf_runner import HFRunner

__all__ = ["PeakMeter", "process_peak_rss_mib", "hf_weights_mib", "runner_linear_bytes", "runner_weights_mib"]

MIB = 1 << 20
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def process_peak_rss_mib() -> float:
    """The process's RSS high-water mark so far (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / MIB if sys.platform == "darwin" else peak / 1024


def _status_mib(field: str) -> float | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # "VmRSS:   123 kB"
    except OSError:
        pass
    return None


class PeakMeter:
    """Measures the RSS rise during a `with` block: `extra_mib` (None where the OS cannot tell)."""

    def __enter__(self) -> PeakMeter:
        self.before_mib = _status_mib("VmRSS")
        try:
            _CLEAR_REFS.write_text("5")  # reset VmHWM to the current RSS
            self.resettable = True
        except OSError:
            self.resettable = False
        self.extra_mib: float | None = None
        return self

    def __exit__(self, *_) -> None:
        peak = _status_mib("VmHWM")
        if self.resettable and peak is not None and self.before_mib is not None:
            self.extra_mib = max(peak - self.before_mib, 0.0)


def hf_weights_mib(model: torch.nn.Module) -> float:
    """Bytes of a torch module's parameters and buffers (shared tensors counted once)."""
    seen: dict[int, int] = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        seen[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
    return sum(seen.values()) / MIB


def runner_linear_bytes(runner) -> int:
    """Bytes of a verispec `Transformer`'s linear layers, the weights every decode token reads (packed
    linear layers counted by their shape; int8 layers by their int8 values, scales and bias)."""
    itemsize = torch.empty((), dtype=runner.dtype).element_size()
    linears = [runner.lm_head] + [lin for layer in runner.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    total = 0
    for lin in linears:
        lin = getattr(lin, "head", lin)  # a reduced-vocabulary head wraps the real layer
        if hasattr(lin, "nbytes"):
            total += lin.nbytes
        else:
            bias = lin.bias.numel() if getattr(lin, "bias", None) is not None else 0
            total += (lin.out_features * lin.in_features + bias) * itemsize
    return total


def runner_weights_mib(runner) -> float:
    """Bytes of a runner's weights: a verispec `Transformer`'s linear layers, embedding and norms, the
    Hugging Face runner's module, or the size of the GGUF file llama.cpp runs (its tensors are mapped
    from it)."""
    if getattr(runner, "path", None) is not None:
        return runner.path.stat().st_size / MIB
    if isinstance(runner, HFRunner):
        return hf_weights_mib(runner.model)
    itemsize = torch.empty((), dtype=runner.dtype).element_size()
    numel = runner.embed.numel() + runner.final_norm.numel()
    numel += sum(layer.input_norm.numel() + layer.post_norm.numel() for layer in runner.layers)
    return (runner_linear_bytes(runner) + numel * itemsize) / MIB
