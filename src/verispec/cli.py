"""The `verispec` command line: generate, chat, serve, batch, bench, analyze, design, quality, models.

`verispec generate "prompt"` streams the answer with each token coloured by where it came from
(green: draft token the target accepted; yellow: recovered after a rejection; blue: bonus token;
plain: the target alone), then prints a one-line summary. `--json` prints one JSON object instead.
`verispec chat` does the same turn after turn at the terminal.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.text import Text

from verispec.engine.spec import AUTO, EngineSpec
from verispec.errors import InvalidParameterError, PromptError, VerispecError
from verispec.serving.http.limits import ServerLimits
from verispec.types import Origin

__all__ = ["main"]

UNTIL_STOP = sys.maxsize  # max_new_tokens without a limit: the engine stops at the model's context
BEAM_MAX_NEW_TOKENS = 128
# A prompt continued as raw text (--raw, or a model without a chat template: a base model) has no end of
# turn to wait for, and a base model rarely ends by itself: without --max-new-tokens it gets this many.
RAW_MAX_NEW_TOKENS = 256
ORIGIN_STYLES = {Origin.ACCEPTED: "green", Origin.RECOVERED: "yellow", Origin.BONUS: "bold blue", Origin.TARGET: ""}
LIMITS = ServerLimits()  # `serve`'s defaults


def _add_ray_address(parser) -> None:
    parser.add_argument("--ray-address", default=None,
                        help="join this Ray cluster (host:6379, ray://host:10001, or auto); default: start a local instance")


def _add_sampling_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="at most this many new tokens (default: until the model stops or its context is full; "
                        f"{RAW_MAX_NEW_TOKENS} for a prompt continued as raw text: --raw, or a model without a chat "
                        f"template; {BEAM_MAX_NEW_TOKENS} with --num-beams)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--eta", type=float, default=0.0, help="η-sampling ε (0.0009 is usual; 0 = off)")
    parser.add_argument("--epsilon", type=float, default=0.0, help="ε-sampling cutoff (0 = off)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="Hugging Face's, over prompt and output (1 = off)")
    parser.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, over the output, in [-2, 2] (0 = off)")
    parser.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, over the output, in [-2, 2] (0 = off)")
    parser.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                        help="add BIAS in [-100, 100] to token ID's logit (repeatable; -100 bans it)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--min-tokens", type=int, default=0, help="no end of the answer before this many new tokens")
    parser.add_argument("--ignore-eos", action="store_true", help="generate past the end of the answer (needs --max-new-tokens)")
    parser.add_argument("--num-beams", type=int, default=1,
                        help="beam search with the target alone when > 1 (deterministic; the draft is not used)")


def _logit_bias(pairs: list[str]) -> dict[int, float]:
    """`--logit-bias ID=BIAS` options as a mapping, or a clear error."""
    bias = {}
    for pair in pairs:
        token, _, value = pair.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise InvalidParameterError(f"--logit-bias takes ID=BIAS (a token id and a number), got {pair!r}") from None
    return bias


def _config(args: argparse.Namespace):
    """The GenerationConfig the sampling options ask for."""
    from verispec import GenerationConfig, SamplingParams

    sampling = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        eta=args.eta, epsilon=args.epsilon, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty, logit_bias=_logit_bias(args.logit_bias),
    )
    # no --max-new-tokens: until the model stops or the context is full (the engine caps it at the context)
    max_new_tokens = args.max_new_tokens if args.max_new_tokens is not None else UNTIL_STOP
    if args.ignore_eos and args.max_new_tokens is None:
        raise InvalidParameterError("--ignore-eos needs --max-new-tokens: nothing else would end the answer")
    return GenerationConfig(max_new_tokens=max_new_tokens, sampling=sampling, seed=args.seed, stop=tuple(args.stop),
                            chat=not getattr(args, "raw", False), min_tokens=args.min_tokens, ignore_eos=args.ignore_eos,
                            suffix=getattr(args, "suffix", None))


def _planned_engine(args: argparse.Namespace):
    """The engine the options ask for, its plan (when it planned one) printed in one line."""
    engine = EngineSpec.from_args(args)()
    if engine.plan is not None:
        Console(stderr=True, highlight=False).print(f"[dim]{engine.plan.summary()}[/dim]")
    return engine


def _stream(generation, out: Console | None) -> bool:
    """Run `generation` to its end, printing each piece of text coloured by its origin (nothing when `out` is
    None); Ctrl-C stops it cleanly (statistics cover the tokens produced so far). Returns whether it was."""
    try:
        while not generation.done:
            for event in generation.step():
                if out is not None:
                    out.print(Text(event.text, style=ORIGIN_STYLES[event.origin]), end="")
    except KeyboardInterrupt:
        held_back = generation.cancel("interrupted")
        if held_back and out is not None:
            out.print(held_back, end="")
        return True
    return False


def _priced(generation) -> str:
    """The summary's `steps 1.03× priced · ` where the γ policy priced the steps: their measured draft and target
    seconds over what its cost model prices them at (`CostModel.priced_seconds`). Far from 1, the machine runs other
    than when its costs were measured, or the model misses a cost."""
    costs, s = getattr(generation.policy, "costs", None), generation.stats
    steps = [record for record in s.records if record.target_seconds > 0]  # not the first token's: the prefill gave it
    priced = costs.priced_seconds(steps, s.prompt_tokens + 1) if costs is not None and steps else None
    if not priced or not sum(priced):
        return ""
    return f"steps {(s.draft_seconds + s.target_seconds) / sum(priced):.2f}× priced · "


def _summary(generation) -> None:
    """The one-line summary of a finished generation, on stderr."""
    s = generation.stats
    legend = Text.assemble(("accepted", "green"), " ", ("recovered", "yellow"), " ", ("bonus", "bold blue"))
    Console(stderr=True, highlight=False).print(
        f"[dim]{s.new_tokens} tokens in {s.wall_seconds:.2f}s ({s.tokens_per_second:.2f} tok/s) · "
        f"{s.steps} steps · τ {s.mean_accepted_length:.2f} · α {s.acceptance_rate:.2f} · c {s.cost_ratio:.2f} · "
        f"{_priced(generation)}prefill {s.prefill_seconds:.2f}s{f' ({s.cached_tokens} cached)' if s.cached_tokens else ''} · "
        f"finish: {generation.finish_reason} ·[/dim]",
        legend,
    )


def _keep_prompts(engine) -> None:
    """Leave the prompt cache for the next command (`models/prefixes.py`; where the backend keeps one)."""
    if engine.prefixes is not None:
        engine.prefixes.save()


def _generate(args: argparse.Namespace) -> int:
    config = _config(args)
    if args.num_beams > 1:
        return _beam(args, config)
    engine = _planned_engine(args)
    if args.max_new_tokens is None and config.suffix is None and not engine.target.wraps_in_chat_template(not args.raw):
        config = dataclasses.replace(config, max_new_tokens=RAW_MAX_NEW_TOKENS)
        Console(stderr=True).print(
            f"[yellow]note:[/yellow] {'--raw' if args.raw else f'{engine.target.name} has no chat template'}: the prompt is "
            f"continued as raw text, which rarely ends by itself; at most {RAW_MAX_NEW_TOKENS} new tokens "
            "(--max-new-tokens N for another limit)")
    out = Console(highlight=False)
    generation = engine.start(args.prompt, config)
    interrupted = _stream(generation, None if args.json else out)
    _keep_prompts(engine)
    if args.json:
        print(json.dumps(generation.result().to_dict(), ensure_ascii=False))
    else:
        out.print()
        _summary(generation)
    return 130 if interrupted else 0


def _chat(args: argparse.Namespace) -> int:
    """A conversation at the terminal: each answer is what `generate` gives for the whole conversation so far
    (the same template, drafter and exactness); the engine's prompt cache keeps the turns already read
    where it is exact (kquant), so a turn prefills only what is new. Ctrl-C stops an answer, not the chat."""
    if args.num_beams > 1:
        raise InvalidParameterError("chat answers with the planned drafter; beam search (--num-beams) is `generate`'s")
    config = _config(args)
    engine = _planned_engine(args)
    if not engine.target.wraps_in_chat_template(True):
        raise PromptError(f"{engine.target.name} has no chat template: use `verispec generate --raw` to continue text")
    opening = [{"role": "system", "content": args.system}] if args.system else []
    conversation = list(opening)
    out = Console(highlight=False)
    Console(stderr=True, highlight=False).print("[dim]/reset starts a new conversation; /exit or Ctrl-D ends[/dim]")
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            out.print()
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            conversation = list(opening)
            continue
        if not line.strip():
            continue
        conversation.append({"role": "user", "content": line})
        generation = engine.start(engine.target.encode_chat(conversation), config)
        _stream(generation, out)
        out.print()
        _summary(generation)
        _keep_prompts(engine)
        conversation.append({"role": "assistant", "content": generation.result().text})


def _beam(args: argparse.Namespace, config) -> int:
    from verispec.models.loading import load_model
    from verispec.engine.beam import beam_search

    if config.suffix is not None:
        raise InvalidParameterError("--suffix: not with --num-beams (beam search continues a prompt)", param="suffix")
    sampling = config.sampling
    if not sampling.greedy or sampling.penalised or sampling.logit_bias:
        Console(stderr=True).print("[yellow]note:[/yellow] beam search ranks the target's own log-probabilities; "
                                   "sampling options, penalties and logit bias are ignored")
    target = load_model(args.target, "float32" if args.dtype == AUTO else args.dtype)  # beams need verispec's runner
    prompt_ids = target.encode_prompt(args.prompt, chat=not args.raw)
    # beams allocate a cache of prompt + max_new slots each: without --max-new-tokens they keep a bounded default
    max_new = args.max_new_tokens if args.max_new_tokens is not None else BEAM_MAX_NEW_TOKENS
    result = beam_search(target, prompt_ids, args.num_beams, max_new)
    text = target.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    if args.json:
        print(json.dumps({"text": text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
                          "score": result.score, "num_beams": args.num_beams}, ensure_ascii=False))
    else:
        print(text)
    return 0


def _models(args: argparse.Namespace) -> int:
    from verispec.models.gguf_weights import kquant_requantizes, kquant_runs
    from verispec.models.loading import precisions_for
    from verispec.models.registry import SHIPPED_MODELS, prepare_shipped_model
    from verispec.models.vocabulary import vocabulary_difference
    from verispec.paths import cache_dir

    if args.pull:
        for name in args.pull:
            print(prepare_shipped_model(name))
        return 0
    families = _tokenizer_families([cache_dir() / "hf" / name for name in SHIPPED_MODELS])
    for name in SHIPPED_MODELS:
        folder = cache_dir() / "hf" / name
        model_type = _shipped_model_type(name)
        state = "converted" if (folder / "config.json").exists() else "not yet converted (pulled on first use)"
        if model_type is None:  # every shipped model is a GGUF: llama.cpp runs it whatever its architecture
            runs = f"gguf (llama.cpp); the others once pulled (verispec models --pull {name})"
        else:
            by_backend: dict[str, list[str]] = {}
            gguf = cache_dir() / "gguf" / f"{name}.gguf"
            for precision, backend in precisions_for(model_type, gguf=True).items():
                if precision == "kquant" and not (gguf.exists() and kquant_runs(gguf)):  # the file's own Q4_K/Q6_K
                    if not (gguf.exists() and kquant_requantizes(gguf)):
                        continue
                    precision = "kquant (a requantized copy: another rounding, for drafts)"
                by_backend.setdefault(backend, []).append(precision)
            runs = " · ".join(f"{', '.join(names)} ({backend})" for backend, names in by_backend.items())
        print(f"{name:30s} {model_type or '?':12s} {state:40s} {runs}")
        if folder in families:
            same = [other.name for other in families
                    if other != folder and vocabulary_difference(families[other], families[folder]) is None]
            pairs = f"every drafter with {', '.join(same)} (same tokenizer); " if same else ""
            print(f"{'':30s} drafts: {pairs}model:NAME / gguf:NAME with any other model (through the text)")
    return 0


def _tokenizer_families(folders: list) -> dict:
    """{converted folder: its vocabulary}, for the folders with a tokenizer.json (`models.vocabulary`)."""
    from verispec.models.vocabulary import file_vocabulary

    return {folder: file_vocabulary(folder / "tokenizer.json") for folder in folders if (folder / "tokenizer.json").exists()}


def _shipped_model_type(name: str) -> str | None:
    """The model type of a shipped model: its converted folder's config.json, else its GGUF's
    general.architecture when the file is already here; None before it is pulled."""
    from verispec.models.registry import SHIPPED_MODELS
    from verispec.paths import cache_dir

    config = cache_dir() / "hf" / name / "config.json"
    if config.exists():
        return json.loads(config.read_text()).get("model_type")
    gguf = cache_dir() / "gguf" / f"{name}.gguf"
    model = SHIPPED_MODELS[name]
    if model.layout == "file":
        import importlib.util

        spec = importlib.util.find_spec(model.module_prefix)
        if spec is not None and spec.submodule_search_locations:
            gguf = Path(next(iter(spec.submodule_search_locations))) / model.file_name
    from verispec.models.gguf_weights import gguf_architecture

    return gguf_architecture(gguf) if gguf.exists() else None


def _serve(args: argparse.Namespace) -> int:
    """Check every setting (`_check_serve`), then load the models once and serve: alone, or on Ray."""
    spec, limits = _check_serve(args)
    if args.ray:
        return _serve_on_ray(args, spec, limits)
    from verispec.engine.together import mixes_prompts
    from verispec.errors import InvalidParameterError
    from verispec.serving.http import create_app
    from verispec.serving.http.scheduler import kv_bytes_per_token, memory_limits, prefill_chunks
    from verispec.serving.http.server import run

    engine = spec()  # once, before serving
    if engine.plan is not None:
        Console(stderr=True, highlight=False).print(engine.plan.summary())
    busy, idle = prefill_chunks(engine, limits.prefill_chunk)  # measured now (once per model and CPU), then read
    app = create_app(engine, model_name=args.model_name, limits=limits)
    try:  # resolved as the scheduler will; an impossible limit is refused now, not at start-up inside uvicorn
        pool, max_model_len = memory_limits(engine, limits.max_batch, limits.kv_pool_tokens, limits.max_model_len)
    except ValueError as error:
        raise InvalidParameterError(str(error)) from None
    per_token = kv_bytes_per_token(engine)
    size = f" = {pool * per_token / 2**30:.2f} GiB of target cache" if per_token else ""
    console = Console(stderr=True)
    riding = " riding in the decoding requests' pass" if busy and mixes_prompts(engine.target.runner) else ""
    console.print(f"KV pool {pool} positions{size}; at most {max_model_len} positions per request; "
                  f"prefill chunk {busy or 'whole prompt'}{riding}" + (f" ({idle} while none decodes)" if idle != busy else ""))
    console.print(f"serving {args.model_name or engine.target.name} on http://{args.host}:{args.port} "
                  "(playground at /, OpenAI API under /v1)")
    run(app, args.host, args.port, args.max_connections, args.keep_alive)
    return 0


def _check_serve(args: argparse.Namespace) -> tuple[EngineSpec, ServerLimits]:
    """serve's engine settings and limits, every one checked before anything loads (or Ray starts)."""
    from verispec.drafters.specs import MAX_GAMMA
    from verispec.errors import InvalidParameterError

    if not 1 <= args.gamma <= MAX_GAMMA:
        raise InvalidParameterError(f"--gamma must lie in 1…{MAX_GAMMA}, got {args.gamma}")
    if args.keep_alive <= 0 or (args.max_connections is not None and args.max_connections < 1):
        raise InvalidParameterError(f"--keep-alive must be > 0 and --max-connections ≥ 1, got {args.keep_alive} and "
                                    f"{args.max_connections}")
    return EngineSpec.from_args(args), ServerLimits.from_args(args)


