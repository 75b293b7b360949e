"""A model's tokenizer without importing transformers at every start: the same ids, text and chat prompts.

Loading a tokenizer through transformers costs about 3 s a start on a 2-core CPU (importing transformers scans
its whole model tree; `from_pretrained` then runs seconds of Python), most of what a warm `verispec generate`
spends before its first token. So the first load of a tokenizer folder goes through transformers
(`load_tokenizer`), and keeps in the cache directory what encoding, decoding and the chat prompt depend on: the
Rust tokenizer as transformers left it, the special tokens and the chat template. It keeps them only after
checking that `FastTokenizer` built from them gives transformers' results on probe texts (special tokens,
Unicode, spaces) and conversations (a system prompt, several turns); a folder that fails the check, or a
template jinja2 alone cannot compile (`{% generation %}`), stays on transformers. Later loads build
`FastTokenizer` with the `tokenizers` library and jinja2 alone, in under a second.

Only plain chat messages ({"role", "content"} strings, as the CLI and the server pass) are rendered here;
the vocabulary, the added tokens and the special ids are read here too (comparing a draft's tokenizer with its
target's, the cross-vocabulary drafters' shared vocabulary); anything else goes to the transformers tokenizer,
loaded then (`hf`). The state is keyed by the folder's
files and the transformers and tokenizers versions: an upgrade checks again.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path

from verispec.paths import files_stamp, keyed_file, write_whole

__all__ = ["FastTokenizer", "load_tokenizer", "hf_tokenizer"]

FORMAT = "2"  # 2: the pad id kept too (the vocabulary comparison of `loading.tokenizer_problems` reads it)
PROBE_TEXTS = ["Hello, world!", "  two  spaces\tand a tab\n\nnew lines ", "naïve café — 東京 🚀", "def f(x):\n    return x ** 2",
               "", "t1 t2 t3", "<|im_start|><|endoftext|><s></s><bos><eos>"]
PROBE_CHATS = [
    [{"role": "user", "content": "Write a haiku about caches."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Sum 2 and 3 — naïvely?"}],
]


def hf_tokenizer(folder: Path):
    """The folder's tokenizer through transformers, read from tokenizer.json itself when there is one.

    transformers 5's AutoTokenizer picks the class from the model type and rebuilds the tokenizer
    from its vocabulary, which silently breaks any tokenizer.json of another kind (a word-level
    one, say); the generic fast tokenizer reads the file as written (identical ids for Qwen).
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if (folder / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


class FastTokenizer:
    """Encoding, decoding and plain chat prompts from a kept state (see the module docstring); everything else
    from the transformers tokenizer of `folder`, loaded on first use."""

    def __init__(self, state: dict, folder: Path):
        from tokenizers import Tokenizer

        self.folder, self._state = folder, state
        self._tokenizer = Tokenizer.from_str(state["backend"])
        self.special = state["special"]  # {"bos_token": "<s>", …}: what the chat template sees
        self.bos_token_id, self.eos_token_id, self.pad_token_id = state["bos_token_id"], state["eos_token_id"], state["pad_token_id"]
        self.chat_template = state["chat_template"]
        self._template = _compile(self.chat_template) if self.chat_template else None

    def __reduce__(self):  # pickled as its state (a compiled template is not picklable)
        return FastTokenizer, (self._state, self.folder)

    @cached_property
    def hf(self):
        """The transformers tokenizer of the same folder."""
        return hf_tokenizer(self.folder)

    def __getattr__(self, name: str):  # only for attributes not defined here
        if name.startswith("_") or name in ("hf", "folder"):
            raise AttributeError(name)
        return getattr(self.hf, name)

    def __len__(self) -> int:
        return len(self.hf)

    def get_vocab(self) -> dict[str, int]:
        """{token: id}, added tokens included (as transformers' fast tokenizers give it)."""
        return self._tokenizer.get_vocab(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict:
        """{id: AddedToken} of the added (special) tokens, as transformers' fast tokenizers give it."""
        return dict(sorted(self._tokenizer.get_added_tokens_decoder().items()))

    def token_to_id(self, token: str) -> int | None:
        """The id of `token` when the vocabulary holds it whole (added and special tokens too), else None."""
        return self._tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs) -> list[int]:
        if kwargs or not isinstance(text, str):
            return self.hf.encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True, **kwargs):
        if kwargs or not isinstance(text, str):
            return self.hf(text, add_special_tokens=add_special_tokens, **kwargs)
        return {"input_ids": self.encode(text, add_special_tokens)}

    def decode(self, ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None) -> str:
        if clean_up_tokenization_spaces:
            return self.hf.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=True)
        ids = ids.tolist() if hasattr(ids, "tolist") else ids
        return self._tokenizer.decode([ids] if isinstance(ids, int) else list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, conversation, tokenize: bool = True, add_generation_prompt: bool = False, **kwargs):
        plain = all(isinstance(m, dict) and set(m) == {"role", "content"} and all(isinstance(v, str) for v in m.values())
                    for m in conversation)
        if tokenize or kwargs or not plain or self._template is None or not conversation:
            return self.hf.apply_chat_template(conversation, tokenize=tokenize, add_generation_prompt=add_generation_prompt, **kwargs)
        messages = [dict(message) for message in conversation]
        return self._template.render(messages=messages, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **self.special)


