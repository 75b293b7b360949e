"""The engine: the draft → verify → commit loop (`loop`), building one from
specs (`build`) and beam search with the target alone (`beam`)."""

from verispec.engine.beam import beam_search
from verispec.engine.build import EngineBuilder, load
from verispec.engine.loop import Engine, Generation, GenerationConfig, StepPlan

__all__ = ["Engine", "EngineBuilder", "Generation", "GenerationConfig", "StepPlan", "beam_search", "load"]
