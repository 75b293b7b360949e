"""The `generate`, `chat` and `models` commands: without --max-new-tokens `generate` runs until the model stops
or its context is full (a prompt continued as raw text, which has no end of turn, gets a bounded
default instead), Ctrl-C stops it cleanly with the summary line, and `verispec models` says which
precisions (and backends) run each shipped model; sampling options (penalties, logit bias) reach the engine, bad ones
are clear errors before a model loads.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from test_hf_runner import make_hf_model

from verispec.cli import main
from verispec.models.gguf_weights import gguf_architecture


@pytest.fixture(scope="module")
def endless(tmp_path_factory) -> Path:
    """A tiny Gemma 3 without an end-of-sequence id: it stops only when its 160-position context is full."""
    return make_hf_model(tmp_path_factory.mktemp("endless") / "m", "gemma3", seed=3, eos=False, context=160)


@pytest.fixture(scope="module")
def endless_chat(endless, tmp_path_factory) -> Path:
    """The same model with a chat template (the user's turn, as it is): its prompts are chat turns."""
    folder = tmp_path_factory.mktemp("endless_chat") / "m"
    shutil.copytree(endless, folder)
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"chat_template": "{{ messages[0]['content'] }}"}))
    return folder


def test_cli_generate_runs_until_the_context_is_full_without_max_new_tokens(capsys, monkeypatch, endless, endless_chat):
    from verispec import cli

    monkeypatch.setattr(cli, "RAW_MAX_NEW_TOKENS", 20)
    assert main(["generate", "t5 t9 t2 t7", "--json", "--target", str(endless_chat), "--draft", "none"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 160 - 4  # not the API default of 128
    for args in (["--target", str(endless_chat), "--raw"], ["--target", str(endless)]):  # raw text: the bounded default
        assert main(["generate", "t5 t9 t2 t7", "--json", "--draft", "none", *args]) == 0
        captured = capsys.readouterr()
        assert len(json.loads(captured.out)["token_ids"]) == 20 and "at most 20 new tokens" in " ".join(captured.err.split())
    assert main(["generate", "t5 t9 t2 t7", "--raw", "--json", "--target", str(endless), "--draft", "none",
                 "--max-new-tokens", "5"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 5


def test_cli_ctrl_c_stops_cleanly_with_the_summary(capsys, monkeypatch, endless):
    from verispec.engine import loop

    step, calls = loop.Generation.step, []

    def interrupted_step(self):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step(self)

    monkeypatch.setattr(loop.Generation, "step", interrupted_step)
    assert main(["generate", "t5 t9 t2 t7", "--raw", "--target", str(endless), "--draft", "none"]) == 130
    captured = capsys.readouterr()
    assert "2 tokens in" in captured.err and "finish: interrupted" in captured.err
    assert len(captured.out.split()) == 2  # the two tokens produced before Ctrl-C
    calls.clear()
    assert main(["generate", "t5 t9 t2 t7", "--raw", "--json", "--target", str(endless), "--draft", "none"]) == 130
    out = json.loads(capsys.readouterr().out)  # --json: the object of what was produced
    assert out["finish_reason"] == "interrupted" and len(out["token_ids"]) == out["stats"]["new_tokens"] == 2


def _write_gguf_header(path: Path, architecture: str) -> None:
    """A GGUF header with two key/values (a uint32, then general.architecture) and no tensors."""
    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()

    body = struct.pack("<4sIQQ", b"GGUF", 3, 0, 2)
    body += string("general.alignment") + struct.pack("<II", 4, 32)
    body += string("general.architecture") + struct.pack("<I", 8) + string(architecture)
    path.write_bytes(body)


def test_cli_models_says_which_precisions_run_each_model(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    for name, model_type in (("gemma-3-270m", "gemma3_text"), ("qwen2.5-coder-0.5b-instruct", "qwen2")):
        (tmp_path / "hf" / name).mkdir(parents=True)
        (tmp_path / "hf" / name / "config.json").write_text(json.dumps({"model_type": model_type}))
    (tmp_path / "gguf").mkdir()
    _write_gguf_header(tmp_path / "gguf" / "qwen2.5-coder-1.5b-instruct.gguf", "qwen2")
    assert gguf_architecture(tmp_path / "gguf" / "qwen2.5-coder-1.5b-instruct.gguf") == "qwen2"
    assert main(["models"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "float32, bfloat16, hf (transformers) · gguf (llama.cpp)" in lines["gemma-3-270m"]
    assert "int8" not in lines["gemma-3-270m"]
    for name in ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"):
        assert "float32, bfloat16, int8 (verispec) · hf (transformers) · gguf (llama.cpp)" in lines[name]
    assert "gguf (llama.cpp)" in lines["smollm2-135m-instruct"]  # not pulled: llama.cpp runs any shipped GGUF


def test_cli_models_says_which_models_share_a_tokenizer(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    vocabs = {"qwen2.5-coder-0.5b-instruct": {"a": 0, "b": 1}, "qwen2.5-coder-1.5b-instruct": {"b": 1, "a": 0},
              "gemma-3-270m": {"a": 1, "b": 0}}
    for name, vocab in vocabs.items():
        (tmp_path / "hf" / name).mkdir(parents=True)
        (tmp_path / "hf" / name / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}, "added_tokens": []}))
    assert main(["models"]) == 0
    out = capsys.readouterr().out.splitlines()
    drafts = {line.split()[0]: out[i + 1] for i, line in enumerate(out[:-1]) if "drafts:" in out[i + 1]}
    assert "every drafter with qwen2.5-coder-1.5b-instruct" in drafts["qwen2.5-coder-0.5b-instruct"]
    assert "every drafter" not in drafts["gemma-3-270m"]  # same tokens, other ids: only through the text
    assert "smollm2-135m-instruct" not in drafts  # no tokenizer here yet: nothing claimed


CHAT_TEMPLATE = ("{% for m in messages %}<{{ m.role }}> {{ m.content }}{{ eos_token }} {% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """A tiny model whose chat template writes every turn."""
    from conftest import make_tiny_model

    folder = make_tiny_model(tmp_path_factory.mktemp("chat") / "m", vocab_size=24, seed=5, layers=2)
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"chat_template": CHAT_TEMPLATE}))
    return folder


def test_cli_chat_answers_each_turn_as_plain_decoding_of_the_conversation_so_far(capsys, monkeypatch, chat_model):
    """Turn after turn (prompt lookup drafting) the prompt is the whole conversation so far (the system prompt,
    every turn and answer) and the answer greedy plain decoding's for it; an empty line asks nothing, /reset starts
    again, /exit ends before the lines after it."""
    import io

    from verispec import Engine, GenerationConfig
    from verispec.engine import loop
    from verispec.models.loading import load_model

    prompts, start = [], loop.Engine.start
    monkeypatch.setattr(loop.Engine, "start", lambda self, prompt, config: prompts.append(list(prompt)) or start(self, prompt, config))
    monkeypatch.setattr("sys.stdin", io.StringIO("t5 t9 t5 t9\n\n/reset\nt5 t9 t5 t9\nt3 t4 t7\n/exit\nt8\n"))
    assert main(["chat", "--target", str(chat_model), "--dtype", "float32", "--draft", "ngram", "--max-new-tokens", "8",
                 "--system", "t11 t12"]) == 0
    answers = [a.strip() for a in capsys.readouterr().out.split("> ")[1:] if a.strip()]
    sent = list(prompts)  # what the chat asked (the references below ask too)
    model = load_model(str(chat_model))
    plain = Engine(model, None)
    system, first, second = ({"role": role, "content": text} for role, text in
                             (("system", "t11 t12"), ("user", "t5 t9 t5 t9"), ("user", "t3 t4 t7")))
    answer = plain.generate(model.encode_chat([system, first]), GenerationConfig(max_new_tokens=8)).text
    then = [system, first, {"role": "assistant", "content": answer}, second]
    assert sent == [model.encode_chat([system, first])] * 2 + [model.encode_chat(then)]
    assert answers == [plain.generate(prompt, GenerationConfig(max_new_tokens=8)).text.strip() for prompt in sent]
    assert main(["chat", "--target", str(chat_model), "--num-beams", "2"]) == 2  # beams are generate's: a clear error
    assert "--num-beams" in capsys.readouterr().err


def test_cli_sampling_options_reach_the_engine_and_bad_ones_are_clear_errors(capsys):
    from verispec.cli import _config, build_parser

    args = build_parser().parse_args(["generate", "hi", "--presence-penalty", "0.5", "--frequency-penalty", "-1",
                                      "--logit-bias", "7=-100", "--logit-bias", "3=2.5"])
    sampling = _config(args).sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.logit_bias) == (0.5, -1.0, ((3, 2.5), (7, -100.0)))
    for bad, words in [("seven=1", "ID=BIAS"), ("7=", "ID=BIAS"), ("7=300", "logit_bias")]:
        assert main(["generate", "hi", "--logit-bias", bad]) == 2  # before any model is loaded
        assert words in capsys.readouterr().err
    assert main(["generate", "hi", "--presence-penalty", "3"]) == 2 and "presence_penalty" in capsys.readouterr().err


def test_the_summary_holds_the_steps_against_their_price():
    """`steps 2.00× priced`: the steps' measured draft and target seconds over what the γ policy's cost model prices
    them at (the first token's record, the prefill's, left out); nothing where no policy priced them."""
    from types import SimpleNamespace

    from verispec.cli import _priced
    from verispec.control import CostModel
    from verispec.types import GenerationStats, StepRecord

    stats = GenerationStats(prompt_tokens=10)
    for record in [StepRecord(0, 0, 0.0, 0.0), StepRecord(2, 1, 0.2, 2.3), StepRecord(1, 1, 0.1, 2.3)]:
        stats.record(record)
    costs = CostModel([1.0, 1.1, 1.2], 0.05)  # priced: drafts 3 × 0.05 s, passes T(3) + T(2) = 2.3 s; measured 4.9 s
    assert _priced(SimpleNamespace(policy=SimpleNamespace(costs=costs), stats=stats)) == "steps 2.00× priced · "
    assert _priced(SimpleNamespace(policy=SimpleNamespace(), stats=stats)) == ""  # a constant γ prices nothing
    assert _priced(SimpleNamespace(policy=SimpleNamespace(costs=CostModel()), stats=stats)) == ""
