"""What prompt caching saves in a conversation: time to the first token of each turn of a chat, with the
engine's prefix store (`models/prefixes.py`) and without it; with `--draft SPEC`, also the seconds the draft
model spends reading the conversation (its feeds of more than READ tokens: its own prefill after the first token, or,
where it defers that to its first proposal as `hybrid`'s does, that proposal's catching up), with its store and without.

Each turn's prompt is the whole conversation so far (the chat template applied, earlier answers
included), so all but the new user message is what the previous turn left in the store. Prints, per
turn: prompt tokens, tokens taken from the store, and the prefill's seconds (the time to the first token;
with a draft `+` its prefill's); then each cached turn's time against the prediction from the fresh run: its
seconds × the share of the prompt left to prefill (the cached part's attention is not in it, so the ratio sits a
little above 1).

    .venv/bin/python benchmarks/probes/chat_turns.py [--dtype kquant] [--max-new-tokens 96] [--rounds 2] \
        [--draft hybrid:draft=smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import time
from unittest import mock

from verispec import Engine, GenerationConfig
from verispec.drafters import base, make_drafter
from verispec.models.loading import ModelCache, load_model
from verispec.models.registry import DEFAULT_TARGET
from verispec.paths import cpu_summary

draft_prefix_store = base.draft_prefix_store
READ = 8  # a draft model's feed of more tokens than this reads the conversation (a step's feeds a few tokens)

TURNS = [
    "Write a Python function that parses a CSV line with quoted fields.",
    "Now make it handle escaped quotes inside quoted fields.",
    "Add type hints and a docstring.",
    "Write three pytest tests for it.",
]


def conversation(engine: Engine, tokenizer, max_new_tokens: int) -> list[tuple[int, int, float, float]]:
    """One chat through TURNS; per turn (prompt tokens, cached tokens, seconds to the first token, seconds of the
    draft model's reading of it: feeds of more than READ tokens)."""
    messages, rows, reading = [], [], [0.0]
    feed = base.ModelSession._feed

    def timed_feed(session, tokens, logits="last"):
        start = time.perf_counter()
        out = feed(session, tokens, logits)
        if len(tokens) > READ:
            reading[0] += time.perf_counter() - start
        return out

    with mock.patch.object(base.ModelSession, "_feed", timed_feed):
        for turn in TURNS:
            messages.append({"role": "user", "content": turn})
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            reading[0] = 0.0
            generation = engine.start(ids, GenerationConfig(max_new_tokens=max_new_tokens))  # prefilled: the first token
            first_token = generation.stats.prefill_seconds
            while not generation.done:
                generation.step()
            result = generation.result()
            messages.append({"role": "assistant", "content": result.text})
            rows.append((len(ids), result.stats.cached_tokens, first_token, reading[0]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--dtype", default="kquant", help="a precision whose runner is prefix_invariant (kquant)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--draft", default=None, help="a drafter spec (its draft model in --dtype too); default: none")
    args = parser.parse_args()
    target = load_model(args.target, args.dtype, pack_rows=8)
    drafter = make_drafter(args.draft, target, args.dtype, ModelCache(target)) if args.draft else None
    print(f"{cpu_summary()} · {args.target} · {args.dtype} · {args.draft or 'no draft'} · per turn prompt "
          "tokens:cached:seconds to the first token" + (" + the draft's reading" if drafter else ""))
    for _ in range(args.rounds):  # interleaved: with the stores, then without
        runs = {}
        for cached in (True, False):
            engine = Engine(target, drafter)
            if not cached:
                engine.prefixes = None
            base.draft_prefix_store = draft_prefix_store if cached else (lambda model: None)
            runs[cached] = conversation(engine, target.tokenizer, args.max_new_tokens)
            print("cached" if cached else "fresh ", " ".join(f"{n}:{hit}:{s:.2f}s" + (f"+{d:.2f}s" if drafter else "")
                                                             for n, hit, s, d in runs[cached]), flush=True)
        ratios = [s / (fresh * (n - hit) / n) for (n, hit, s, _), (_, _, fresh, _) in zip(runs[True], runs[False]) if hit]
        print("cached turns, measured / predicted:", " ".join(f"{r:.2f}" for r in ratios), flush=True)


if __name__ == "__main__":
    main()
