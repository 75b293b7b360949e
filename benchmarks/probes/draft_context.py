"""What a cross-vocabulary draft's context costs a proposal: `DraftContext.text` (the target's committed text) and
`DraftContext.ids` (that text in the draft's tokens) after a context of N target tokens, each call one token more than
the last, as decoding calls them; against a whole decode of the ids, which `text` did before it decoded only the ids
past a known prefix. Shipped Qwen target and SmolLM2 draft tokenizers, README.md's text.

    .venv/bin/python benchmarks/probes/draft_context.py [--contexts 700,2000] [--calls 300]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from verispec.drafters.cross_vocab import DraftContext, _decode
from verispec.models.loading import resolve_folder
from verispec.models.registry import DEFAULT_TARGET, hybrid_draft_for
from verispec.models.tokenizer import load_tokenizer
from verispec.paths import cpu_summary


def per_call(call, starts: range) -> float:
    """Milliseconds a call, over the growing contexts `starts`."""
    begun = time.perf_counter()
    for end in starts:
        call(end)
    return (time.perf_counter() - begun) / len(starts) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="700,2000", help="comma list of target tokens before the calls")
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    target = load_tokenizer(resolve_folder(DEFAULT_TARGET))
    draft = load_tokenizer(resolve_folder(hybrid_draft_for(DEFAULT_TARGET)))
    ids = target.encode(Path("README.md").read_text(), add_special_tokens=False)
    print(cpu_summary(), f"· {DEFAULT_TARGET} ids, {hybrid_draft_for(DEFAULT_TARGET)} draft, {args.calls} calls each")
    for context in map(int, args.contexts.split(",")):
        if context + args.calls > len(ids):
            raise SystemExit(f"README.md holds {len(ids)} target tokens: a context of {context} + {args.calls} calls is too long")
        starts = range(context, context + args.calls)
        whole = per_call(lambda end: _decode(target, ids[:end]), starts)
        texts, idss = DraftContext(target, draft), DraftContext(target, draft)
        texts.text(ids[: context - 1]), idss.ids(ids[: context - 1])  # as after the prompt's prefill
        text = per_call(lambda end: texts.text(ids[:end]), starts)
        encoded = per_call(lambda end: idss.ids(ids[:end]), starts)
        print(f"  after {context} tokens: whole decode {whole:.3f} ms, text {text:.3f} ms ({text / whole:.2f}×), "
              f"ids {encoded:.3f} ms a call")


if __name__ == "__main__":
    main()
