"""GPU benchmark of verispec on random-weight models of the shipped configurations (issue #32, item 5).

Real weights cannot reach the GPU machine, so this builds random-weight models of exactly the shipped
shapes (`configs.json`: config values only, copied from the shipped models' config.json) and measures,
on one device, in one run:

1. T(n) and T(n)/T(1) after --context cached positions, for the target and the draft on verispec's own
   runner: launched eagerly (--eager-widths) and replayed as CUDA graphs (n = 1 … --max-n), through
   `runner.forward` as decoding calls it (`models/cuda_graphs.py`);
2. tok/s of verispec's plain decoding, launched and replayed, and of --methods (replayed) against Hugging
   Face `generate()` plain, assisted (`assistant_model=`) and prompt lookup (`prompt_lookup_num_tokens=`),
   greedy, on the same random models and random prompts (no EOS: every run makes --new-tokens tokens);
   each speculative output compared with plain decoding's on the same device and dtype (`same_as_plain`);
   every verispec method timed on its second pass over the prompts, after a cold one that captured its
   graphs, each pass with a fresh drafter (`verispec_speed`); plain timed again at the end (drift); with
   --host-steps each replayed one twice in turns, its whole steps on the device (`engine/device_steps.py`,
   the default) and through the host (VERISPEC_DEVICE_STEPS=0), `device_steps` in its record; with --batch K,…
   `Engine.generate_batch` of K requests stepped together (a server's regime), each against plain alone;
3. the speedups over replayed plain decoding that the theory predicts from the measured graph curves,
   the draft's c and acceptance measured on the real models on a CPU (--alpha): random weights agree
   with nothing, so measured speculative tok/s here show the cost of a step, not its gain.

With --real FOLDER (a real model brought over by `ship_weights.py`, and --questions FILE) the target has
real weights: prompts are the questions' first turns in its chat template, generations stop at its EOS,
and speculative speedups (model-free drafters, or --real-draft) are measured with real acceptance.

It prints the GPU, driver and torch version and writes one JSON object per line to --out (rewritten
after each record; a failing measurement is recorded as an error and the others go on).
Needs torch and transformers, no internet. On the GPU machine:
    PYTHONPATH=src python benchmarks/gpu/measure.py --out gpu.jsonl   (or benchmarks/gpu/run.sh OUTDIR: this, then the CUDA tests)
Smoke test on a CPU, in seconds (tiny shapes, no graphs): --device cpu --tiny.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from verispec.control.gamma import check_gamma_policy
from verispec.control.theory import curve_verify_cost, expected_speedup
from verispec.drafters import make_drafter
from verispec.drafters.specs import split_specs
from verispec.drafters.prefix import common_prefix_length
from verispec.engine.build import EngineBuilder
from verispec.engine.loop import Engine, GenerationConfig
from verispec.models.cuda_graphs import MAX_CHAIN, graphs_wanted
from verispec.models.device import resolve_device, synchronize
from verispec.tools.bench.questions import encoded_prompts

CONFIGS = Path(__file__).with_name("configs.json")
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}


def environment(device: torch.device) -> dict:
    """What the numbers were measured on."""
    info = {"kind": "env", "torch": torch.__version__, "cuda": torch.version.cuda, "device": str(device),
            "python": platform.python_version(), "cpu": platform.processor() or platform.machine(),
            "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}
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


def build_random_model(name: str, folder: Path, tiny: bool, seed: int, sharpen: float, device: torch.device) -> Path:
    """A Hugging Face folder with random weights of the shipped `name`'s config (tiny: shrunk) and a
    word-level tokenizer ("t0" … ), with no EOS so that every run makes the same number of tokens.
    The weights are drawn on `device` (a 1.5B model's initialisation takes over a minute on a CPU).
    The head is scaled by `sharpen`: a random model's top logits are otherwise nearly tied, and greedy
    outputs of kernels that round differently part at once (timing does not depend on values). It is never tied
    to the embeddings (SmolLM2's is): a random tied head scores each token highest after itself, so every output
    would repeat its prompt's last token (the same bytes a step either way)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    values = dict(json.loads(CONFIGS.read_text())[name])
    values.update(TINY if tiny else {}, tie_word_embeddings=False)
    values.setdefault("rope_theta", values.get("rope_parameters", {}).get("rope_theta", 10000.0))
    model_type = values.pop("model_type")
    config = AutoConfig.for_model(model_type, **values, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if not tiny else torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharpen)
    model.save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t1"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t1").save_pretrained(folder)
    return folder


def elapsed(run, device: torch.device, repeats: int) -> float:
    """The median seconds of `run()` over `repeats` calls (after one warm-up, which may capture a graph), the device waited for."""
    run()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cost_curve(runner, device: torch.device, widths: list[int], context: int, repeats: int, graphs: bool) -> list[float]:
    """T(n) for each n in `widths` after `context` cached positions, launched eagerly or replayed as
    graphs (`runner.use_graphs`: the path decoding takes, input copies and logits included)."""
    runner.use_graphs(graphs)
    cache = runner.new_cache(context + max(widths) + 1)
    runner.forward(cache, torch.zeros(context, dtype=torch.long, device=device), logits="none")  # prefill, eager
    seconds = []
    for n in widths:
        tokens = torch.randint(0, runner.config.vocab_size, (n,), device=device)  # [n]
        # a chain longer than a step replays only as a token tree (a causal one: the same attention)
        tree = n > MAX_CHAIN and graphs
        positions = torch.arange(context, context + n) if tree else None  # [n]
        causal = torch.ones(n, n, dtype=torch.bool).tril() if tree else None  # [n, n]

        def step(tokens=tokens, positions=positions, causal=causal):
            runner.forward(cache, tokens, positions, causal, logits="all")
            cache.truncate(context)

        seconds.append(elapsed(step, device, repeats))
    cache.release()
    return seconds


def method_and_policy(entry: str, gamma: int) -> tuple[str, int, str]:
    """(drafter spec, γ, γ policy) of a --methods entry: SPEC (γ constant at --gamma), SPEC@N (constant N)
    or SPEC@POLICY (that policy, starting from --gamma)."""
    spec, _, how = entry.partition("@")
    if not how:
        return spec, gamma, "constant"
    if how.isdigit():
        return spec, int(how), "constant"
    check_gamma_policy(how, gamma)
    return spec, gamma, how


def fresh_engine(builder: EngineBuilder, method: str, gamma: int, policy: str, stop: bool) -> Engine:
    """An engine over a drafter built anew, not the builder's shared one: a drafter that learns across
    requests (STAND's table) starts empty in every pass, so no pass is drafted from an earlier pass over
    the same prompts."""
    target = builder.target()
    if not stop:
        target.eos_ids = frozenset()
    return Engine(target, make_drafter(method, target, load=builder.models), gamma, policy, drafter_spec=method,
                  models=builder.models)


def timed_pass(engine: Engine, prompts: list[list[int]], new_tokens: int, device: torch.device) -> dict:
    """One greedy generation per prompt: seconds, outputs, steps and acceptance counts."""
    config = GenerationConfig(max_new_tokens=new_tokens, chat=False)
    synchronize(device)
    start, outputs, steps, accepted, judged, on_device = time.perf_counter(), [], 0, 0, 0, False
    for prompt in prompts:
        result = engine.generate(prompt, config)
        on_device |= "device steps" in result.stats.phases
        outputs.append(result.token_ids)
        steps += result.stats.steps
        accepted += result.stats.acceptance.accepted
        judged += result.stats.acceptance.judged
    synchronize(device)
    return {"seconds": time.perf_counter() - start, "outputs": outputs, "steps": steps, "accepted": accepted, "judged": judged,
            "device_steps": on_device}


def cold_pass(builder: EngineBuilder, method: str, gamma: int, policy: str, stop: bool, prompts: list[list[int]],
              new_tokens: int, device: torch.device) -> tuple[dict, Engine]:
    """A pass over the prompts that captures the graphs of the widths and cache capacities they meet (and lets
    an analytic policy measure its costs), and a fresh engine for the pass that is timed after it."""
    cold = timed_pass(fresh_engine(builder, method, gamma, policy, stop), prompts, new_tokens, device)
    return cold, fresh_engine(builder, method, gamma, policy, stop)


def verispec_speed(builder: EngineBuilder, method: str, prompts: list[list[int]], new_tokens: int, gamma: int,
                   device: torch.device, stop: bool, policy: str = "constant") -> tuple[dict, list[list[int]]]:
    """tok/s of verispec's `method` (a drafter spec; "none": plain) with `gamma` and its `policy` over the
    prompts, greedy, and the outputs (stop: at the model's EOS, else exactly `new_tokens` each). Two passes,
    each with a fresh drafter: a cold one, which captures the graphs of the widths and cache capacities
    the prompts meet (and an analytic policy measures its costs), reported as `cold_tok_s`; then the timed
    one, which replays them. `same_as_cold`: outputs of the two passes that agree (the same prompt, the same
    graphs: they should all agree), and where each pair parts (`cold_common_prefix`)."""
    cold, engine = cold_pass(builder, method, gamma, policy, stop, prompts, new_tokens, device)
    run = timed_pass(engine, prompts, new_tokens, device)
    tokens = sum(len(ids) for ids in run["outputs"])
    failed = engine.target.runner._graphs.failed if engine.target.runner.graphs else None
    return ({"kind": "speed", "system": "verispec", "method": method, "policy": policy, "graphs": engine.target.runner.graphs,
             "device_steps": run["device_steps"],  # whole steps on the device (`engine/device_steps.py`)
             "graph_failure": failed, "tokens": tokens, "seconds": run["seconds"], "tok_s": tokens / run["seconds"],
             "cold_tok_s": sum(len(ids) for ids in cold["outputs"]) / cold["seconds"],
             "same_as_cold": sum(a == b for a, b in zip(run["outputs"], cold["outputs"])),
             "cold_common_prefix": [common_prefix_length(a, b) for a, b in zip(run["outputs"], cold["outputs"])],
             "tau": tokens / max(run["steps"], 1),
             "alpha": run["accepted"] / run["judged"] if run["judged"] else None}, run["outputs"])


def batch_speed(builder: EngineBuilder, entry: str, prompts: list[list[int]], new_tokens: int, gamma: int,
                device: torch.device, stop: bool, requests: int, alone: list[list[int]] | None) -> dict:
    """tok/s of `Engine.generate_batch` over `requests` requests (the prompts repeated) stepped together (a server's
    regime: one target pass for all, launched eagerly; a greedy request's γ sized for the batch, `control/batch.py`),
    after a warm-up batch of two; `same_as_alone`: results whose tokens are those of the prompt decoded plain alone
    (`alone`; None: not compared) — for a speculative method also whether it kept plain's tokens under load."""
    method, gamma, policy = method_and_policy(entry, gamma)
    engine = fresh_engine(builder, method, gamma, policy, stop)
    config = GenerationConfig(max_new_tokens=new_tokens, chat=False)
    batch = [prompts[i % len(prompts)] for i in range(requests)]
    engine.generate_batch(batch[:2], config, max_batch=2)
    synchronize(device)
    start = time.perf_counter()
    results = engine.generate_batch(batch, config, max_batch=requests)
    synchronize(device)
    seconds, tokens = time.perf_counter() - start, sum(len(r.token_ids) for r in results)
    same = None if alone is None else sum(r.token_ids == alone[i % len(alone)] for i, r in enumerate(results))
    return {"kind": "batch", "system": "verispec", "method": method, "gamma": gamma, "policy": policy, "requests": requests,
            "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "same_as_alone": same}


def host_profile(builder: EngineBuilder, entry: str, prompts: list[list[int]], new_tokens: int, gamma: int,
                 device: torch.device, stop: bool, top: int) -> dict:
    """Where the host's time goes in one pass of `entry` (a --methods entry) over the prompts (after an
    untimed pass that captures the graphs): the `top` functions by own time, under cProfile (which slows
    Python: shares, not speeds)."""
    import cProfile
    import pstats

    method, gamma, policy = method_and_policy(entry, gamma)
    _, engine = cold_pass(builder, method, gamma, policy, stop, prompts, new_tokens, device)
    profiler = cProfile.Profile()
    profiler.enable()
    steps = timed_pass(engine, prompts, new_tokens, device)["steps"]
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive calls, own, cumulative, callers)
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    return {"kind": "profile", "method": method, "gamma": gamma, "policy": policy, "steps": steps,
            "seconds": sum(row[2] for row in stats.values()),
            "top": [[f"{Path(file).name}:{line}({name})", calls, round(own, 4), round(cumulative, 4)]
                    for (file, line, name), (calls, _, own, cumulative, _) in rows]}


def hf_speed(target, assistant, method: str, prompts: list[list[int]], new_tokens: int, device: torch.device,
             eos: frozenset[int] | None) -> dict:
    """tok/s of Hugging Face `generate()`: plain, assisted or prompt lookup, greedy; up to the first of `eos`
    (None: exactly `new_tokens` tokens)."""
    extra = {"plain": {}, "assisted": {"assistant_model": assistant}, "prompt_lookup": {"prompt_lookup_num_tokens": 10}}[method]
    stopping = {"eos_token_id": sorted(eos), "pad_token_id": min(eos)} if eos else {"min_new_tokens": new_tokens, "pad_token_id": 0}
    kwargs = dict(do_sample=False, max_new_tokens=new_tokens, **stopping, **extra)

    def run(prompt, limit=None):
        ids = torch.tensor([prompt], device=device)
        with torch.inference_mode():
            return target.generate(ids, attention_mask=torch.ones_like(ids), **{**kwargs, **(limit or {})})

    run(prompts[0], {"max_new_tokens": 4} if eos else {"max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
    synchronize(device)
    start, tokens = time.perf_counter(), 0
    for prompt in prompts:
        tokens += run(prompt).shape[1] - len(prompt)
    synchronize(device)
    seconds = time.perf_counter() - start
    return {"kind": "speed", "system": "hf", "method": method, "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}


def agreement(outputs: list[list[int]], reference: list[list[int]] | None) -> dict:
    """How far each output equals plain decoding's: whole outputs equal, and the tokens before the first difference."""
    if reference is None:
        return {"same_as_plain": None}
    return {"same_as_plain": sum(a == b for a, b in zip(outputs, reference)), "prompts": len(outputs),
            "common_prefix": [common_prefix_length(a, b) for a, b in zip(outputs, reference)]}


def predictions(curves: dict, alphas: dict[str, float], max_gamma: int = 8) -> list[dict]:
    """Speedups over plain graph-replayed decoding the theory predicts for γ = 1 … max_gamma from the
    measured graph curves (the draft's c and catch-up for `model`; 0 for model-free drafters) and
    acceptance measured elsewhere (the real models on a CPU: random weights agree with nothing)."""
    target, draft = curves[("target", "graph")], curves[("draft", "graph")]
    verify = curve_verify_cost(target)
    rows = []
    for method, alpha in alphas.items():
        c, catch_up = (draft[0] / target[0], draft[1] / draft[0]) if method == "model" else (0.0, 1.0)
        speedups = [expected_speedup(alpha, gamma, c, verify, catch_up) for gamma in range(1, max_gamma + 1)]
        best = max(range(max_gamma), key=speedups.__getitem__)
        rows.append({"kind": "predicted", "method": method, "alpha": alpha, "c": c, "catch_up": catch_up,
                     "speedups_by_gamma": speedups, "gamma": best + 1, "speedup_over_plain": speedups[best]})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cpu or auto")
    parser.add_argument("--dtype", default=None,
                        help="float32 | bfloat16 | float16 (default: bfloat16 on a GPU, float32 on a CPU)")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="a name in configs.json")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct", help="a name in configs.json")
    parser.add_argument("--tiny", action="store_true", help="shrunk shapes (a CPU smoke test in seconds)")
    parser.add_argument("--max-n", type=int, default=None, help="widths 1 … N for T(n) (default 64; 4 with --tiny)")
    parser.add_argument("--eager-widths", default="1,2,3,4,5,6,8,9,12,16,17,24,32,48,64",
                        help="the widths timed with eager launches too (≤ --max-n)")
    parser.add_argument("--context", type=int, default=256, help="cached positions before each timed forward")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per width (default 20; 2 with --tiny)")
    parser.add_argument("--methods", default=None,
                        help="verispec drafter specs (none: plain; default none,ngram,model,tree,hybrid, or with --real and no "
                             "--real-draft none,ngram,stand), each at --gamma, or SPEC@N (γ N) or SPEC@POLICY (e.g. ngram@heuristic)")
    parser.add_argument("--no-launched", action="store_true", help="skip plain decoding launched eagerly (slow on a GPU)")
    parser.add_argument("--host-steps", action="store_true",
                        help="time each replayed method also with its steps through the host (VERISPEC_DEVICE_STEPS=0), in turns")
    parser.add_argument("--profile", default="", help="--methods entries whose host time is profiled too (cProfile, top 30)")
    parser.add_argument("--batch", default="", help="requests stepped together (e.g. 4,16): `Engine.generate_batch` tok/s of "
                                                    "plain and each --methods entry at each count")
    parser.add_argument("--hf-methods", default=None,
                        help="Hugging Face generate() modes (default plain,assisted,prompt_lookup; assisted needs a draft; none: no HF run)")
    parser.add_argument("--real", type=Path, default=None,
                        help="a real model folder as the target (`ship_weights.py` brings one): acceptance is real too")
    parser.add_argument("--real-draft", type=Path, default=None, help="a real draft model folder for --real")
    parser.add_argument("--questions", type=Path, default=None,
                        help="with --real: a Spec-Bench/MT-bench JSONL file whose first turns are the prompts (chat template)")
    parser.add_argument("--per-category", type=int, default=1, help="with --questions: prompts per category")
    parser.add_argument("--alpha", default="model=0.72,ngram=0.40",
                        help="acceptance measured on the real models (CPU, BENCHMARKS.md) for the predicted speedups")
    parser.add_argument("--prompts", type=int, default=None, help="random prompts (default 3; 2 with --tiny)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens per prompt (default 128; 8 with --tiny)")
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--sharpen", type=float, default=20.0, help="scale of the random head (1: as initialised)")
    parser.add_argument("--out", type=Path, default=Path("gpu_measure.jsonl"))
    parser.add_argument("--workdir", type=Path, default=None, help="where the random models are written (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.real is not None and args.questions is None:
        parser.error("--real needs --questions FILE (a Spec-Bench/MT-bench JSONL file)")

    device = resolve_device(args.device)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    replay = graphs_wanted(device)  # steps replayed as graphs: on CUDA, or on a CPU with VERISPEC_CUDA_GRAPHS=everywhere
    tiny = args.tiny
    max_n = args.max_n or (4 if tiny else 64)
    repeats = args.repeats or (2 if tiny else 20)
    n_prompts, new_tokens = args.prompts or (2 if tiny else 3), args.new_tokens or (8 if tiny else 128)
    context = min(args.context, 32) if tiny else args.context
    eager_widths = [n for n in map(int, args.eager_widths.split(",")) if n <= max_n] or [1]
    alphas = {name: float(value) for name, value in (item.split("=") for item in args.alpha.split(",") if item)}
    has_draft = args.real is None or args.real_draft is not None
    methods = args.methods or ("none,ngram,model,tree,hybrid" if has_draft else "none,ngram,stand")
    hf_methods = args.hf_methods or ("plain,assisted,prompt_lookup" if has_draft else "plain,prompt_lookup")
    records = []

    def emit(record: dict) -> None:
        record = {**record, "dtype": dtype, "tiny": tiny}
        records.append(record)
        print(json.dumps(record), flush=True)
        args.out.write_text("".join(json.dumps(r) + "\n" for r in records))  # kept whatever fails later

    def attempt(what: str, run) -> None:
        """Run one measurement; a failure is recorded and the others go on."""
        try:
            run()
        except Exception as error:  # noqa: BLE001 (one failing method never loses the others' results)
            emit({"kind": "error", "what": what, "error": f"{type(error).__name__}: {error}"})

    emit(environment(device))
    curves: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(dir=args.workdir) as work:
        if args.real is not None:  # real weights: real acceptance, and generations stop at the model's EOS
            folders = {"target": args.real, **({"draft": args.real_draft} if args.real_draft else {})}
        else:
            folders = {role: build_random_model(name, Path(work) / role, tiny, seed, args.sharpen, device)
                       for role, name, seed in (("target", args.target, 1), ("draft", args.draft, 2))}
        names = {role: folder.name for role, folder in folders.items()} if args.real else {"target": args.target, "draft": args.draft}
        draft = str(folders["draft"]) if "draft" in folders else None
        builder = EngineBuilder(str(folders["target"]), dtype, default_draft=draft, device=str(device))
        runners = {}
        for role, name in names.items():
            model = builder.models(str(folders[role]), dtype, pack_rows=1 if role == "draft" else 4)
            if args.real is None:
                model.eos_ids = frozenset()
            runners[role] = model.runner
            for mode, widths in (("eager", eager_widths), ("graph", list(range(1, max_n + 1)))):
                def measure(role=role, name=name, mode=mode, widths=widths):
                    seconds = cost_curve(runners[role], device, widths, context, repeats, mode == "graph")
                    curves[(role, mode)] = seconds
                    emit({"kind": "cost", "model": name, "role": role, "mode": mode, "context": context, "widths": widths,
                          "seconds": seconds, "ratio": [t / seconds[0] for t in seconds]})
                attempt(f"T(n) {role} {mode}", measure)
            runners[role].use_graphs(replay)  # back to the default
        target = builder.target()
        if args.real is not None:  # the questions' first turns in the target's chat template
            prompts = encoded_prompts(target, str(args.questions), args.per_category)
        else:
            generator = torch.Generator().manual_seed(0)
            prompts = [torch.randint(2, target.vocab_size, (args.prompt_tokens,), generator=generator).tolist()
                       for _ in range(n_prompts)]
        stop = args.real is not None
        plain: dict[bool, list[list[int]]] = {}
        plain_modes = [True] if args.no_launched else [False, True]
        step_modes = ["1", "0"] if args.host_steps and replay else ["1"]  # VERISPEC_DEVICE_STEPS: on the device, then the host

        def in_turns(what: str, run) -> None:
            """`run` once per step mode (`--host-steps`; the host's only where the first took device steps), the
            setting restored after."""
            for mode in step_modes:
                os.environ["VERISPEC_DEVICE_STEPS"] = mode
                attempt(f"{what} device_steps={mode}", run)
                if not records[-1].get("device_steps"):
                    break
            os.environ.pop("VERISPEC_DEVICE_STEPS")

        for graphs in (plain_modes if replay else [False]):  # plain decoding launched, then replayed
            def measure_plain(graphs=graphs):
                runners["target"].use_graphs(graphs)
                record, outputs = verispec_speed(builder, "none", prompts, new_tokens, args.gamma, device, stop)
                plain.setdefault(graphs, outputs)  # the reference: the first mode's
                emit({**record, "gamma": 0})
            (in_turns if graphs else attempt)(f"plain graphs={graphs}", measure_plain)
        runners["target"].use_graphs(replay)
        reference = plain.get(replay)
        for entry in [m for m in split_specs(methods) if m != "none"]:
            def measure_method(entry=entry):
                method, gamma, policy = method_and_policy(entry, args.gamma)
                record, outputs = verispec_speed(builder, method, prompts, new_tokens, gamma, device, stop, policy)
                emit({**record, "gamma": gamma, **agreement(outputs, reference)})
            in_turns(f"verispec {entry}", measure_method)
        for entry in split_specs(args.profile):
            attempt(f"profile {entry}", lambda entry=entry: emit(host_profile(builder, entry, prompts, new_tokens, args.gamma,
                                                                              device, stop, top=30)))
        for requests in [int(k) for k in args.batch.split(",") if k]:
            for entry in split_specs(methods):
                attempt(f"batch {requests} {entry}", lambda entry=entry, requests=requests: emit(batch_speed(
                    builder, entry, prompts, new_tokens, args.gamma, device, stop, requests, reference)))
        if reference is not None:  # plain again after the methods: how far the machine drifted meanwhile
            attempt("plain again", lambda: emit({**verispec_speed(builder, "none", prompts, new_tokens, args.gamma, device,
                                                                   stop)[0], "gamma": 0, "again": True}))
        if False in plain and True in plain:
            emit({"kind": "flips", "what": "plain replayed vs plain launched", **agreement(plain[False], reference)})
        hf_runs = [m.strip() for m in hf_methods.split(",") if m.strip() not in ("", "none")]
        if hf_runs:
            from transformers import AutoModelForCausalLM

            torch_dtype = getattr(torch, dtype)
            hf = {role: AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype).to(device).eval()
                  for role, folder in folders.items()}
            eos = target.eos_ids if stop else None
        for method in hf_runs:
            attempt(f"hf {method}", lambda method=method: emit(hf_speed(hf["target"], hf.get("draft"), method, prompts,
                                                                        new_tokens, device, eos)))
    if args.real is None and ("target", "graph") in curves and ("draft", "graph") in curves:
        for row in predictions(curves, alphas):
            emit(row)
    print(f"wrote {len(records)} records to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
