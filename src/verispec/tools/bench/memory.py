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

from verispec.models.runner import Runner, tensor_bytes

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
    return tensor_bytes([*model.parameters(), *model.buffers()]) / MIB


def runner_linear_bytes(runner: Runner) -> int | None:
    """Bytes of a runner's linear layers, the weights every decode token reads (verispec's own runner:
    packed layers counted by their shape, int8 layers by their int8 values, scales and bias); None
    where the backend does not say."""
    return runner.linear_bytes


def runner_weights_mib(runner: Runner) -> float:
    """Bytes of a runner's weights: a verispec `Transformer`'s linear layers, embedding and norms, the
    Hugging Face runner's module, or the size of the GGUF file llama.cpp runs (its tensors are mapped
    from it)."""
    return runner.weight_bytes / MIB
