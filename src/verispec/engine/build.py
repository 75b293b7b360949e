"""Build engines from specs: the target model and drafter specs, every model loaded once into a `ModelCache`.

`EngineBuilder` is the one place that wires a target, its drafters and an `Engine` together: `load()`
(and through it the CLI, the HTTP server and Ray's replicas and batch actors) builds one engine
with it, the benchmarks build several over the same models.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from verispec.control.costs import CostModel, interleaved_token_seconds, prefill_seconds_per_token
from verispec.control.plan import ALPHA_PRIORS, Plan, choose_backend, choose_plan, worth_measuring
from verispec.drafters import make_drafter
from verispec.drafters.base import Drafter
from verispec.engine.loop import Engine
from verispec.engine.spec import AUTO, EngineSpec
from verispec.models.device import resolve_device
from verispec.models.kernels import build_key
from verispec.models.linear import VERIFY_ROWS
from verispec.models.loading import ModelCache, parse_precision, runs_own_runner
from verispec.models.openmp import release_thread_pool
from verispec.models.registry import (SHIPPED_MODELS, default_draft_for, gguf_file, gguf_tokenizer_folder,
                                      hybrid_draft_for, hybrid_draft_vocab, least_cost_ratio)
from verispec.models.runner import LoadedModel
from verispec.paths import cpu_key, read_table, store_in_table

__all__ = ["EngineBuilder", "auto_backends", "auto_precision", "backend_choices", "load"]

BACKEND_CHOICES = "backend_choices.json"
# how backends are compared (2: T(1) timed in turns, prefill weighed; 3: `hybrid` among the candidates; 4: its draft
# reads a long prompt's end, HYBRID_WINDOW; 5: curves from paired timings, `costs.measure_verify_curve`; 6: its draft's
# head cut, `registry.hybrid_draft_vocab`): a choice made by another rule is made again
CHOICE_RULE = 6
# the plan's `hybrid` draft reads a long prompt's first tokens and its last HYBRID_WINDOW (`base.window_cut`): prompt
# lookup copies from the rest, and the draft's prefill and its steps' attention stay short (BENCHMARKS.md, "AMX":
# summaries and RAG +2 % and +8 % over the draft reading it all)
HYBRID_WINDOW = 256


def auto_precision(target: str, device: str = "cpu") -> str:
    """`dtype="auto"`: on the CPU, llama.cpp on the model's own GGUF file where it has one (a shipped model,
    a .gguf path): the file the user chose, at llama.cpp's speed and memory, nothing converted; verispec's
    float32 runner for a Hugging Face folder. On a GPU (`device` cuda, or auto with one), bfloat16."""
    if resolve_device(device).type != "cpu":
        return "bfloat16"
    return "gguf" if target in SHIPPED_MODELS or str(target).endswith(".gguf") else "float32"


def backend_choices() -> dict:
    """The backends `planned_engine` chose before (cache_dir()/backend_choices.json), with the plan made over
    each: a later run loads the chosen backend and drafter alone (delete the file to plan again)."""
    return read_table(BACKEND_CHOICES)


def remember_backend_choice(key: str, plan: Plan) -> None:
    store_in_table(BACKEND_CHOICES, key, {"precision": plan.precision, "seconds": plan.backends, "plan": dataclasses.asdict(plan)})


def remembered_plan(choice: dict) -> Plan | None:
    """The plan a remembered backend choice was made with (None for a choice remembered without it, or in a
    form this version does not read: it is planned again)."""
    try:
        fields = choice["plan"]
        return Plan(**{**fields, "predicted": {name: tuple(value) for name, value in fields["predicted"].items()}})
    except (KeyError, TypeError, AttributeError):
        return None


def auto_backends(target: str, device: str = "cpu") -> list[str]:
    """The precisions `--dtype auto --draft auto` plans over: `auto_precision`'s, and for a GGUF file that
    verispec's kquant runner runs fast on this CPU (Q4_K/Q6_K blocks, AVX-512 VNNI kernels) kquant too:
    the same file's weights either way; the plan keeps the backend its measured costs predict fastest."""
    first = auto_precision(target, device)
    if first != "gguf":
        return [first]
    from verispec.models.kquant import kquant_suits

    gguf = gguf_file(str(target))
    # a first run reads the file's tokenizer (transformers: tens of seconds) while the kernels compile (a compiler
    # process): both are needed, and on one thread they took turns. A reading that fails is left to fail again
    # where the model loads, which says what it was loading.
    with ThreadPoolExecutor(1, thread_name_prefix="verispec-tokenizer") as pool:
        pool.submit(gguf_tokenizer_folder, gguf)
        suits = kquant_suits(gguf)
    return ["gguf", "kquant"] if suits else ["gguf"]


