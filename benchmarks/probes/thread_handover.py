"""What a thread's left-over OpenMP pool costs another thread's decoding (`models/openmp.py`), in turns on one engine.

An app that loads (or generates once) on its main thread, then generates on worker threads: each public prompt is
generated on the main thread, then on a fresh worker thread right after, with the engine's releases as shipped
(`generate` lets the main thread's pool go as it returns) and with them turned off (the main thread's pool stays
alive beside the worker's, as before the fix). A handover that costs nothing gives the worker the main thread's
speed: the ratio printed is worker / main tok/s, predicted 1.00.

    .venv/bin/python benchmarks/probes/thread_handover.py --per-category 1 --rounds 2
"""

from __future__ import annotations

import argparse
import contextlib
import threading
import time
from unittest import mock

from verispec import GenerationConfig, load
from verispec.engine import build, loop
from verispec.paths import cpu_summary
from verispec.tools.bench.questions import load_sources, select


def tokens_per_second(engine, prompt: str, config: GenerationConfig, on_worker: bool) -> float:
    """One `generate` of `prompt`, on this thread or on a fresh one: its tok/s."""
    done = []

    def run() -> None:
        started = time.perf_counter()
        result = engine.generate(prompt, config)
        done.append(len(result.token_ids) / (time.perf_counter() - started))

    if on_worker:
        worker = threading.Thread(target=run)
        worker.start()
        worker.join()
    else:
        run()
    return done[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", default="question.jsonl,humaneval")
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    prompts = [p.text for p in select(load_sources(args.questions), None, args.per_category)]
    engine, config = load(), GenerationConfig(max_new_tokens=args.max_new_tokens)
    print(cpu_summary(), "·", engine.plan.summary() if engine.plan is not None else "", flush=True)
    off = lambda: False  # noqa: E731 - a release that frees nothing
    for round_ in range(args.rounds):
        for name, released in (("released (as shipped)", True), ("kept (releases off)", False)):
            with contextlib.ExitStack() as stack:
                if not released:
                    stack.enter_context(mock.patch.object(loop, "release_thread_pool", off))
                    stack.enter_context(mock.patch.object(build, "release_thread_pool", off))
                main_rates, worker_rates = [], []
                for prompt in prompts:
                    main_rates.append(tokens_per_second(engine, prompt, config, on_worker=False))
                    worker_rates.append(tokens_per_second(engine, prompt, config, on_worker=True))
            main, worker = (sum(rates) / len(rates) for rates in (main_rates, worker_rates))
            print(f"round {round_} · the main thread's pool {name}: main {main:.1f} tok/s, worker {worker:.1f} tok/s,"
                  f" worker / main {worker / main:.2f} (predicted 1.00)", flush=True)
        loop.release_thread_pool()  # the next setting starts from no pool


if __name__ == "__main__":
    main()
