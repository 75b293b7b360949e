"""Fill-in-the-middle prompts: the text before a gap and the text after it, marked with the special tokens a code
model was trained on, so that it writes what goes between (the completions API's `suffix`; an editor's completion
at the cursor).

Code models mark the parts with three tokens in the order prefix, suffix, middle: Qwen2.5-Coder and CodeGemma
`<|fim_prefix|>` `<|fim_suffix|>` `<|fim_middle|>`, StarCoder the same without the bars, DeepSeek-Coder
`<｜fim▁begin｜>` `<｜fim▁hole｜>` `<｜fim▁end｜>`. The answer is the middle: it ends where the model writes its end of
text or starts another file, which is not the end-of-turn token an instruct model stops on, so those tokens end an
infill request too (`InfillFormat.ends`). A model without such tokens has no infill format (None).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["InfillFormat", "infill_format"]

MARKERS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
           ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"))  # (prefix, suffix, middle) of each family
ENDS = ("<|endoftext|>", "<|end_of_text|>", "<｜end▁of▁sentence｜>", "<|fim_pad|>", "<|file_sep|>", "<file_sep>",
        "<|file_separator|>")  # end of text, padding, or a next file: the middle is over


@dataclass(frozen=True)
class InfillFormat:
    """A model's fill-in-the-middle tokens, and the tokens that end the middle."""

    prefix: int
    suffix: int
    middle: int
    ends: frozenset[int]

    def encode(self, tokenizer, before: str, after: str) -> list[int]:
        """Token ids asking for the text between `before` and `after` (either may be empty)."""
        def text(part: str) -> list[int]:
            return tokenizer(part, add_special_tokens=False)["input_ids"] if part else []
        return [self.prefix, *text(before), self.suffix, *text(after), self.middle]


def _token_id(tokenizer, token: str) -> int | None:
    """The id of `token` when the tokenizer holds it as one token (never the unknown token's id)."""
    lookup = getattr(tokenizer, "token_to_id", None) or tokenizer.backend_tokenizer.token_to_id
    return lookup(token)


def infill_format(tokenizer) -> InfillFormat | None:
    """The fill-in-the-middle format of `tokenizer`'s model, or None when it has none."""
    if tokenizer is None:
        return None
    for markers in MARKERS:
        ids = [_token_id(tokenizer, marker) for marker in markers]
        if None not in ids:
            ends = frozenset(i for i in (_token_id(tokenizer, token) for token in ENDS) if i is not None)
            return InfillFormat(*ids, ends=ends)
    return None