class EngineBuilder:
    """A target (in each precision asked for) and drafters over one `ModelCache`; engines from specs.

    target: a shipped model name or a folder. dtype: the precision a target is loaded in unless a call
    names another. default_draft: the draft model a drafter spec means when it names none (`model`,
    `tree`, `hybrid`, …); None: the shipped default. Each drafter spec is built once per precision.
    device: where every model is loaded ("cpu", "cuda", "auto": `verispec.models.device`).
    """

    def __init__(self, target: str, dtype: str = "float32", default_draft: str | None = None, device: str = "cpu"):
        self.target_spec, self.dtype = target, dtype
        self.models = ModelCache(device=device)
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

    def plan(self, gamma: int, precision: str | None = None) -> Plan:
        """`draft="auto"`: plain decoding, prompt lookup (`ngram`), the default draft model or `hybrid` with the
        target's far smaller hybrid draft (both for a shipped target: `_draft_candidates`), whichever the measured
        costs on this CPU predict fastest (`choose_plan`) for the target in `precision`. Its verification curve and
        the draft models' costs are measured once and cached; a draft model only where it could be the plan
        (`worth_measuring`), so a first run neither fetches nor times a draft whose least possible cost already
        rules it out. Only the short-context curve is measured here (`_candidate_costs`): `planned_engine` times the
        kept plan's after a long context."""
        costs = {"ngram": self._candidate_costs("ngram", gamma, precision)}  # measured or cached
        target = self.target(precision)
        exact = target.runner.exact_positions
        max_gamma = exact - 1 if exact is not None else Engine.MAX_GAMMA
        curve = costs["ngram"].target_seconds

        def planned() -> Plan:
            return choose_plan(target.precision, curve, {spec: cost.draft_cost_ratio() or 0.0 for spec, cost in costs.items()},
                               max_gamma, catch_ups={spec: cost.draft_catch_up for spec, cost in costs.items()})

        plan, bounds = planned(), {}
        for spec, draft in self._draft_candidates(own_runner=runs_own_runner(target)).items():
            least_c = least_cost_ratio(self.target_spec, draft)
            rival = max((speedup for speedup, _ in plan.predicted.values()), default=0.0)
            kind = spec.split(":")[0]
            lookup = plan.predicted.get("ngram") if kind == "hybrid" else None
            worth, bound = (True, 0.0) if least_c is None else worth_measuring(least_c, curve, max_gamma, rival,
                                                                                 ALPHA_PRIORS[kind], lookup)
            if worth:
                costs[spec] = self._candidate_costs(spec, gamma, precision)
                plan = planned()
            else:
                bounds[spec] = bound
        return dataclasses.replace(plan, bounds=bounds)

    def _draft_candidates(self, own_runner: bool) -> dict[str, str]:
        """The plan's candidates that run a draft model, for a shipped target: spec → the shipped draft it loads
        (`model`: the default draft; `hybrid:draft=NAME,window=HYBRID_WINDOW`: the target's `hybrid_draft_for`, where it
        has one, its head cut to `hybrid_draft_vocab` ids when `own_runner`: drafts load in the target's precision, and
        only verispec's own runner cuts a head; llama.cpp's stays whole)."""
        if self.target_spec not in SHIPPED_MODELS:
            return {}
        drafts = {"model": self.models.default_draft or default_draft_for(self.target_spec)}
        if hybrid := hybrid_draft_for(self.target_spec):
            vocab = hybrid_draft_vocab(self.target_spec) if own_runner else None
            drafts[f"hybrid:draft={hybrid},window={HYBRID_WINDOW}" + (f",vocab={vocab}" if vocab else "")] = hybrid
        return drafts

    def _candidate_costs(self, spec: str, gamma: int, precision: str | None) -> CostModel:
        """The costs a plan compares for drafter `spec` on the target in `precision`: its short-context curve and
        the draft model's cost, never the curve after a long context (which only the kept plan's γ policy reads)."""
        engine = self.engine(spec, gamma, "auto", precision)
        return engine.costs_for(engine.drafter, "auto", long=False)

    def planned_engine(self, gamma: int = 4, gamma_policy: str | None = None, precision: str | None = None,
                       backends: list[str] | None = None, settle: bool = False) -> Engine:
        """An Engine over the plan's drafter and γ (`plan`), with the plan kept as `engine.plan`. With
        several `backends` (precisions of the same target), each is planned and the fastest kept
        (`choose_backend`) on their T(1) timed in turns (`interleaved_token_seconds`: measured a minute apart, a
        shared CPU's drift could flip the choice) and their prefill speed, so each backend's target stays loaded until
        one is chosen;
        `settle`: it becomes the builder's precision and the others' models are let go, and the choice is
        remembered with its plan (`backend_choices`): a later run with the same target, candidates, default draft,
        threads and CPU loads the chosen backend and the plan's drafter alone; a first run lets go of the draft models it loaded for candidates it did not choose."""
        if backends and len(backends) > 1 and settle and (chosen := backend_choices().get(self._choice_key(backends))):
            # the plan as made then (its costs are cached): no candidate drafter is built again to read them, so a
            # draft model the plan did not choose is not loaded
            plan = remembered_plan(chosen)
            if plan is None:  # an older record, without its plan: plan that backend again, and keep the plan
                plan = dataclasses.replace(self.plan(gamma, chosen["precision"]), backends=chosen["seconds"])
                remember_backend_choice(self._choice_key(backends), plan)
            self.dtype = precision = plan.precision
        elif backends and len(backends) > 1:
            plans = [self.plan(gamma, backend) for backend in backends]
            seconds = interleaved_token_seconds([self.target(backend).runner for backend in backends])
            prefills = [prefill_seconds_per_token(self.target(backend)) for backend in backends]
            plan = choose_backend([dataclasses.replace(each, token_seconds=t, prefill_seconds=p)
                                   for each, t, p in zip(plans, seconds, prefills)])
            precision = plan.precision
            if settle:
                self.dtype = precision
                for backend in backends:
                    if backend != precision:
                        self.release(backend)
                remember_backend_choice(self._choice_key(backends), plan)
        else:
            plan = self.plan(gamma, precision)
        if settle:
            self._let_go_of_candidates(plan)
        engine = self.engine(plan.drafter, max(plan.gamma, 1), gamma_policy or "auto", precision)
        engine.plan = plan
        engine.prepare()  # the kept plan's costs after a long context: measured now, not in its first request
        return engine

    def _let_go_of_candidates(self, plan: Plan) -> None:
        """Let the draft models go that only a candidate the plan did not choose loaded (to read its cost): a
        first run then holds what a later one does, which takes the remembered plan and loads none of them."""
        precision = parse_precision(plan.precision).name
        for spec in plan.predicted:
            drafter = self._drafters.pop((spec, precision), None) if spec != plan.drafter else None
            if (model := getattr(drafter, "model", None)) is not None:
                self.models.drop(model.name, model.precision)

    def _choice_key(self, backends: list[str]) -> str:
        """What a backend choice and its plan depend on: the target (its file's size and time), the candidates,
        the default draft model, the threads and the CPU kind (its measured costs are cached under the same things),
        and the rule that compared them (`CHOICE_RULE`)."""
        path = Path(self.target_spec)
        if self.target_spec in SHIPPED_MODELS:
            path = gguf_file(self.target_spec) if "gguf" in backends else path
        stamp = f"{path.stat().st_size}:{int(path.stat().st_mtime)}" if path.exists() else "?"
        kernels = f"|kquant={build_key('kquant')}" if "kquant" in backends else ""  # a new kernel: choose again
        draft = f"|draft={self.models.default_draft}" if self.models.default_draft else ""
        return (f"{self.target_spec}|{stamp}|{','.join(backends)}{kernels}{draft}|threads={torch.get_num_threads()}"
                f"|cpu={cpu_key()}|rule={CHOICE_RULE}")

    def release(self, precision: str) -> None:
        """Let the target in `precision` and the drafters built for it go (a backend the plan did not keep)."""
        name = parse_precision(precision).name
        self._drafters = {key: drafter for key, drafter in self._drafters.items() if key[1] != name}
        self.models.drop(self.target_spec, name)

    def freeze(self) -> None:
        """No more loading: a request may pick another drafter over the loaded models, never load new
        ones. With exactly one draft model loaded, it becomes what `tree`, `hybrid`, … draft with."""
        drafts = [name for name in self.models.names if name != self.target().name]
        if len(drafts) == 1:
            self.models.default_draft = drafts[0]
        self.models.frozen = True


