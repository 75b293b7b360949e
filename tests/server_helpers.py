"""Helpers for the server tests: a tiny engine with a chat template, and uvicorn on a free local port."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import uvicorn
from transformers import PreTrainedTokenizerFast

from verispec import Engine
from verispec.drafters import DraftModelDrafter, ExpansionDrafter, NgramDrafter
from verispec.models.loading import load_model

MODEL = "tiny"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # words are tokens "t0".."t47"


def tiny_engine(target_dir: Path, draft: Path | str = "ngram", gamma: int = 3) -> Engine:
    """A fresh engine (own model objects) over the tiny target, constant γ.

    draft: a model folder (the target's own folder: every draft accepted, bonus tokens; a random draft:
    mostly rejected), "ngram" (prompt lookup: ragged acceptance on looping output), or ("tree", folder)
    for a SpecInfer token tree from that draft model.
    """
    target = load_model(target_dir)
    # AutoTokenizer turns the word-level tokenizer into a Qwen2 BPE one (model_type qwen2): load the file as is
    target.tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(target_dir / "tokenizer.json"), eos_token="t0", unk_token="t1")
    target.tokenizer.chat_template = CHAT_TEMPLATE
    if draft == "ngram":
        drafter = NgramDrafter(max_n=3)
    elif isinstance(draft, tuple):
        drafter = ExpansionDrafter(load_model(draft[1]), target.vocab_size, k=2, depth=3)
    else:
        drafter = DraftModelDrafter(load_model(draft), target.vocab_size)
    return Engine(target, drafter, gamma=gamma, gamma_policy="constant")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """uvicorn serving `app` on 127.0.0.1 in a background thread; `stop()` shuts it down."""

    def __init__(self, app):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LocalServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
