"""What prompt caching saves in a conversation: time to the first token of each turn of a chat, with the
engine's prefix store (`engine/prefixes.py`) and without it.

Each turn's prompt is the whole conversation so far (the chat template applied, earlier answers
included), so all but the new user message is what the previous turn left in the store. Prints, per
turn: prompt tokens, tokens taken from the store, and the prefill's seconds (the time to the first token);
then each cached turn's time against the prediction from the fresh run: its seconds × the share of the
prompt left to prefill (the cached part's attention is not in it, so the ratio sits a little above 1).

    .venv/bin/python benchmarks/probes/chat_turns.py [--dtype kquant] [--max-new-tokens 96] [--rounds 2]
"""

from __future__ import annotations

import argparse

from verispec import Engine, GenerationConfig
from verispec.models.loading import load_model
from verispec.models.registry import DEFAULT_TARGET
from verispec.paths import cpu_summary

TURNS = [
    "Write a Python function that parses a CSV line with quoted fields.",
    "Now make it handle escaped quotes inside quoted fields.",
    "Add type hints and a docstring.",
    "Write three pytest tests for it.",
]


def conversation(engine: Engine, tokenizer, max_new_tokens: int) -> list[tuple[int, int, float]]:
    """One chat through TURNS; per turn (prompt tokens, cached tokens, seconds to the first token)."""
    messages, rows = [], []
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        generation = engine.start(ids, GenerationConfig(max_new_tokens=max_new_tokens))  # prefilled: the first token
        first_token = generation.stats.prefill_seconds
        while not generation.done:
            generation.step()
        result = generation.result()
        messages.append({"role": "assistant", "content": result.text})
        rows.append((len(ids), result.stats.cached_tokens, first_token))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--dtype", default="kquant", help="a precision whose runner is prefix_invariant (kquant)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    target = load_model(args.target, args.dtype, pack_rows=8)
    print(f"{cpu_summary()} · {args.target} · {args.dtype} · per turn prompt tokens:cached:seconds to the first token")
    for _ in range(args.rounds):  # interleaved: with the store, then without
        runs = {}
        for cached in (True, False):
            engine = Engine(target, None)
            if not cached:
                engine.prefixes = None
            runs[cached] = conversation(engine, target.tokenizer, args.max_new_tokens)
            print("cached" if cached else "fresh ", " ".join(f"{n}:{hit}:{s:.2f}s" for n, hit, s in runs[cached]), flush=True)
        ratios = [s / (fresh * (n - hit) / n) for (n, hit, s), (_, _, fresh) in zip(runs[True], runs[False]) if hit]
        print("cached turns, measured / predicted:", " ".join(f"{r:.2f}" for r in ratios), flush=True)


if __name__ == "__main__":
    main()
