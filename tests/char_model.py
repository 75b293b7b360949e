"""A tiny random model over single characters (no whitespace), so that constrained decoding can spell
JSON: "{", "}", '"', ":", ",", "[", "]", "?", "-", ".", the digits and a–z; eos = "</s>" (id 0).
`TOOL_CHARS` adds what Hermes tool-call blocks need ("<", ">", "/", "_", " ", newline), and `TOOLS_TEMPLATE`
is a chat template that offers tools (it shows their names and renders earlier calls)."""

from __future__ import annotations

from pathlib import Path

from conftest import make_tiny_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from verispec.models.loading import load_model
from verispec.models.runner import LoadedModel

CHARS = list('{}":,[]?-.') + [str(d) for d in range(10)] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
VOCAB = ["</s>"] + CHARS  # 47 tokens; the model's logits are 48 wide (one padding row, never allowed)
TOOL_CHARS = CHARS + list("<>/_ \n")
PLAIN_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
TOOLS_TEMPLATE = (  # calls come back as <tool_call> blocks
    "{% if tools %}{% for t in tools %}{{ t['function']['name'] }},{% endfor %}{% endif %}"
    "{% for m in messages %}{{ m['content'] }}{% for c in m.tool_calls or [] %}{{ c['function']['name'] }}"
    "{{ c['function']['arguments'] | tojson }}{% endfor %}{% endfor %}"
)


def char_tokenizer(chars: list[str] = CHARS, template: str = PLAIN_TEMPLATE) -> PreTrainedTokenizerFast:
    """Each character one token (BPE without merges); decoding concatenates."""
    vocab = ["</s>"] + chars
    tokenizer = Tokenizer(models.BPE({token: i for i, token in enumerate(vocab)}, [], unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>")
    fast.chat_template = template
    return fast


def char_model(folder: Path, seed: int = 7, chars: list[str] = CHARS, template: str = PLAIN_TEMPLATE) -> LoadedModel:
    """The tiny model (vocabulary: "</s>", `chars` and one padding row) with the character tokenizer."""
    model = load_model(make_tiny_model(folder, vocab_size=len(chars) + 2, seed=seed, layers=2, arch="llama"))
    model.tokenizer = char_tokenizer(chars, template)
    return model
