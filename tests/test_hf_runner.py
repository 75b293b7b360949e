"""The Hugging Face runner on tiny random models of architectures the own runner lacks (Gemma 3 with
mixed sliding-window and full layers, Phi-3), and the CLI around it.

Chains: logits fed in pieces through the cache equal one plain forward of the HF model. Trees: every
node's logits equal those of its own path fed as a chain, also beyond a sliding window. Caches:
truncate and keep leave exactly what a fresh cache fed the kept tokens holds. Engine: greedy
speculative decoding (chain and tree drafters) is token-identical to plain decoding of the same
runner and to HF `generate(do_sample=False)`. An architecture that ignores custom masks runs chains
only and refuses a tree. Loading picks the runner by model type.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from verispec import Engine, GenerationConfig
from verispec.drafters import DraftModelDrafter
from verispec.drafters.tree import ExpansionDrafter
from verispec.errors import InvalidParameterError, ModelNotFoundError
from verispec.models.hf_runner import HFRunner
from verispec.models.loading import load_model, precisions_for
from verispec.models.transformer import Transformer

ARCHS = ["gemma3", "phi3"]
WINDOW = 6  # Gemma 3's sliding window in the tiny model: prompts and outputs run well past it
PROMPTS = [[5, 9, 2, 7], [11, 3, 3, 3, 8, 1, 30, 12, 5, 11, 3, 3, 17, 4], [40]]


def make_hf_model(folder: Path, arch: str, seed: int, layers: int = 2, vocab_size: int = 64, eos: bool = True,
                  context: int = 256) -> Path:
    """Save a random `arch` model + word-level tokenizer ("t0" … "t{V-1}", eos = t0 unless eos=False)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Phi3Config, Phi3ForCausalLM, PreTrainedTokenizerFast

    common = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                  eos_token_id=0 if eos else None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    if arch == "gemma3":
        config = Gemma3TextConfig(**common, head_dim=8, sliding_window=WINDOW, final_logit_softcapping=None,
                                  layer_types=["sliding_attention", "full_attention"][:layers] + ["sliding_attention"] * (layers - 2))
        model_cls = Gemma3ForCausalLM
    else:
        config, model_cls = Phi3Config(**common), Phi3ForCausalLM
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # larger logits than the default init: clear argmaxes, no near-ties
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(folder)
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t1"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    special = {"eos_token": "t0"} if eos else {}
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t1", **special).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Per architecture: (target folder, draft folder) sharing the vocabulary."""
    root = tmp_path_factory.mktemp("hf")
    return {arch: (make_hf_model(root / f"{arch}-target", arch, seed=1, layers=2),
                   make_hf_model(root / f"{arch}-draft", arch, seed=2, layers=1)) for arch in ARCHS}


@pytest.fixture(scope="module")
def pairs(folders):
    """Per architecture: (target, draft) loaded by verispec, and the target as a plain HF model."""
    from transformers import AutoModelForCausalLM

    return {arch: (load_model(target), load_model(draft), AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval())
            for arch, (target, draft) in folders.items()}


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=0, pad_token_id=0)
    return out[0, len(prompt):].tolist()


# --- loading -------------------------------------------------------------------------------------


def test_loading_picks_the_runner_by_model_type(folders, tiny_target):
    gemma = load_model(folders["gemma3"][0])
    assert isinstance(gemma.runner, HFRunner) and gemma.precision == "hf" and gemma.runner.dtype == torch.float32
    assert gemma.runner.config.model_type == "gemma3_text" and gemma.vocab_size == 64 and gemma.context_length == 256
    bf16 = load_model(folders["phi3"][0], "bfloat16")
    assert isinstance(bf16.runner, HFRunner) and bf16.runner.dtype == torch.bfloat16 and bf16.precision == "hf-bfloat16"
    assert bf16.runner.supports_trees and bf16.runner.forward(bf16.runner.new_cache(), torch.tensor([3, 4])).dtype == torch.float32
    assert isinstance(load_model(tiny_target).runner, Transformer)  # qwen2: the own runner
    explicit = load_model(tiny_target, "hf")  # any folder on the HF runner when asked
    assert isinstance(explicit.runner, HFRunner) and explicit.precision == "hf"
    with pytest.raises(ModelNotFoundError, match="own runner"):
        load_model(folders["phi3"][0], "int8")
    assert set(precisions_for("gemma3_text", gguf=True)) == {"float32", "bfloat16", "hf", "gguf"}
    assert precisions_for("qwen2")["int8"] == "verispec" and precisions_for("phi3")["float32"] == "transformers"


# --- the runner: chains, trees, caches -------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_chain_logits_match_one_plain_forward(pairs, arch):
    target, _, hf = pairs[arch]
    ids = torch.tensor(PROMPTS[1] + PROMPTS[0] + [7, 8, 9, 10])  # [22], past the sliding window
    with torch.no_grad():
        full = hf(ids[None]).logits[0].float()  # [22, vocab]
    runner = target.runner
    cache = runner.new_cache()
    pieces = [runner.forward(cache, ids[a:b]) for a, b in ((0, 9), (9, 10), (10, 15), (15, 22))]
    torch.testing.assert_close(torch.cat(pieces), full, rtol=0, atol=1e-4)
    assert cache.length == 22 and pieces[0].dtype == torch.float32
    cache.truncate(15)
    torch.testing.assert_close(runner.forward(cache, ids[15:22], logits="last"), full[-1:], rtol=0, atol=1e-4)
    assert runner.forward(cache, ids[:1], logits="none") is None and cache.length == 23