def _compile(template: str):
    """The chat template in the environment transformers renders chat templates in (sandboxed, trimmed blocks,
    loop controls, its `tojson`, `raise_exception` and `strftime_now`); None when jinja2 alone cannot compile it."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateError:
        return None


def _state_file(folder: Path) -> tuple[Path, str]:
    """(where the folder's state is kept, what it is made from: its files, transformers' and tokenizers' versions)."""
    from importlib.metadata import version

    folder = folder.resolve()
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in (".json", ".jinja", ".model", ".txt"))
    stamp = files_stamp(FORMAT, version("transformers"), version("tokenizers"), files=files)
    return keyed_file("tokenizers-fast", folder.name, str(folder), ".json"), stamp


def _state_of(hf) -> dict | None:
    """What `FastTokenizer` needs of a transformers tokenizer, or None when it has no single Rust tokenizer, a
    template of several names, or decoding that cleans up spaces."""
    backend = getattr(hf, "backend_tokenizer", None)
    template = getattr(hf, "chat_template", None)
    if backend is None or not (template is None or isinstance(template, str)) or getattr(hf, "clean_up_tokenization_spaces", False):
        return None
    return {"backend": backend.to_str(), "special": dict(hf.special_tokens_map), "bos_token_id": hf.bos_token_id,
            "eos_token_id": hf.eos_token_id, "pad_token_id": hf.pad_token_id, "chat_template": template}


def _agrees(fast: FastTokenizer, hf) -> bool:
    """Whether `fast` gives `hf`'s vocabulary, ids, text and chat prompts on the probes."""
    try:
        if fast.get_vocab() != hf.get_vocab():
            return False
        for text in PROBE_TEXTS:
            for special in (True, False):
                ids = hf(text, add_special_tokens=special)["input_ids"]
                if fast(text, add_special_tokens=special)["input_ids"] != ids:
                    return False
                for skip in (True, False):
                    if fast.decode(ids, skip_special_tokens=skip) != hf.decode(ids, skip_special_tokens=skip):
                        return False
        if fast.chat_template:
            for chat in PROBE_CHATS:
                for prompt in (True, False):
                    if fast.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt) != hf.apply_chat_template(
                            chat, tokenize=False, add_generation_prompt=prompt):
                        return False
    except Exception:  # noqa: BLE001 - any difference in behaviour, errors included, keeps transformers
        return False
    return True


def load_tokenizer(folder: Path):
    """The folder's tokenizer: a `FastTokenizer` from its kept state, else transformers' (whose state is checked
    and kept for the next load, see the module docstring)."""
    folder = Path(folder)
    file, stamp = _state_file(folder)
    try:
        kept = json.loads(file.read_text())
        if kept["stamp"] == stamp:
            return FastTokenizer(kept["state"], folder) if kept["state"] is not None else hf_tokenizer(folder)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    hf = hf_tokenizer(folder)
    state = _state_of(hf)
    if state is not None:
        fast = FastTokenizer(state, folder)
        fast.hf = hf  # the check's own: no second load
        state = state if fast._template is not None or not state["chat_template"] else None
        state = state if state is not None and _agrees(fast, hf) else None
    # a read-only cache: transformers' tokenizer, checked again next time
    write_whole(file, lambda path: path.write_text(json.dumps({"stamp": stamp, "state": state})))
    return hf
