"""Build engines from specs: the target model and drafter specs, every model loaded once into a `ModelCache`.

`EngineBuilder` is the one place that wires a target, its drafters and an `Engine` together: `load()`
(and through it the CLI, the HTTP server and Ray's replicas and batch actors) builds one engine
with it, the benchmarks build several over the same models.
"""

from __future__ import annotations

from verispec.drafters import make_drafter
from verispec.drafters.base import Drafter
from verispec.engine.loop import Engine
from verispec.models.linear import VERIFY_ROWS
from verispec.models.loading import LoadedModel, ModelCache, parse_precision

__all__ = ["EngineBuilder", "load"]


class EngineBuilder:
    """A target (in each precision asked for) and drafters over one `ModelCache`; engines from specs.

    target: a shipped model name or a folder. dtype: the precision a target is loaded in unless a call
    names another. default_draft: the draft model a drafter spec means when it names none (`model`,
    `tree`, `hybrid`, …); None: the shipped default. Each drafter spec is built once per precision.
    """

    def __init__(self, target: str, dtype: str = "float32", default_draft: str | None = None):
        self.target_spec, self.dtype = target, dtype
        self.models = ModelCache()
        if default_draft is not None:
            self.models.default_draft = default_draft
        self._drafters: dict[tuple[str | None, str], Drafter | None] = {}

    def target(self, precision: str | None = None) -> LoadedModel:
        """The target in `precision` (default: the builder's dtype), loaded on first use."""
        # one weight layout with or without a drafter (rounding depends on it): plain decoding gives the
        # same float32 tokens as speculative decoding, and a request may still pick a drafter
        return self.models(self.target_spec, precision or self.dtype, pack_rows=VERIFY_ROWS)

    def drafter(self, spec: str | None, precision: str | None = None) -> Drafter | None:
        """The drafter `spec` names (as in `verispec.drafters.make_drafter`; None or "none": plain
        decoding) for the target in `precision`, built once. Raises what `make_drafter` raises
        (InvalidParameterError, ModelNotFoundError, IncompatibleModelsError)."""
        key = (spec, parse_precision(precision or self.dtype).name)
        if key not in self._drafters:
            self._drafters[key] = make_drafter(spec, self.target(precision), load=self.models)
        return self._drafters[key]

    def engine(self, spec: str | None, gamma: int = 4, gamma_policy: str = "analytic", precision: str | None = None) -> Engine:
        """An Engine over the target in `precision` with the drafter `spec` names."""
        return Engine(self.target(precision), self.drafter(spec, precision), gamma, gamma_policy, drafter_spec=spec,
                      models=self.models)

    def freeze(self) -> None:
        """No more loading: a request may pick another drafter over the loaded models, never load new
        ones. With exactly one draft model loaded, it becomes what `tree`, `hybrid`, … draft with."""
        drafts = [name for name in self.models.names if name != self.target().name]
        if len(drafts) == 1:
            self.models.default_draft = drafts[0]
        self.models.frozen = True


def load(
    target: str = "qwen2.5-coder-1.5b-instruct",
    draft: str | None = "model",
    dtype: str = "float32",
    gamma: int = 4,
    gamma_policy: str = "analytic",
) -> Engine:
    """Load a target and a drafter into an Engine, ready to generate.

    target: a shipped model name (see `verispec models`) or a model folder. draft: a drafter spec as
    in `verispec.drafters.make_drafter` (`model`, `model:NAME`, `ngram`, `tree`, `hybrid`, …; None or
    "none": plain decoding of the target). dtype: "float32", "bfloat16" or "int8" (int8 weights,
    float32 activations; a draft model follows the target's precision, see
    `verispec.models.loading`), or a llama.cpp / Hugging Face precision. gamma: the (starting)
    draft length; gamma_policy: constant, heuristic or analytic (how γ changes from step to step).

    The engine's models are frozen: a request may ask for another drafter over them
    (`GenerationConfig.drafter`), never for new weights.

    Raises ModelNotFoundError (unknown model), IncompatibleModelsError (a draft with another
    tokenizer) and InvalidParameterError (a bad spec, precision, γ or policy).
    """
    builder = EngineBuilder(target, dtype)
    engine = builder.engine(draft, gamma, gamma_policy)
    builder.freeze()
    return engine
