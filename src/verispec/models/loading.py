"""Turn a model spec (shipped name, Hugging Face folder, or .gguf path) into a ready model.

`load_model` builds a `LoadedModel` (`models/runner.py`): the runner of one of three backends, the
tokenizer and the stop ids. `tokenizer_problems` says whether a draft shares the target's tokenizer (a draft that does
not is run by `drafters/cross_vocab.py`; `check_compatible` refuses it where token ids must agree). A
`ModelCache` loads each (spec, dtype) once; a server freezes it so a request can pick another
drafter built from the models already in memory, never make it read new weights.

Precisions (the `dtype` argument everywhere: API, CLI, server, benchmark):
  float32 (fp32)    the default: weights and activations in float32, weights prepacked for oneDNN;
  bfloat16 (bf16)   weights and activations in bfloat16 (fast only on CPUs with AMX / AVX-512 bf16);
  float16 (fp16)    weights and activations in float16: for a GPU (`--device cuda`); it runs on a CPU, slowly;
  gguf              the model's GGUF file as it is, run by llama.cpp (`models/llama_cpp.py`): ggml's
                    CPU kernels, any architecture llama.cpp supports, no conversion; a shipped name
                    or a .gguf path (a Hugging Face folder has no GGUF to run); verification widths
                    limited to those computed bit for bit as decode steps (greedy stays exact);
  kquant            the model's GGUF file (Q4_K / Q6_K blocks, e.g. a Q4_K_M file) run by verispec's own
                    runner and k-quant kernels (`models/kquant.py`): the file's weights as they are,
                    int8 activations, row-invariant at every width (greedy speculative output equals
                    greedy plain decoding of this path), verification of n positions for little more
                    than one on CPUs with AVX-512 VNNI; a shipped name or a .gguf path; a file with
                    other blocks (the 0.5B draft's Q5_0/Q8_0) has them requantized once to Q4_K/Q6_K
                    (`models/requantize.py`): another rounding, so another model (meant for drafts);
  gguf-wide         the same as gguf, verifying any width (faster where ggml's multi-row kernels pay; greedy
                    output equals plain decoding except at rare near-ties: `analyze --flips`);
  int8              int8 weights (per output channel), quantized when loading from the float32
                    folder, activations quantized per row inside each linear layer and float32
                    elsewhere (`models/int8.py`): a quarter of the weight bytes, and greedy
                    speculative decoding stays token-identical to greedy plain decoding of the SAME
                    int8 model (not of the float32 one: `verispec quality` measures how close they are);
  hf                the Hugging Face `transformers` model itself (`models/hf_runner.py`), float32 (or
                    "hf-bfloat16", "hf-float16"): any architecture transformers runs, slower than the own runner.

Devices (`device`, `models/device.py`): the torch runners (own and Hugging Face) load their weights
and keep their KV caches on the device a `ModelCache` (or `load_model`) is given, the CPU by default;
llama.cpp and int8 are CPU-only and refused elsewhere.

verispec's own runner implements the model types in `transformer.SUPPORTED_TYPES` (qwen2, llama);
any other model asked for in float32 or bfloat16 is run by the Hugging Face runner automatically.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import hashlib
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from verispec.errors import IncompatibleModelsError, InvalidParameterError, ModelNotFoundError
from verispec.models.device import CPU, check_device, resolve_device
from verispec.models.gguf_weights import kquant_runs
from verispec.models.int8 import int8_available
from verispec.models.linear import VERIFY_ROWS
from verispec.models.registry import (
    SHIPPED_MODELS, convert_gguf, gguf_file, gguf_tokenizer_folder, prepare_shipped_model,
)
from verispec.models.runner import LoadedModel
from verispec.models.tokenizer import load_tokenizer
from verispec.models.transformer import SUPPORTED_TYPES, ModelConfig, Transformer
from verispec.models.vocabulary import vocabulary_difference
from verispec.paths import cache_dir
from verispec.progress import status

__all__ = [
    "ModelCache", "ModelLoader", "require_own_runner", "runs_own_runner", "load_model", "load_tokenizer", "resolve_folder", "check_compatible",
    "tokenizer_problems", "parse_dtype", "parse_precision", "precisions_for", "Precision", "PRECISIONS",
]

# the names the CLI, server and benchmark offer
PRECISIONS = ("float32", "bfloat16", "int8", "kquant", "gguf", "gguf-wide", "hf", "float16")


@dataclass(frozen=True)
class Precision:
    """A model precision: its canonical name, the activation (and float weight) dtype, the weight quantization."""

    name: str
    dtype: torch.dtype
    quant: str | None = None


_PRECISIONS = {
    "float32": Precision("float32", torch.float32), "fp32": Precision("float32", torch.float32),
    "bfloat16": Precision("bfloat16", torch.bfloat16), "bf16": Precision("bfloat16", torch.bfloat16),
    "float16": Precision("float16", torch.float16), "fp16": Precision("float16", torch.float16),
    "int8": Precision("int8", torch.float32, "int8"),
    "kquant": Precision("kquant", torch.float32, "kquant"),
    "gguf": Precision("gguf", torch.float32, "gguf"), "llama.cpp": Precision("gguf", torch.float32, "gguf"),
    "gguf-wide": Precision("gguf-wide", torch.float32, "gguf-wide"),
    "hf": Precision("hf", torch.float32, "hf"), "hf-float32": Precision("hf", torch.float32, "hf"),
    "hf-bfloat16": Precision("hf-bfloat16", torch.bfloat16, "hf"), "hf-bf16": Precision("hf-bfloat16", torch.bfloat16, "hf"),
    "hf-float16": Precision("hf-float16", torch.float16, "hf"), "hf-fp16": Precision("hf-float16", torch.float16, "hf"),
}


def precisions_for(model_type: str, gguf: bool = False) -> dict[str, str]:
    """Which precisions can run a model of `model_type` (a config.json model type), each with the
    backend that runs it: the own runner's float32/bfloat16/int8 for its types, the Hugging Face
    runner for hf (and for float32/bfloat16 of any other type), llama.cpp for gguf when the model
    comes as a GGUF file. (float16, a GPU precision, runs whatever float32 runs: not listed.)"""
    own = model_type in SUPPORTED_TYPES
    backends = {name: "verispec" if own else "transformers" for name in ("float32", "bfloat16")}
    if own:
        backends["int8"] = "verispec"
    backends["hf"] = "transformers"
    if gguf:
        backends["gguf"] = "llama.cpp"
        if own:
            backends["kquant"] = "verispec"
    return backends


def parse_precision(dtype: str | torch.dtype | Precision) -> Precision:
    """'float32' / 'bfloat16' / 'int8' (or a torch dtype) as a Precision; InvalidParameterError otherwise."""
    if isinstance(dtype, Precision):
        return dtype
    if isinstance(dtype, torch.dtype):
        for precision in _PRECISIONS.values():
            if precision.dtype == dtype and precision.quant is None:
                return precision
    elif isinstance(dtype, str) and dtype.strip().lower() in _PRECISIONS:
        return _PRECISIONS[dtype.strip().lower()]
    raise InvalidParameterError(f"dtype must be one of {', '.join(PRECISIONS)}, got {dtype!r}")


def parse_dtype(dtype: str | torch.dtype | Precision) -> torch.dtype:
    """The torch dtype of activations for a precision (float32 for int8, whose weights alone are int8)."""
    return parse_precision(dtype).dtype


def resolve_folder(spec: str | Path) -> Path:
    """A Hugging Face folder for a shipped name, a folder path, or a .gguf file (converted once)."""
    spec_str = str(spec)
    if spec_str in SHIPPED_MODELS:
        return prepare_shipped_model(spec_str)
    path = Path(spec_str).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"{path} is a folder but has no config.json: not a Hugging Face model folder")
        return path
    if path.is_file() and path.suffix == ".gguf":
        key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
        return convert_gguf(path, cache_dir() / "hf" / f"{path.stem}-{key}", path.name)
    known = ", ".join(sorted(SHIPPED_MODELS))
    raise ModelNotFoundError(
        f"unknown model {spec_str!r}: give a shipped model name ({known}), "
        "a Hugging Face model folder, or a .gguf file path"
    )


def runs_own_runner(model: LoadedModel) -> bool:
    """Whether `model` runs on verispec's own runner (`models/transformer.py`), not llama.cpp or Hugging Face."""
    return isinstance(model.runner, Transformer)


