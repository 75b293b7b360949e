"""GPU benchmark of verispec on random-weight models of the shipped configurations (issue #32, item 5).

Real weights cannot reach the GPU machine, so this builds random-weight models of exactly the shipped
shapes (`configs.json`: config values only, copied from the shipped models' config.json) and measures,
on one device, in one run:

1. T(n) and T(n)/T(1) for n = 1 … --max-n new positions after --context cached ones, for the target
   and the draft on verispec's own runner: eager, and replayed as a CUDA graph captured per width
   (static token buffer, the cache at a fixed length, so every replay scores the same slots; prefill eager);
2. tok/s of verispec (plain, draft model, ngram; --methods adds tree, hybrid, …) against Hugging Face
   `generate()` plain, assisted (`assistant_model=`) and prompt lookup (`prompt_lookup_num_tokens=`),
   greedy, on the same random models and the same random prompts (no EOS: every run makes
   --new-tokens tokens). Random weights make acceptance meaningless as a quality figure: compare
   costs (T(n), tok/s of plain decoding, the overhead per step), not speedups from acceptance.

It prints the GPU, driver and torch version and writes one JSON object per line to --out.
Needs torch and transformers, no internet. On the GPU machine:
    PYTHONPATH=src python benchmarks/gpu/measure.py --out gpu.jsonl
Smoke test on a CPU, in seconds (tiny shapes, no graphs): --device cpu --tiny.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from verispec.engine.build import EngineBuilder
from verispec.engine.loop import GenerationConfig
from verispec.models.device import resolve_device, synchronize

CONFIGS = Path(__file__).with_name("configs.json")
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}


def environment(device: torch.device) -> dict:
    """What the numbers were measured on."""
    info = {"kind": "env", "torch": torch.__version__, "cuda": torch.version.cuda, "device": str(device),
            "python": platform.python_version(), "cpu": platform.processor() or platform.machine()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            info["driver"] = "unknown"
    import transformers

    info["transformers"] = transformers.__version__
    return info


def build_random_model(name: str, folder: Path, tiny: bool, seed: int) -> Path:
    """A Hugging Face folder with random weights of the shipped `name`'s config (tiny: shrunk) and a
    word-level tokenizer ("t0" … ), with no EOS so that every run makes the same number of tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    values = dict(json.loads(CONFIGS.read_text())[name])
    values.update(TINY if tiny else {})
    values.setdefault("rope_theta", values.get("rope_parameters", {}).get("rope_theta", 10000.0))
    model_type = values.pop("model_type")
    config = AutoConfig.for_model(model_type, **values, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if not tiny else torch.float32)
    model.save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t1"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t1").save_pretrained(folder)
    return folder


def _elapsed(run, device: torch.device, repeats: int) -> float:
    """The median seconds of `run()` over `repeats` calls (after one warm-up), the device waited for."""
    run()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cost_curve(runner, device: torch.device, max_n: int, context: int, repeats: int, graphs: bool) -> dict[str, list[float]]:
    """T(n) for n = 1 … max_n after `context` cached positions: eager, and (graphs) as a replayed CUDA graph."""
    cache = runner.new_cache(context + max_n + 1)
    runner.forward(cache, torch.zeros(context, dtype=torch.long, device=device), logits="none")  # prefill, eager
    curves: dict[str, list[float]] = {"eager": []}
    for n in range(1, max_n + 1):
        tokens = torch.randint(0, runner.config.vocab_size, (n,), device=device)  # [n]

        def eager(tokens=tokens):
            runner.forward(cache, tokens, logits="all")
            cache.truncate(context)

        curves["eager"].append(_elapsed(eager, device, repeats))
    if graphs:
        curves["graph"] = [_graph_seconds(runner, cache, context, n, device, repeats) for n in range(1, max_n + 1)]
    cache.release()
    return curves


def _graph_seconds(runner, cache, context: int, n: int, device: torch.device, repeats: int) -> float:
    """T(n) of a forward captured once as a CUDA graph (static tokens [n], the cache at length `context`)."""
    static_tokens = torch.zeros(n, dtype=torch.long, device=device)  # [n], the graph's input buffer
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm-up off the default stream, as capture requires
        for _ in range(2):
            runner.forward(cache, static_tokens, logits="all")
            cache.truncate(context)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        runner.forward(cache, static_tokens, logits="all")  # writes slots context … context+n−1 on every replay
    cache.truncate(context)
    seconds = _elapsed(graph.replay, device, repeats)
    del graph
    return seconds


def verispec_speed(builder: EngineBuilder, method: str, prompts: list[list[int]], new_tokens: int, gamma: int,
                   device: torch.device) -> dict:
    """tok/s of verispec's `method` (a drafter spec; "none": plain) over the prompts, greedy."""
    engine = builder.engine(method, gamma, "constant")
    engine.target.eos_ids = frozenset()
    config = GenerationConfig(max_new_tokens=new_tokens, chat=False)
    engine.generate(prompts[0], GenerationConfig(max_new_tokens=4, chat=False))  # warm-up
    synchronize(device)
    start, tokens, accepted, steps = time.perf_counter(), 0, 0, 0
    for prompt in prompts:
        result = engine.generate(prompt, config)
        tokens += len(result.token_ids)
        steps += result.stats.steps
    synchronize(device)
    seconds = time.perf_counter() - start
    accepted = tokens / max(steps, 1)
    return {"kind": "speed", "system": "verispec", "method": method, "tokens": tokens, "seconds": seconds,
            "tok_s": tokens / seconds, "tokens_per_step": accepted}