def load(
    target: str = EngineSpec.target,
    draft: str | None = EngineSpec.draft,
    dtype: str = EngineSpec.dtype,
    gamma: int = EngineSpec.gamma,
    gamma_policy: str | None = EngineSpec.gamma_policy,
    device: str = EngineSpec.device,
) -> Engine:
    """Load a target and a drafter into an Engine, ready to generate.

    target: a shipped model name (see `verispec models`) or a model folder. draft: a drafter spec as
    in `verispec.drafters.make_drafter` (`model`, `model:NAME`, `ngram`, `tree`, `hybrid`, …; None or
    "none": plain decoding of the target; "auto", the default: planned from measured costs, `EngineBuilder.plan`,
    the plan kept as `engine.plan`, as the CLI's commands do). dtype: "float32", "bfloat16" or "int8" (int8 weights, float32
    activations; a draft model follows the target's precision, see `verispec.models.loading`), a
    llama.cpp / Hugging Face precision, or "auto", the default (`auto_precision`; with draft "auto" the plan picks
    among `auto_backends`). gamma: the (starting) draft
    length; gamma_policy: constant, heuristic, analytic or auto (how γ changes from step to step;
    default: auto with a planned drafter, analytic otherwise). device: "cpu" (the default), "cuda" or
    "auto" (CUDA when torch sees a GPU): where the torch runners keep weights and caches and where a
    step's verification and sampling run (`verispec.models.device`; gguf and int8 are CPU-only).

    The engine's models are frozen: a request may ask for another drafter over them
    (`GenerationConfig.drafter`), never for new weights.

    Raises ModelNotFoundError (unknown model), IncompatibleModelsError (a draft with another
    tokenizer) and InvalidParameterError (a bad spec, precision, γ, policy or device). The same settings as one
    value (the CLI's options, a Ray worker's loader): `verispec.engine.spec.EngineSpec`.
    """
    backends = auto_backends(target, device) if dtype == AUTO else [dtype]
    builder = EngineBuilder(target, backends[0], device=device)
    if draft == AUTO:
        engine = builder.planned_engine(gamma, gamma_policy, backends=backends, settle=True)
    else:
        engine = builder.engine(draft, gamma, gamma_policy or "analytic")
    builder.freeze()
    release_thread_pool()  # loading and measuring leave this thread no OpenMP workers: the engine may run elsewhere
    return engine