def _tree():
    """A 6-node tree (parents before children): root 0; 1, 2 under 0; 3 under 1; 4, 5 under 2."""
    parents = [-1, 0, 0, 1, 2, 2]
    depth = [0, 1, 1, 2, 2, 2]
    mask = torch.zeros(6, 6, dtype=torch.bool)
    for node in range(6):
        walk = node
        while walk >= 0:
            mask[node, walk] = True
            walk = parents[walk]
    return torch.tensor([21, 22, 23, 24, 25, 26]), torch.tensor(depth), mask


def _path(mask: torch.Tensor, node: int) -> list[int]:
    return mask[node].nonzero()[:, 0].tolist()  # ancestors and itself, root first


@pytest.mark.parametrize("arch", ARCHS)
def test_tree_nodes_score_as_their_paths(pairs, arch):
    target, _, _ = pairs[arch]
    runner = target.runner
    assert runner.supports_trees
    prefix = torch.tensor(PROMPTS[1])  # 14 tokens: nodes sit past Gemma's sliding window
    tokens, depth, mask = _tree()
    cache = runner.new_cache()
    runner.forward(cache, prefix)
    got = runner.forward(cache, tokens, positions=len(prefix) + depth, tree_mask=mask)  # [6, vocab]
    for node in range(6):
        chain = runner.new_cache()
        want = runner.forward(chain, torch.cat([prefix, tokens[_path(mask, node)]]), logits="last")[0]
        torch.testing.assert_close(got[node], want, rtol=0, atol=1e-4, msg=f"node {node}")


@pytest.mark.parametrize("arch", ARCHS)
def test_keep_and_truncate_leave_what_a_fresh_cache_holds(pairs, arch):
    target, _, _ = pairs[arch]
    runner = target.runner
    prefix = torch.tensor(PROMPTS[1])
    tokens, depth, mask = _tree()
    cache = runner.new_cache()
    runner.forward(cache, prefix)
    runner.forward(cache, tokens, positions=len(prefix) + depth, tree_mask=mask)
    kept = _path(mask, 5)  # [0, 2, 5]
    cache.keep(len(prefix), torch.tensor(kept))
    fresh = runner.new_cache()
    runner.forward(fresh, torch.cat([prefix, tokens[kept]]))
    assert cache.length == fresh.length == len(prefix) + 3

    def same(a, b):
        for la, lb in zip(a.kv.layers, b.kv.layers, strict=True):
            torch.testing.assert_close(la.keys, lb.keys, rtol=0, atol=1e-5)
            torch.testing.assert_close(la.values, lb.values, rtol=0, atol=1e-5)

    same(cache, fresh)
    nxt = torch.tensor([33, 34])
    torch.testing.assert_close(runner.forward(cache, nxt), runner.forward(fresh, nxt), rtol=0, atol=1e-4)
    cache.truncate(10)
    short = runner.new_cache()
    runner.forward(short, prefix[:10])
    same(cache, short)
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(11)
    cache.release()
    assert cache.length == 0


def test_an_architecture_that_ignores_custom_masks_runs_chains_only(folders):
    """A model that drops the 4-D mask (and so lets a node see its siblings) fails the tree check."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folders["phi3"][0], dtype=torch.float32)
    forward = model.forward
    model.forward = lambda *args, attention_mask=None, **kwargs: forward(*args, **kwargs)  # noqa: E731
    runner = HFRunner(model)
    assert not runner.supports_trees
    tokens, depth, mask = _tree()
    with pytest.raises(InvalidParameterError, match="chains only"):
        runner.forward(runner.new_cache(), tokens, positions=depth, tree_mask=mask)
    assert runner.forward(runner.new_cache(), tokens).shape == (6, 64)  # chains still run


# --- the engine on the HF runner --------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["model", "self", "tree", "tree-self"])
def test_greedy_speculative_decoding_is_token_identical(pairs, arch, kind):
    target, draft, hf = pairs[arch]
    drafter = {
        "model": DraftModelDrafter(draft, target.vocab_size),
        "self": DraftModelDrafter(target, target.vocab_size),  # always accepted: bonus tokens
        "tree": ExpansionDrafter(draft, target.vocab_size, k=2, depth=3, wide=2),
        "tree-self": ExpansionDrafter(target, target.vocab_size, k=2, depth=4, wide=1),
    }[kind]
    engine, plain = Engine(target, drafter, gamma=3, gamma_policy="constant"), Engine(target, None)
    for prompt in PROMPTS:
        config = GenerationConfig(max_new_tokens=20)
        got = engine.generate(prompt, config)
        want = plain.generate(prompt, config).token_ids
        assert got.token_ids == want == hf_greedy(hf, prompt, 20), prompt
    assert got.stats.steps < len(got.token_ids) or kind in ("model", "tree")  # self-drafts are accepted