def hf_speed(target, assistant, method: str, prompts: list[list[int]], new_tokens: int, device: torch.device) -> dict:
    """tok/s of Hugging Face `generate()`: plain, assisted or prompt lookup, greedy, exactly `new_tokens` tokens."""
    extra = {"plain": {}, "assisted": {"assistant_model": assistant}, "prompt_lookup": {"prompt_lookup_num_tokens": 10}}[method]
    kwargs = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0, **extra)

    def run(prompt, limit=None):
        ids = torch.tensor([prompt], device=device)
        with torch.inference_mode():
            return target.generate(ids, attention_mask=torch.ones_like(ids), **{**kwargs, **(limit or {})})

    run(prompts[0], {"max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
    synchronize(device)
    start, tokens = time.perf_counter(), 0
    for prompt in prompts:
        tokens += run(prompt).shape[1] - len(prompt)
    synchronize(device)
    seconds = time.perf_counter() - start
    return {"kind": "speed", "system": "hf", "method": method, "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cpu or auto")
    parser.add_argument("--dtype", default=None,
                        help="float32 | bfloat16 | float16 (default: bfloat16 on a GPU, float32 on a CPU)")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="a name in configs.json")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct", help="a name in configs.json")
    parser.add_argument("--tiny", action="store_true", help="shrunk shapes (a CPU smoke test in seconds)")
    parser.add_argument("--max-n", type=int, default=None, help="widths 1 … N for T(n) (default 64; 4 with --tiny)")
    parser.add_argument("--context", type=int, default=256, help="cached positions before each timed forward")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per width (default 20; 2 with --tiny)")
    parser.add_argument("--no-graphs", action="store_true", help="eager only (graphs need CUDA)")
    parser.add_argument("--methods", default="none,model,ngram", help="verispec drafter specs (none: plain)")
    parser.add_argument("--hf-methods", default="plain,assisted,prompt_lookup", help="Hugging Face generate() modes")
    parser.add_argument("--prompts", type=int, default=None, help="random prompts (default 5; 2 with --tiny)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens per prompt (default 128; 8 with --tiny)")
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("gpu_measure.jsonl"))
    parser.add_argument("--workdir", type=Path, default=None, help="where the random models are written (default: a temp dir)")
    args = parser.parse_args(argv)

    device = resolve_device(args.device)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    tiny = args.tiny
    max_n = args.max_n or (4 if tiny else 64)
    repeats = args.repeats or (2 if tiny else 20)
    n_prompts, new_tokens = args.prompts or (2 if tiny else 5), args.new_tokens or (8 if tiny else 128)
    context = min(args.context, 32) if tiny else args.context
    graphs = device.type == "cuda" and not args.no_graphs
    records = []

    def emit(record: dict) -> None:
        record = {**record, "dtype": dtype, "tiny": tiny}
        records.append(record)
        print(json.dumps(record), flush=True)

    emit(environment(device))
    with tempfile.TemporaryDirectory(dir=args.workdir) as work:
        folders = {role: build_random_model(name, Path(work) / role, tiny, seed)
                   for role, name, seed in (("target", args.target, 1), ("draft", args.draft, 2))}
        builder = EngineBuilder(str(folders["target"]), dtype, default_draft=str(folders["draft"]), device=str(device))
        for role, name in (("target", args.target), ("draft", args.draft)):
            model = builder.models(str(folders[role]), dtype, pack_rows=1 if role == "draft" else 4)
            model.eos_ids = frozenset()
            widths = max_n if role == "target" else min(max_n, 2)
            for mode, seconds in cost_curve(model.runner, device, widths, context, repeats, graphs).items():
                emit({"kind": "cost", "model": name, "role": role, "mode": mode, "context": context,
                      "seconds": seconds, "ratio": [s / seconds[0] for s in seconds]})
        generator = torch.Generator().manual_seed(0)
        vocab = builder.target().vocab_size
        prompts = [torch.randint(2, vocab, (args.prompt_tokens,), generator=generator).tolist() for _ in range(n_prompts)]
        for method in args.methods.split(","):
            emit({**verispec_speed(builder, method.strip(), prompts, new_tokens, args.gamma, device), "gamma": args.gamma})
        from transformers import AutoModelForCausalLM

        torch_dtype = getattr(torch, dtype)
        hf = {role: AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype).to(device).eval()
              for role, folder in folders.items()}
        for method in args.hf_methods.split(","):
            emit(hf_speed(hf["target"], hf["draft"], method.strip(), prompts, new_tokens, device))
    args.out.write_text("".join(json.dumps(record) + "\n" for record in records))
    print(f"wrote {len(records)} records to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
