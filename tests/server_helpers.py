"""Helpers for the server tests: a tiny engine with a chat template (also as a picklable loader for Ray
workers), the engine's own answer to compare with, the token ids of scheduler jobs, uvicorn on a free local port, and a headless
Chromium for the playground."""

from __future__ import annotations

import os
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import uvicorn
from transformers import PreTrainedTokenizerFast

from verispec import Engine, GenerationConfig, SamplingParams
from verispec.drafters import DraftModelDrafter, ExpansionDrafter, HybridDrafter, NgramDrafter
from verispec.models.loading import load_model
from verispec.serving.request import chat_prompt_ids
from verispec.serving.http.schemas import ChatMessage

MODEL = "tiny"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # words are tokens "t0".."t47"


async def token_ids(jobs) -> list[list[int]]:
    """Each scheduler job's emitted token ids, once it has finished (in the jobs' order)."""
    answers = []
    for job in jobs:
        ids = []
        while (update := await job.next()).kind != "finished":
            ids += [event.token_id for event in update.events]
        answers.append(ids)
    return answers


def tiny_engine(target_dir: Path, draft: Path | str = "ngram", gamma: int = 3) -> Engine:
    """A fresh engine (own model objects) over the tiny target, constant γ.

    draft: a model folder (the target's own folder: every draft accepted, bonus tokens; a random draft:
    mostly rejected), "ngram" (prompt lookup: ragged acceptance on looping output), or ("tree", folder)
    for a SpecInfer token tree from that draft model, ("hybrid", folder) for prompt lookup or that draft model.
    """
    target = load_model(target_dir)
    # AutoTokenizer turns the word-level tokenizer into a Qwen2 BPE one (model_type qwen2): load the file as is
    target.tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(target_dir / "tokenizer.json"), eos_token="t0", unk_token="t1")
    target.tokenizer.chat_template = CHAT_TEMPLATE
    if draft == "ngram":
        drafter = NgramDrafter(max_n=3)
    elif isinstance(draft, tuple):
        kind, model = draft[0], load_model(draft[1])
        drafter = (ExpansionDrafter(model, target.vocab_size, k=2, depth=3) if kind == "tree"
                   else HybridDrafter(DraftModelDrafter(model, target.vocab_size)))
    else:
        drafter = DraftModelDrafter(load_model(draft), target.vocab_size)
    return Engine(target, drafter, gamma=gamma, gamma_policy="constant")


def slow(engine: Engine, seconds: float) -> Engine:
    """Slow every batched target pass, so that requests overlap for sure."""
    runner = engine.target.runner
    ragged = runner.forward_ragged

    def slow_ragged(caches, feeds, *rest):
        time.sleep(seconds)
        return ragged(caches, feeds, *rest)
    runner.forward_ragged = slow_ragged
    return engine


@dataclass(frozen=True)
class TinyLoader:
    """`tiny_engine(target_dir)`, slowed by `delay` s per target pass: a loader Ray can ship to its workers."""

    target_dir: str
    delay: float = 0.0

    def __call__(self) -> Engine:
        return slow(tiny_engine(Path(self.target_dir)), self.delay) if self.delay else tiny_engine(Path(self.target_dir))


def expected_text(engine, prompt: str, max_tokens: int, temperature: float = 0.0, seed: int | None = None, chat=False) -> str:
    """What the engine itself generates for one request (the server must answer the same)."""
    ids = chat_prompt_ids(engine, [ChatMessage(role="user", content=prompt)]) if chat else engine.prompt_ids(prompt, chat=False)
    config = GenerationConfig(max_new_tokens=max_tokens, sampling=SamplingParams(temperature=temperature), seed=seed)
    return engine.generate(ids, config).text


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


CHROMIUM = "/usr/bin/chromium"


@contextmanager
def chromium():
    """A headless Chromium (Playwright) browser; skips the test without Chromium or Playwright."""
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no Chromium at {CHROMIUM} (install the Debian package 'chromium')")
    sync_api = pytest.importorskip("playwright.sync_api")
    args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"]
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=args)
        try:
            yield browser
        finally:
            browser.close()
