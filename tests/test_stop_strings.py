"""Stop strings on tiny models: no path returns text of a stop string.

The engine's streamed events join to exactly `generate().text` for every drafter, for stop strings
that span several tokens, one at the very start, and for requests that end by length or EOS with the
beginning of a stop string at the end (held back, then released). The CLI without `--json` prints
the `--json` text, and the server's streaming and non-streaming answers equal the library's text.
"""

from __future__ import annotations

import json

import httpx
import pytest

from verispec import Engine, GenerationConfig
from verispec.cli import main
from verispec.drafters import DraftModelDrafter, NgramDrafter
from verispec.serving.http import create_app

# greedy on the tiny target: the first ends by EOS ("… t32 t36" then t0), the second by length
ENDS_BY = {"stop": [11, 3, 3, 3, 8, 1, 30, 12, 5], "length": [5, 9, 2, 7]}
MAX_NEW = 30


def _stop_cases(full: str) -> dict[str, tuple[tuple[str, ...], str | None]]:
    """Stop strings drawn from the full greedy text → (stop, the text cut before it, or None: uncut)."""
    spanning = full[5:16]  # from inside the second word to inside the fourth, over several tokens
    return {
        "spanning": ((spanning,), full[: full.index(spanning)]),
        "spanning, among others": (("zzz", spanning, "t3t"), full[: full.index(spanning)]),
        "at the start": ((full[:6],), ""),
        "one whole token": ((" " + full.split()[3],), full[: full.index(" " + full.split()[3])]),
        # begins at the end of the text and at every word like the last: held back, then released
        "prefix at the end": ((full[-2:] + "~",), None),
    }


@pytest.fixture(scope="module")
def engines(target, draft) -> dict[str, Engine]:
    return {
        "none": Engine(target, None),
        "ngram": Engine(target, NgramDrafter(max_n=3), gamma=3, gamma_policy="constant"),
        "model": Engine(target, DraftModelDrafter(draft, target.vocab_size), gamma=4, gamma_policy="constant"),
    }


@pytest.mark.parametrize("ends_by", list(ENDS_BY))
@pytest.mark.parametrize("kind", ["none", "ngram", "model"])
def test_streamed_text_equals_the_returned_text(engines, kind, ends_by):
    engine, prompt = engines[kind], ENDS_BY[ends_by]
    full = engine.generate(prompt, GenerationConfig(max_new_tokens=MAX_NEW))
    assert full.finish_reason == ends_by
    for name, (stop, cut) in _stop_cases(full.text).items():
        config = GenerationConfig(max_new_tokens=MAX_NEW, stop=stop)
        result = engine.generate(prompt, config)
        events = list(engine.stream(prompt, config))
        assert "".join(event.text for event in events) == result.text, name
        assert result.text == (full.text if cut is None else cut), name
        assert result.finish_reason == ("stop" if cut is not None else ends_by), name
        emitted = ""
        for event in events:  # at no point has a stop string been given out
            emitted += event.text
            assert not any(s in emitted for s in stop), name


def test_held_back_text_comes_with_the_eos_token(engines, target):
    """A request ending by EOS while holding text gives an event for the EOS token with that text."""
    prompt = ENDS_BY["stop"]
    full = engines["none"].generate(prompt, GenerationConfig(max_new_tokens=MAX_NEW))
    events = list(engines["none"].stream(prompt, GenerationConfig(max_new_tokens=MAX_NEW, stop=(full.text[-2:] + "~",))))
    assert events[-1].token_id in target.eos_ids and events[-1].text == full.text[-2:]
    plain = list(engines["none"].stream(prompt, GenerationConfig(max_new_tokens=MAX_NEW)))
    assert all(event.token_id not in target.eos_ids for event in plain)  # nothing held: no EOS event


def test_cancel_gives_back_the_held_back_text(engines):
    """A request stopped early (Ctrl-C) returns the text it was holding for a possible stop string, so
    what was printed joins to the returned text; the old way (finishing privately) lost it."""
    stop = tuple(f"{digit}~" for digit in "0123456789")  # every word ends in a digit: its last one is held
    generation = engines["none"].start(ENDS_BY["length"], GenerationConfig(max_new_tokens=MAX_NEW, stop=stop))
    streamed = "".join(event.text for _ in range(3) for event in generation.step())
    held_back = generation.cancel("interrupted")
    assert held_back and held_back[-1].isdigit() and streamed + held_back == generation.result().text
    assert generation.result().finish_reason == "interrupted" and generation.cancel() == ""


@pytest.mark.parametrize("draft_arg", ["none", "ngram"])
def test_cli_prints_the_json_text(capsys, tiny_target, draft_arg):
    common = ["generate", "t5 t9 t2 t7", "--raw", "--target", str(tiny_target), "--max-new-tokens", "12",
              "--draft", draft_arg, "--gamma-policy", "constant"]
    assert main(common + ["--json"]) == 0
    full = json.loads(capsys.readouterr().out)["text"]
    stop = full[5:16]  # spans several tokens
    assert main(common + ["--json", "--stop", stop]) == 0
    want = json.loads(capsys.readouterr().out)["text"]
    assert want == full[: full.index(stop)]
    assert main(common + ["--stop", stop]) == 0
    assert capsys.readouterr().out == want + "\n"


def test_server_answers_the_library_text(tiny_target):
    from server_helpers import MODEL, LocalServer, tiny_engine  # after verispec.serving.http (import order)

    engine = tiny_engine(tiny_target)
    prompt = "t5 t9 t2 t7"
    ids = engine.prompt_ids(prompt, chat=False)
    full = engine.generate(ids, GenerationConfig(max_new_tokens=20)).text
    stop = full[5:16]  # spans several tokens
    want = engine.generate(ids, GenerationConfig(max_new_tokens=20, stop=(stop,))).text
    assert want == full[: full.index(stop)]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 20, "temperature": 0, "stop": [stop]}
    with LocalServer(create_app(tiny_engine(tiny_target), model_name=MODEL)) as server:
        answer = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        assert answer["choices"][0]["text"] == want and answer["choices"][0]["finish_reason"] == "stop"
        chunks = []
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[len("data: "):]))
        assert "".join(choice.get("text", "") for c in chunks for choice in c.get("choices", [])) == want
