"""Whether two tokenizers give every token the same id: the one decision behind "the same tokenizer".

A draft model drafts in the target's own token ids only when both vocabularies map every token to the
same id (`vocabulary_difference` is None). `loading.tokenizer_problems` asks it of two loaded
tokenizers (`get_vocab()`), `verispec models` of the tokenizer.json files of models it does not load
(`file_vocabulary`: what `get_vocab()` would give).
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["file_vocabulary", "vocabulary_difference"]


def file_vocabulary(path: Path) -> dict[str, int]:
    """{token: id} of the tokenizer.json at `path`, as its tokenizer's `get_vocab()` gives it: the model's
    vocabulary ({token: id} for BPE, [[piece, score], …] for Unigram) and the added tokens."""
    data = json.loads(path.read_text())
    vocab = (data.get("model") or {}).get("vocab") or {}
    if isinstance(vocab, list):
        vocab = {piece: index for index, (piece, _) in enumerate(vocab)}
    return {**vocab, **{token["content"]: token["id"] for token in data.get("added_tokens", [])}}


def vocabulary_difference(first: dict[str, int], second: dict[str, int]) -> str | None:
    """None when both vocabularies give every token the same id; else how they differ."""
    return None if first == second else f"vocabularies differ ({len(first)} vs {len(second)} entries)"