def _serve_on_ray(args: argparse.Namespace, spec: EngineSpec, limits: ServerLimits) -> int:
    from verispec.serving.cluster.serve import ServeOptions, run_cli

    options = ServeOptions(
        replicas=args.replicas, min_replicas=args.min_replicas, max_replicas=args.max_replicas, replica_cpus=args.replica_cpus,
        target_ongoing_requests=args.target_ongoing_requests, host=args.host, port=args.port, model_name=args.model_name,
        **dataclasses.asdict(limits),
    )
    return run_cli(spec, options, args.ray_address, spec.describe())


def _batch(args: argparse.Namespace) -> int:
    from pathlib import Path

    from verispec.serving.cluster.batch import BatchOptions, print_report, run_batch
    from verispec.serving.cluster.cluster import ray_session

    options = BatchOptions(actors=args.actors, actor_cpus=args.actor_cpus, batch_size=args.batch_size,
                           max_tokens=args.max_new_tokens, temperature=args.temperature, output_format=args.output_format,
                           limit=args.limit, flush_every=args.flush_every, local=args.local)
    err = Console(stderr=True, highlight=False)
    if args.local:
        report = run_batch(EngineSpec.from_args(args), args.input, args.output, options, err)
    else:
        with ray_session(args.ray_address):
            report = run_batch(EngineSpec.from_args(args), args.input, args.output, options, err)
    print_report(report, Path(args.output), Console(highlight=False))
    if report.interrupted:
        return 130
    return 0 if report.check is None or not (report.check.duplicated or report.check.unknown) else 1


