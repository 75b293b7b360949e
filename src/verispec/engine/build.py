"""Build an engine from specs: the target model and a drafter spec, loaded once into a `ModelCache`."""

from __future__ import annotations

from verispec.drafters import make_drafter
from verispec.engine.loop import Engine
from verispec.models.linear import VERIFY_ROWS
from verispec.models.loading import ModelCache

__all__ = ["load"]


def load(
    target: str = "qwen2.5-coder-1.5b-instruct",
    draft: str | None = "model",
    dtype: str = "float32",
    gamma: int = 4,
    gamma_policy: str = "analytic",
) -> Engine:
    """Load a target and a drafter (spec as in `verispec.drafters.make_drafter`) into an Engine.

    dtype: "float32", "bfloat16" or "int8" (int8 weights, float32 activations; the draft model is
    loaded in the same precision; see `verispec.models.loading`).
    """
    models = ModelCache()
    # one weight layout with or without a drafter (rounding depends on it): plain decoding gives the
    # same float32 tokens as speculative decoding, and a request may still pick a drafter
    target_model = models(target, dtype, pack_rows=VERIFY_ROWS)
    drafter = make_drafter(draft, target_model, load=models)
    drafts = [name for name in models.names if name != target_model.name]
    if len(drafts) == 1:
        models.default_draft = drafts[0]  # what a request's `tree`, `hybrid`, … will draft with
    models.frozen = True  # a request may pick another drafter over these models, never load new ones
    return Engine(target_model, drafter, gamma, gamma_policy, drafter_spec=draft, models=models)
