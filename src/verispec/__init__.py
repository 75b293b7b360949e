"""verispec: lossless speculative decoding. A cheap drafter proposes, the target verifies in one pass.

    from verispec import load
    engine = load()                      # the shipped Qwen2.5-Coder 1.5B, backend and drafter planned from measured costs
    print(engine.generate("Write a haiku about caches.").text)

The names below are imported on first use (PEP 562), so `import verispec.verify` or
`import verispec.sampling` pulls in only what those need (torch), not the model loaders.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "load": "verispec.engine.build",
    "Engine": "verispec.engine.loop",
    "Generation": "verispec.engine.loop",
    "GenerationConfig": "verispec.engine.loop",
    "SamplingParams": "verispec.sampling.processors",
    "GenerationResult": "verispec.types",
    "GenerationStats": "verispec.types",
    "Origin": "verispec.types",
    "TokenEvent": "verispec.types",
    "VerispecError": "verispec.errors",
    "ModelNotFoundError": "verispec.errors",
    "IncompatibleModelsError": "verispec.errors",
    "InvalidParameterError": "verispec.errors",
    "PromptError": "verispec.errors",
    "release_thread_pool": "verispec.models.openmp",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'verispec' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)  # a lazy export: import on first use
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