def _bench(argv: list[str]) -> int:
    from verispec.tools.bench.compare import main as bench_main

    return bench_main(argv)


def _analyze(args: argparse.Namespace) -> int:
    from verispec.tools.analyze import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verispec", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text with speculative decoding")
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--suffix", default=None, help="fill in the middle: write what goes between the prompt and this text "
                                                     "(a code model's fill-in-the-middle tokens; no chat template)")
    gen.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, finish_reason, stats)")
    EngineSpec.add_arguments(gen)
    _add_sampling_options(gen)
    gen.set_defaults(func=_generate)
    chat = sub.add_parser("chat", help="a conversation at the terminal, each answer generated as `generate` would")
    chat.add_argument("--system", default=None, help="a system prompt opening the conversation")
    EngineSpec.add_arguments(chat)
    _add_sampling_options(chat)
    chat.set_defaults(func=_chat)
    models = sub.add_parser("models", help="list shipped models, or --pull NAME to install and convert")
    models.add_argument("--pull", nargs="*", metavar="NAME")
    models.set_defaults(func=_models)
    from verispec.tools.analyze import add_arguments as add_analyze_arguments

    analyze = sub.add_parser("analyze", help="expected speedup over γ from α and c, given or measured; --plots")
    add_analyze_arguments(analyze)
    analyze.set_defaults(func=_analyze)
    serve = sub.add_parser("serve", help="OpenAI-compatible server with continuous batching and a web playground")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--model-name", default=None, help="model id clients send (default: the --target spec)")
    serve.add_argument("--max-batch", type=int, default=LIMITS.max_batch, help="requests verified together in one target pass")
    serve.add_argument("--max-queue", type=int, default=LIMITS.max_queue, help="requests allowed to wait; beyond that: HTTP 429")
    serve.add_argument("--timeout", dest="request_timeout", type=float, default=LIMITS.request_timeout,
                       help="seconds per request before HTTP 504")
    serve.add_argument("--api-key", default=os.environ.get("VERISPEC_API_KEY") or LIMITS.api_key,
                       help="require 'Authorization: Bearer KEY' on every path but /health and the playground "
                            "(default: $VERISPEC_API_KEY; none: open)")
    serve.add_argument("--cors-origin", dest="cors_origins", action="append", default=[], metavar="ORIGIN",
                       help="let browser pages from this origin call the API (repeatable; e.g. https://example.org)")
    serve.add_argument("--max-body-bytes", type=int, default=LIMITS.max_body_bytes, help="larger request bodies: HTTP 413")
    serve.add_argument("--body-timeout", type=float, default=LIMITS.body_timeout,
                       help="seconds a request body may take to arrive after its headers; longer: HTTP 408")
    serve.add_argument("--max-connections", type=int, default=256,
                       help="most open connections and requests at once; more: HTTP 503 (not with --ray: Serve's proxy)")
    serve.add_argument("--keep-alive", type=float, default=5.0,
                       help="seconds an idle keep-alive connection stays open (not with --ray)")
    serve.add_argument("--shutdown-grace", type=float, default=LIMITS.shutdown_grace,
                       help="on SIGTERM or Ctrl-C: seconds running requests may go on (new ones: HTTP 503); then each ends, "
                            "a stream with finish_reason shutdown, a non-streamed request with HTTP 503. A second signal "
                            "exits at once")
    serve.add_argument("--max-tokens-limit", type=int, default=LIMITS.max_tokens_limit,
                       help="most new tokens one request may ask for; more: HTTP 400")
    serve.add_argument("--stall-seconds", type=float, default=LIMITS.stall_seconds,
                       help="/health answers 503 degraded when the scheduler has work but has not advanced for this long")
    serve.add_argument("--prefill-chunk", type=int, default=LIMITS.prefill_chunk,
                       help="prompt tokens prefilled per scheduler turn, after the other requests' decode steps "
                            "(default: what the target prefills in 0.15 s on this CPU, measured once, and on kquant what it "
                            "prefills in 1.5 s while no request decodes; a number: always that many; "
                            "0: each prompt whole, holding up everyone else meanwhile)")
    serve.add_argument("--max-model-len", type=int, default=LIMITS.max_model_len,
                       help="most positions per request, prompt + new tokens (default: the target's context); a longer "
                            "prompt: HTTP 400; generation stops there with finish_reason length")
    serve.add_argument("--kv-pool-tokens", type=int, default=LIMITS.kv_pool_tokens,
                       help="target KV cache positions all running requests may hold together (default: the larger of "
                            "--max-model-len + 64 and 2048 × --max-batch); a position costs 2 × layers × kv_heads × head_dim "
                            "× bytes per value, 56 KiB for the default 1.5B target in float32, and the server prints the "
                            "total at start. A request waits in the queue until its prompt + 256 fits; one that outgrows "
                            "the pool ends with finish_reason length")
    EngineSpec.add_arguments(serve)
    ray_group = serve.add_argument_group("Ray Serve (needs verispec[ray])")
    ray_group.add_argument("--ray", action="store_true", help="serve as replicas on Ray Serve (the same API; Serve's proxy listens on --host/--port)")
    _add_ray_address(ray_group)
    ray_group.add_argument("--replicas", type=int, default=1, help="fixed number of replicas, each loading the models once")
    ray_group.add_argument("--min-replicas", type=int, default=None, help="autoscaling: fewest replicas (with --max-replicas)")
    ray_group.add_argument("--max-replicas", type=int, default=None, help="autoscaling: most replicas (with --min-replicas)")
    ray_group.add_argument("--target-ongoing-requests", type=float, default=None,
                           help="autoscaling: requests per replica to aim for (default: --max-batch)")
    ray_group.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves per replica (its torch threads)")
    serve.set_defaults(func=_serve)
    batch = sub.add_parser("batch", help="generate for every record of a JSONL/Parquet file on Ray Data (resumable)",
                           description="Generate for every record of --input with a pool of engine actors on Ray Data. "
                           "Records: {id, prompt | messages, max_tokens?, temperature?, top_p?, top_k?, min_p?, seed?, stop?, chat?}. "
                           "Rerunning skips the ids already written to --output.")
    batch.add_argument("--input", required=True, help="a .jsonl or .parquet file, one prompt per record with a unique id")
    batch.add_argument("--output", required=True, help="folder for results/, errors/ and summary.json (a rerun resumes)")
    batch.add_argument("--output-format", choices=["jsonl", "parquet"], default=None, help="default: the input's format")
    batch.add_argument("--actors", type=int, default=1, help="engine actors (each loads the models once)")
    batch.add_argument("--actor-cpus", type=float, default=1.0, help="CPUs Ray reserves per actor (its torch threads)")
    batch.add_argument("--batch-size", type=int, default=8, help="records per actor call, verified together")
    batch.add_argument("--max-new-tokens", type=int, default=128, help="for records without max_tokens")
    batch.add_argument("--temperature", type=float, default=0.0, help="for records without temperature (0 = greedy)")
    batch.add_argument("--limit", type=int, default=None, help="run at most this many pending records now (rerun for the rest)")
    batch.add_argument("--flush-every", type=int, default=64, help="records per output part file")
    batch.add_argument("--local", action="store_true", help="no Ray: one engine in this process (same files, resume and checks)")
    _add_ray_address(batch)
    EngineSpec.add_arguments(batch)
    batch.set_defaults(func=_batch)
    from verispec.tools.bench import quality

    quality_parser = sub.add_parser("quality", help="how close one precision is to another (int8 vs float32): "
                                    "greedy agreement and mean KL of next-token distributions")
    quality.add_arguments(quality_parser)
    quality_parser.set_defaults(func=quality.run)
    from verispec.tools import design as draft_design

    design = sub.add_parser("design", help="measure candidate drafts (α, latency) and rank them by predicted speedup")
    draft_design.add_arguments(design)
    design.set_defaults(func=draft_design.run)
    sub.add_parser("bench", help="benchmark against Hugging Face generate() (see `verispec bench --help`)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except VerispecError as error:
        Console(stderr=True).print(f"[bold red]error:[/bold red] {error}")
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
