"""`EngineSpec`: the six settings an engine is loaded from (target, drafter, precision, γ, γ policy, device), in one place.

`load()` takes them as its arguments (their defaults are these), the CLI's commands as options
(`add_arguments`, `from_args`), `verispec serve --ray` and `verispec batch` as an EngineSpec, which is
picklable and callable: each Ray replica or actor loads the same engine by calling it. `verispec design`
and `verispec analyze` take the target and precision options from here too.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING

from verispec.control.gamma import POLICIES
from verispec.models.device import DEVICES
from verispec.models.loading import PRECISIONS
from verispec.models.registry import DEFAULT_TARGET

if TYPE_CHECKING:
    from verispec.engine.loop import Engine

__all__ = ["AUTO", "EngineSpec"]

AUTO = "auto"  # `dtype`: `build.auto_precision`; `draft`: `build.EngineBuilder.plan`
HELP = {
    "target": "shipped model name, HF folder or .gguf path",
    "draft": "drafter: auto (planned from measured costs) | none | model[:NAME] | NAME/PATH | gguf[:NAME] | ngram[:max_n=3] | "
             "tree[:k=2,depth=4] | merge | stand[:max_n=4,k=2,depth=5] | hybrid[:min_match=2] | online[:rank=8] | "
             "cascade[:kind=vertical] | self[:layers=7] | triforce (all: verispec.drafters)",
    "dtype": "float32 | bfloat16 | float16 (for a GPU) | int8 (int8 weights, batch-invariant: see verispec.models.int8) | "
             "kquant (a GGUF's own Q4_K/Q6_K blocks in verispec's runner: batch-invariant, cheap verification on AVX-512 VNNI) | "
             "gguf (llama.cpp) | hf (transformers; float32/bfloat16 use it for models other than qwen2/llama)",
    "dtype_auto": "auto (on a GPU bfloat16; on the CPU gguf for a model with a GGUF file: the shipped ones, a .gguf path; "
                  "float32 otherwise) | ",
    "gamma": "draft length γ (the starting value for adaptive policies)",
    "gamma_policy": "how γ changes from step to step (default: auto with --draft auto, analytic otherwise)",
    "device": "where the torch runners compute: cpu (default) | cuda[:N] | auto (cuda when torch sees a GPU); "
              "gguf, kquant and int8 are CPU-only",
}


@dataclass(frozen=True)
class EngineSpec:
    """What `verispec.load` loads (its arguments: see there), as one picklable value.

    target: a shipped model name or a folder (or a .gguf). draft: a drafter spec, None or "none" for
    plain decoding, "auto" (the default, as in every command) for a planned one. dtype: a precision or "auto"
    (the default). gamma: the (starting) draft length. gamma_policy: None for `load`'s default (auto with a
    planned drafter, analytic otherwise). device: "cpu", "cuda" (or "cuda:N") or "auto" (`verispec.models.device`).
    """

    target: str = DEFAULT_TARGET
    draft: str | None = AUTO
    dtype: str = AUTO
    gamma: int = 4
    gamma_policy: str | None = None
    device: str = "cpu"

    def __call__(self) -> Engine:
        """The engine: `verispec.load` with these settings (a Ray worker's loader)."""
        from verispec.engine.build import load  # build's `load` takes its defaults from this module

        return load(**asdict(self))

    def describe(self) -> str:
        policy = self.gamma_policy or "default policy"
        where = "" if self.device == "cpu" else f", on {self.device}"
        return f"target {self.target}, draft {self.draft or 'none'}, {self.dtype}, γ {self.gamma} ({policy}){where}"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineSpec:
        """The spec a command's options give (`add_arguments`); settings it has no option for keep their defaults."""
        given = vars(args)
        return cls(**{field.name: given[field.name] for field in fields(cls) if field.name in given})

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser, defaults: EngineSpec | None = None,
                      names: tuple[str, ...] = ("target", "draft", "dtype", "gamma", "gamma_policy", "device")) -> None:
        """Add --target, --draft, --dtype, --gamma, --gamma-policy and --device (those in `names`), with the defaults of
        `defaults` (default: `EngineSpec()`'s); --dtype offers auto only where it is the default."""
        defaults = defaults or EngineSpec()
        auto = defaults.dtype == AUTO
        dtypes, dtype_help = ((AUTO, *PRECISIONS), HELP["dtype_auto"] + HELP["dtype"]) if auto else (PRECISIONS, HELP["dtype"])
        options = {
            "target": {"default": defaults.target, "help": HELP["target"]},
            "draft": {"default": defaults.draft, "help": HELP["draft"]},
            "dtype": {"default": defaults.dtype, "choices": dtypes, "help": dtype_help},
            "gamma": {"type": int, "default": defaults.gamma, "help": HELP["gamma"]},
            "gamma_policy": {"default": defaults.gamma_policy, "choices": POLICIES, "help": HELP["gamma_policy"]},
            "device": {"default": defaults.device, "metavar": "|".join(DEVICES), "help": HELP["device"]},
        }
        for name in names:
            parser.add_argument("--" + name.replace("_", "-"), **options[name])
