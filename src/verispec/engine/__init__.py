"""The engine: the draft → verify → commit loop (`loop`), the settings an engine is loaded from
(`spec`), building one from them (`build`) and beam search with the target alone (`beam`)."""

from verispec.engine.beam import beam_search
from verispec.engine.build import EngineBuilder, load
from verispec.engine.loop import MAX_STOP_TOKEN_IDS, Engine, Generation, GenerationConfig, StepPlan
from verispec.engine.spec import EngineSpec

__all__ = ["MAX_STOP_TOKEN_IDS", "Engine", "EngineBuilder", "EngineSpec", "Generation", "GenerationConfig", "StepPlan", "beam_search", "load"]
