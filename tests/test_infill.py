"""Fill in the middle (`suffix`): a model's FIM tokens are found by name (none: no format, a 400 naming `suffix`), the
prompt is prefix-marker, the text before the gap, suffix-marker, the text after it, middle-marker; the answer ends at
the model's end of text as at EOS (not when EOS is ignored, not before min_tokens), and speculation on such a prompt is
token-identical to the reference decoder; over HTTP, `suffix` gives the engine's own answer, an empty one continues the
prompt, and token-id prompts or echo with a suffix are refused naming the field."""

from __future__ import annotations

import httpx
import pytest
from conftest import make_tiny_model
from server_helpers import MODEL, LocalServer, tiny_engine
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from verispec import Engine, GenerationConfig, SamplingParams
from verispec.drafters import DraftModelDrafter, NgramDrafter
from verispec.errors import InvalidParameterError
from verispec.models.infill import infill_format
from verispec.models.loading import load_model
from verispec.serving.http import create_app
from verispec.testing.reference import reference_generate

MARKERS = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|endoftext|>"]
PREFIX, SUFFIX, MIDDLE, END = 44, 45, 46, 47  # their ids in the tiny vocabulary below


@pytest.fixture(scope="module")
def fim_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("fim") / "model", seed=3, words=[f"t{i}" for i in range(44)] + MARKERS)


@pytest.fixture(scope="module")
def fim(fim_dir):
    model = load_model(fim_dir)
    model.tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(fim_dir / "tokenizer.json"), eos_token="t0", unk_token="t1")
    return model


def test_the_format_is_found_by_its_tokens_names(fim, tiny_target):
    form = infill_format(fim.tokenizer)
    assert (form.prefix, form.suffix, form.middle, form.ends) == (PREFIX, SUFFIX, MIDDLE, frozenset({END}))
    assert form.encode(fim.tokenizer, "t5 t6", "t7") == [PREFIX, 5, 6, SUFFIX, 7, MIDDLE]
    assert form.encode(fim.tokenizer, "", "t7") == [PREFIX, SUFFIX, 7, MIDDLE]  # the cursor at the very start
    plain = load_model(tiny_target)
    assert infill_format(plain.tokenizer) is None and plain.infill_ends == frozenset()
    with pytest.raises(InvalidParameterError, match="no fill-in-the-middle tokens") as error:
        plain.infill_ids("t5", "t6")
    assert error.value.param == "suffix"


@pytest.mark.parametrize("drafting", ["ngram", "self"])
def test_speculation_on_an_infill_prompt_is_the_reference_and_ends_at_end_of_text(fim, fim_dir, drafting):
    hf = AutoModelForCausalLM.from_pretrained(fim_dir).eval()
    drafter = NgramDrafter(max_n=3) if drafting == "ngram" else DraftModelDrafter(fim, fim.vocab_size)
    engine = Engine(fim, drafter, gamma=3, gamma_policy="constant")
    ids = [PREFIX, 5, 6, 9, SUFFIX, 7, 8, MIDDLE]
    ends = fim.eos_ids | {END}
    for bias in ({}, {END: 4.0}):  # the second makes end of text likely early
        params = SamplingParams(logit_bias=bias)
        got = engine.generate("t5 t6 t9", GenerationConfig(max_new_tokens=24, suffix="t7 t8", sampling=params))
        assert got.token_ids == reference_generate(hf, ids, 24, params, eos_ids=ends)
    forced = SamplingParams(logit_bias={END: 100.0})
    assert engine.generate("t5", GenerationConfig(max_new_tokens=8, suffix="t7", sampling=forced)).finish_reason == "stop"
    late = engine.generate("t5", GenerationConfig(max_new_tokens=8, suffix="t7", sampling=forced, min_tokens=3))
    assert late.finish_reason == "stop" and late.token_ids[3:] == [END] and END not in late.token_ids[:3]
    ignored = engine.generate("t5", GenerationConfig(max_new_tokens=8, suffix="t7", sampling=forced, ignore_eos=True))
    assert ignored.finish_reason == "length" and ignored.token_ids == [END] * 8
    plain = engine.generate([PREFIX, 5, SUFFIX, 7, MIDDLE], GenerationConfig(max_new_tokens=8, sampling=forced))
    assert plain.finish_reason == "length"  # without `suffix` end of text is only a token
    with pytest.raises(InvalidParameterError, match="text prompt"):
        engine.generate([5, 6], GenerationConfig(suffix="t7"))


def test_suffix_over_http(fim, tiny_target):
    engine = Engine(fim, NgramDrafter(max_n=3), gamma=3, gamma_policy="constant")
    alone = engine.generate("t5 t6 t9", GenerationConfig(max_new_tokens=12, suffix="t7 t8"))
    continued = engine.generate("t5 t6 t9", GenerationConfig(max_new_tokens=12, chat=False))
    with LocalServer(create_app(engine, model_name=MODEL)) as server:
        def post(**body) -> httpx.Response:
            return httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "t5 t6 t9", "max_tokens": 12,
                                                                     "temperature": 0, **body}, timeout=60)
        reply = post(suffix="t7 t8").json()
        assert reply["choices"][0]["text"] == alone.text and reply["usage"]["prompt_tokens"] == 8
        assert post(suffix="").json()["choices"][0]["text"] == continued.text  # empty: the prompt is continued
        for body, param in (({"prompt": [5, 6], "suffix": "t7"}, "suffix"), ({"suffix": "t7", "echo": True}, "echo")):
            refused = post(**body)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.json()
    with LocalServer(create_app(tiny_engine(tiny_target), model_name=MODEL)) as server:
        refused = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "t5", "suffix": "t6"}, timeout=60)
        assert refused.status_code == 400 and "no fill-in-the-middle tokens" in refused.json()["error"]["message"]


def test_the_cli_fills_in_the_middle(fim_dir, fim, capsys):
    import json

    from verispec.cli import main

    assert main(["generate", "t5 t6 t9", "--suffix", "t7 t8", "--json", "--target", str(fim_dir), "--draft", "ngram",
                 "--dtype", "float32", "--max-new-tokens", "12"]) == 0
    result = json.loads(capsys.readouterr().out)
    expected = Engine(fim, None).generate("t5 t6 t9", GenerationConfig(max_new_tokens=12, suffix="t7 t8"))
    assert result["token_ids"] == expected.token_ids and result["stats"]["prompt_tokens"] == 8, result
