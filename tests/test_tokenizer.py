"""The tokenizer without transformers (`models/tokenizer.py`): the ids, text and chat prompts transformers gives.

The first load goes through transformers and keeps the checked state; the second builds a `FastTokenizer` and
must agree with transformers on texts and conversations the check never saw. Controls: a template jinja2 alone
cannot compile, and a state that renders another prompt, stay on transformers; a rewritten folder is checked anew.
"""

from __future__ import annotations

import json
import os
import pickle

import pytest
from conftest import make_tiny_model

from verispec.models import tokenizer as tokenizers_module
from verispec.models.tokenizer import FastTokenizer, hf_tokenizer, load_tokenizer

TEMPLATE = ("{% for m in messages %}{% if loop.first and m.role != 'system' %}{{ bos_token }}{% endif %}"
            "<{{ m.role }}> {{ m.content | trim }}{{ eos_token }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
CHATS = [[{"role": "user", "content": "t5 t6 t7"}],
         [{"role": "system", "content": "t9"}, {"role": "user", "content": " t3 t4 "}, {"role": "assistant", "content": "t2"},
          {"role": "user", "content": "t8 t8 t11"}]]


@pytest.fixture
def folder(tmp_path):
    """A tiny model's word-level tokenizer with a chat template."""
    folder = make_tiny_model(tmp_path / "m", vocab_size=16, seed=3, layers=1)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return folder


def _same_as_transformers(fast, hf) -> None:
    for text in ["t3 t4 t5", "t15 t2 nothing t1", "t0 t0", " t7  t8 "]:
        for special in (True, False):
            ids = hf(text, add_special_tokens=special)["input_ids"]
            assert fast(text, add_special_tokens=special)["input_ids"] == ids == fast.encode(text, add_special_tokens=special)
            for skip in (True, False):
                assert fast.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    for chat in CHATS:
        for prompt in (True, False):
            assert fast.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt) == \
                hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt)
    assert (fast.eos_token_id, fast.bos_token_id, fast.pad_token_id, len(fast)) == (hf.eos_token_id, hf.bos_token_id, hf.pad_token_id, len(hf))


def test_the_second_load_needs_no_transformers_and_gives_its_results(folder):
    first = load_tokenizer(folder)
    assert not isinstance(first, FastTokenizer)  # the first goes through transformers, and keeps the checked state
    second = load_tokenizer(folder)
    assert isinstance(second, FastTokenizer) and "hf" not in second.__dict__
    assert second.get_vocab() == first.get_vocab() and "hf" not in second.__dict__  # the vocabulary: no transformers either
    added = lambda tokenizer: {index: token.content for index, token in tokenizer.added_tokens_decoder.items()}  # noqa: E731
    assert added(second) == added(first) and "hf" not in second.__dict__
    _same_as_transformers(second, first)  # anything else: transformers' tokenizer, loaded then
    _same_as_transformers(pickle.loads(pickle.dumps(second)), first)  # as a Ray actor or a process pool gets it
    assert second.apply_chat_template(CHATS[0], tokenize=True) == first.apply_chat_template(CHATS[0], tokenize=True)


def test_a_template_jinja2_alone_cannot_compile_or_a_state_that_disagrees_stays_on_transformers(folder, monkeypatch):
    config = json.loads((folder / "tokenizer_config.json").read_text())
    generation = TEMPLATE.replace("{{ m.content | trim }}", "{% generation %}{{ m.content }}{% endgeneration %}")
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": generation}))
    load_tokenizer(folder)
    assert not isinstance(load_tokenizer(folder), FastTokenizer)

    other = make_tiny_model(folder.parent / "other", vocab_size=16, seed=4, layers=1)
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    state_of = tokenizers_module._state_of
    monkeypatch.setattr(tokenizers_module, "_state_of", lambda hf: {**state_of(hf), "special": {**state_of(hf)["special"], "eos_token": "t9"}})
    load_tokenizer(other)  # the kept state would render another end of turn: the check refuses it
    assert not isinstance(load_tokenizer(other), FastTokenizer)


def test_a_rewritten_folder_is_checked_again(folder):
    load_tokenizer(folder)
    assert isinstance(load_tokenizer(folder), FastTokenizer)
    config = folder / "tokenizer_config.json"
    os.utime(config, ns=(0, config.stat().st_mtime_ns + 10**9))
    assert not isinstance(load_tokenizer(folder), FastTokenizer)  # transformers again, then kept anew
    assert isinstance(load_tokenizer(folder), FastTokenizer)


@pytest.mark.real
@pytest.mark.parametrize("name", ["qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct"])
def test_the_shipped_tokenizers_agree_with_transformers_on_public_prompts(name):
    """The shipped models' tokenizers (as `--dtype gguf`/`kquant` load them), on texts of the public prompt groups."""
    from verispec.models.registry import gguf_file, gguf_tokenizer_folder

    folder = gguf_tokenizer_folder(gguf_file(name))
    load_tokenizer(folder)
    fast, hf = load_tokenizer(folder), hf_tokenizer(folder)
    assert isinstance(fast, FastTokenizer)
    texts = ["Translate to German: «Le train part à 8 h 15.»", "def fib(n):\n\t'''Return the n-th Fibonacci number.'''\n",
             "Summarize: Die Katze (猫) sprang — schnell! 🐈 <|im_end|> done", "What is 17 × 23? Think step by step.\n\n1."]
    for text in texts:
        ids = hf(text)["input_ids"]
        assert fast(text)["input_ids"] == ids and fast.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
        chat = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": text}]
        assert fast.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
            hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


@pytest.mark.real
def test_a_ggufs_tokenizer_is_read_with_one_parse_of_the_file(tmp_path, monkeypatch):
    """transformers' legacy GGUF reader walks every vocabulary entry; told the config's model type, the tokenizer
    does not parse the file again, and it is the tokenizer transformers' own way makes (the 0.5B's qwen2 GGUF; a llama
    one, whose model type names no tokenizer class, still takes the two parses)."""
    from transformers import AutoTokenizer
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from verispec.models.registry import gguf_file, gguf_tokenizer_folder

    gguf = gguf_file("qwen2.5-coder-0.5b-instruct")
    parses, parse = [], gguf_utils.load_gguf_checkpoint
    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", lambda *a, **k: parses.append(a) or parse(*a, **k))
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    folder = gguf_tokenizer_folder(gguf)
    assert len(parses) == 1 and (folder / "config.json").exists()
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp_path / "control")
    assert len(parses) == 2  # the control: transformers' own way parses the file for the model type
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).read_bytes() == (tmp_path / "control" / name).read_bytes()