def require_own_runner(model: LoadedModel, what: str) -> None:
    """Refuse, with a clear error, a feature that reads the torch runner's weights or cache layout
    (derived drafts, online distillation, TriForce, beam search) on another backend."""
    if not runs_own_runner(model):
        raise InvalidParameterError(
            f"{what} needs verispec's own runner (precision float32, bfloat16, float16, int8 or kquant on a qwen2/llama model); "
            f"{model.name} runs in {model.precision}"
        )


def _eos_ids(folder: Path, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        file = folder / name
        if file.exists():
            eos = json.loads(file.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def load_model(spec: str | Path, dtype: str | torch.dtype = "float32", pack_rows: int = VERIFY_ROWS,
               device: str | torch.device = CPU) -> LoadedModel:
    """`spec` (shipped name, HF folder or .gguf) in precision `dtype` (float32, bfloat16, float16, int8, gguf
    or hf), its weights and caches on `device` ("cpu", "cuda", "auto": `models/device.py`).

    A model type the own runner does not implement runs on the Hugging Face runner in float32 and
    bfloat16 (and always with dtype "hf"); int8 needs the own runner.

    pack_rows: the positions per forward the float weights are laid out for (`models/linear.py`):
    VERIFY_ROWS for a target, which verifies several drafted positions at once; 1 for a draft model,
    which decodes one token at a time, and for a target that only decodes plainly.

    int8 weights are quantized from the cached float32 conversion while loading (a few seconds for
    the 1.5B; measured in BENCHMARKS.md), so no second conversion is stored.

    Raises InvalidParameterError for a device torch cannot use or a CPU-only precision off the CPU.
    """
    precision = parse_precision(dtype)
    device = resolve_device(device)
    check_device(precision.name, device)  # before any file is read
    if precision.quant in ("gguf", "gguf-wide"):
        return _load_gguf(spec, exact=precision.quant == "gguf")
    if precision.quant == "kquant":
        return _load_kquant(spec, pack_rows)
    if precision.quant == "int8" and not int8_available():
        warnings.warn("this torch build has no fbgemm int8 kernel: int8 runs a slow (exact) float64 fallback",
                      RuntimeWarning, stacklevel=2)
    folder = resolve_folder(spec)
    model_type = json.loads((folder / "config.json").read_text()).get("model_type", "?")
    if model_type not in SUPPORTED_TYPES and precision.quant is not None and precision.quant != "hf":
        raise ModelNotFoundError(
            f"{spec} is a {model_type!r} model: {precision.name} needs verispec's own runner, which implements "
            f"{', '.join(SUPPORTED_TYPES)}; use --dtype float32, bfloat16 or hf (the Hugging Face runner) or gguf"
        )
    if precision.quant == "hf" or model_type not in SUPPORTED_TYPES:
        from verispec.models.hf_runner import HFRunner

        with status(f"loading {spec} ({model_type} in {precision.name}, Hugging Face runner)"):
            runner = HFRunner.from_folder(folder, precision.dtype, device)
            tokenizer = load_tokenizer(folder)
        return LoadedModel(str(spec), folder, runner, tokenizer, _eos_ids(folder, tokenizer))
    with status(f"loading {spec} ({precision.name})"):
        runner = Transformer.from_folder(folder, precision.dtype, quant=precision.quant, pack_rows=pack_rows, device=device)
        tokenizer = load_tokenizer(folder)
    return LoadedModel(str(spec), folder, runner, tokenizer, _eos_ids(folder, tokenizer))


def _load_gguf(spec: str | Path, exact: bool) -> LoadedModel:
    """`spec`'s GGUF file in llama.cpp, with the tokenizer read from the same file."""
    from verispec.models.llama_cpp import LlamaCppRunner

    gguf = gguf_file(str(spec))
    folder = gguf_tokenizer_folder(gguf)
    with status(f"loading {spec} into llama.cpp"):
        runner = LlamaCppRunner(gguf, exact=exact)
        tokenizer = load_tokenizer(folder)
    runner.measure_exact_widths(long=False)  # here, never inside a request; the long one in `Engine.prepare`
    return LoadedModel(str(spec), gguf, runner, tokenizer, _eos_ids(folder, tokenizer) | runner.eos_ids)


def _load_kquant(spec: str | Path, pack_rows: int) -> LoadedModel:
    """`spec`'s GGUF file in verispec's runner on its own k-quant blocks, the tokenizer and config read from the file."""
    gguf = gguf_file(str(spec))
    folder = gguf_tokenizer_folder(gguf)
    if not (folder / "config.json").exists():
        raise ModelNotFoundError(f"{gguf.name}: transformers cannot describe this architecture; use --dtype gguf")
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    own = kquant_runs(gguf)  # else its other blocks are requantized: another rounding of the weights (fine for a draft)
    with status(f"loading {spec} (kquant: {'the file' if own else 'requantized'}'s Q4_K/Q6_K blocks)"):
        runner = Transformer.from_gguf(gguf, config, pack_rows, requantize=not own)
        tokenizer = load_tokenizer(folder)
    return LoadedModel(str(spec), gguf, runner, tokenizer, _eos_ids(folder, tokenizer))


ModelLoader = Callable[..., "LoadedModel"]  # (spec, dtype, pack_rows=…) -> LoadedModel, like load_model (a cache's device)


class ModelCache:
    """`load_model` that loads each (spec, dtype) once; once `frozen`, asking for a new one is an error.

    `default_draft` is the draft model a drafter spec means when it names none (`tree`, `hybrid`, …):
    the draft a server loaded at start or a benchmark was given; None: the target's own default
    (`registry.default_draft_for`). A model is laid out for the
    `pack_rows` of its first load (a target's or a draft's, see `load_model`). Every model it loads lives
    on its `device` (default: the first model's, else the CPU; see `models/device.py`).
    """

    def __init__(self, *models: LoadedModel, frozen: bool = False, device: str | torch.device | None = None):
        self._models = {(model.name, model.precision): model for model in models}
        self.frozen = frozen
        self.device = resolve_device(device) if device is not None or not models else models[0].device
        self.default_draft: str | None = None

    @property
    def names(self) -> list[str]:
        return list(dict.fromkeys(name for name, _ in self._models))

    def drop(self, spec: str | Path, dtype: str | torch.dtype) -> None:
        """Forget the model `spec` in `dtype`: its memory goes with the last reference to it, and what the C
        allocator keeps of it afterwards is handed back to the system (`malloc_trim`, where glibc has it)."""
        if self._models.pop((str(spec), parse_precision(dtype).name), None) is not None:
            gc.collect()
            with contextlib.suppress(OSError, AttributeError):
                ctypes.CDLL("libc.so.6").malloc_trim(0)

    def __call__(self, spec: str | Path, dtype: str | torch.dtype = "float32", pack_rows: int = VERIFY_ROWS) -> LoadedModel:
        key = (str(spec), parse_precision(dtype).name)
        if key not in self._models:
            if self.frozen:
                loaded = ", ".join(f"{name} ({precision})" for name, precision in self._models) or "none"
                raise InvalidParameterError(
                    f"model {str(spec)!r} in {key[1]} is not loaded here (loaded: {loaded}): pick a drafter that uses "
                    "a loaded model or none (ngram, stand), or restart with --draft naming it"
                )
            self._models[key] = load_model(spec, dtype, pack_rows, self.device)
        return self._models[key]


def tokenizer_problems(target: LoadedModel, draft: LoadedModel) -> list[str]:
    """How the draft's tokenizer differs from the target's (vocabulary, special ids, logits width); [] if
    it drafts in the target's own token ids."""
    t_tok, d_tok = target.tokenizer, draft.tokenizer
    problems = [difference] if (difference := vocabulary_difference(t_tok.get_vocab(), d_tok.get_vocab())) else []
    special = lambda tok: (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id)  # noqa: E731
    for attr, t_id, d_id in zip(("eos_token_id", "bos_token_id", "pad_token_id"), special(t_tok), special(d_tok)):
        if t_id != d_id:
            problems.append(f"{attr} differs ({t_id} vs {d_id})")
    if draft.vocab_size > target.vocab_size:
        problems.append(f"draft logits are wider than the target's ({draft.vocab_size} > {target.vocab_size})")
    return problems


def check_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft that does not share the target's tokenizer (vocabulary and special ids)."""
    if problems := tokenizer_problems(target, draft):
        raise IncompatibleModelsError(
            f"draft {draft.name!r} cannot draft for target {target.name!r} in its token ids: " + "; ".join(problems)
            + ". Only a plain draft model (model:NAME, gguf:NAME) may use another tokenizer; use a draft of the "
            "same family (same tokenizer), or --draft ngram / none."
        )
