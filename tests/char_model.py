"""A tiny random model over single characters (no whitespace), so that constrained decoding can spell
JSON: "{", "}", '"', ":", ",", "[", "]", "?", "-", ".", the digits and a–z; eos = "</s>" (id 0)."""

from __future__ import annotations

from pathlib import Path

from conftest import make_tiny_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from verispec.models.loading import load_model
from verispec.models.runner import LoadedModel

CHARS = list('{}":,[]?-.') + [str(d) for d in range(10)] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
VOCAB = ["</s>"] + CHARS  # 47 tokens; the model's logits are 48 wide (one padding row, never allowed)


def char_tokenizer() -> PreTrainedTokenizerFast:
    """Each character one token (BPE without merges); decoding concatenates."""
    tokenizer = Tokenizer(models.BPE({token: i for i, token in enumerate(VOCAB)}, [], unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return fast


def char_model(folder: Path, seed: int = 7) -> LoadedModel:
    """The tiny model (vocabulary 48: `VOCAB` plus one padding row) with the character tokenizer."""
    model = load_model(make_tiny_model(folder, vocab_size=48, seed=seed, layers=2, arch="llama"))
    model.tokenizer = char_tokenizer()
    return model
