"""What a 0.5B draft model would cost on the kquant kernels (issue #31: a draft at c ≤ 0.15).

The shipped 0.5B draft cannot run in kquant: its 896-wide layers are Q5_0/Q8_0 blocks (a Q4_K super-block
needs input widths that are multiples of 256), so it drafts on llama.cpp, at c ≈ 0.6–0.8 of a kquant
target step. This probe times, in one process, the shipped 1.5B target in kquant and random-weight
models of the 0.5B's shape as a requantized copy would run: widths padded to the next multiple of 256
(896 → 1024, 4864 → 5120), Q4_K blocks (the head Q6_K, as the target's), 24 layers, 2 KV heads; with
the full vocabulary and with a reduced one (FR-Spec style, `model:…,vocab=N`). Each: the median decode
step after --context tokens, and c = that over the target's step.

    python benchmarks/probes/kquant_draft_cost.py [--context 300] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from verispec.models.kquant import KQUANT_TYPES, KQuantWeight
from verispec.models.loading import load_model
from verispec.models.registry import DEFAULT_TARGET
from verispec.models.transformer import ModelConfig, Transformer

BLOCK_BYTES = {"Q4_K": 144, "Q6_K": 210}


def random_blocks(rng: np.random.Generator, kind: str, rows: int, cols: int) -> KQuantWeight:
    """Random blocks of `kind` with small float16 scales (finite activations through 24 layers)."""
    raw = rng.integers(0, 256, (rows, cols // 256, BLOCK_BYTES[kind]), dtype=np.uint8)
    scale = np.array([1e-3], dtype=np.float16).view(np.uint8)  # the two bytes of a float16
    if kind == "Q4_K":
        raw[:, :, 0:2], raw[:, :, 2:4] = scale, scale  # d, dmin
    else:
        raw[:, :, 208:210] = scale
    return KQuantWeight(KQUANT_TYPES[kind], torch.from_numpy(raw.reshape(rows, -1)), cols)


def draft_shaped(vocab: int, hidden: int = 1024, intermediate: int = 5120, layers: int = 24, heads: int = 16,
                 kv_heads: int = 2) -> Transformer:
    """A random kquant model of the padded 0.5B's shape (head_dim 64, as the 0.5B's)."""
    rng = np.random.default_rng(0)
    head_dim = hidden // heads
    config = ModelConfig(model_type="qwen2", vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                         rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=4096, attention_bias=True,
                         tie_word_embeddings=False)
    weights: dict[str, torch.Tensor | KQuantWeight] = {
        "model.embed_tokens.weight": random_blocks(rng, "Q4_K", vocab, hidden),
        "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": random_blocks(rng, "Q6_K", vocab, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": torch.ones(hidden), p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "self_attn.q_proj.weight": random_blocks(rng, "Q4_K", hidden, hidden),
            p + "self_attn.k_proj.weight": random_blocks(rng, "Q4_K", kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": random_blocks(rng, "Q4_K", kv_heads * head_dim, hidden),
            p + "self_attn.q_proj.bias": torch.zeros(hidden),
            p + "self_attn.k_proj.bias": torch.zeros(kv_heads * head_dim),
            p + "self_attn.v_proj.bias": torch.zeros(kv_heads * head_dim),
            p + "self_attn.o_proj.weight": random_blocks(rng, "Q4_K", hidden, hidden),
            p + "mlp.gate_proj.weight": random_blocks(rng, "Q4_K", intermediate, hidden),
            p + "mlp.up_proj.weight": random_blocks(rng, "Q4_K", intermediate, hidden),
            p + "mlp.down_proj.weight": random_blocks(rng, "Q4_K", hidden, intermediate),
        }
    return Transformer(config, weights, torch.float32, quant="kquant")


def step_seconds(runner, context: int, repeats: int) -> float:
    """Median seconds of a one-token decode step after `context` cached tokens (logits of the head)."""
    cache = runner.new_cache(context + 8)
    runner.forward(cache, torch.arange(100, 100 + context), logits="none")
    times = []
    for _ in range(repeats):
        cache.truncate(context)
        began = time.perf_counter()
        runner.forward(cache, torch.tensor([7]), logits="last")
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    from verispec.paths import cpu_summary

    print(f"{cpu_summary()}, {torch.get_num_threads()} threads, {args.context} cached tokens, median of {args.repeats}")
    target = step_seconds(load_model(DEFAULT_TARGET, "kquant").runner, args.context, args.repeats)
    print(f"  target (shipped 1.5B, kquant): {target * 1e3:.1f} ms a step")
    for vocab in (151936, 32768, 16384):
        draft = draft_shaped(vocab)
        seconds = step_seconds(draft, args.context, args.repeats)
        print(f"  0.5B shape, padded, vocab {vocab:6d}: {seconds * 1e3:.1f} ms a step ({draft.linear_bytes / 1e6:.0f} MB "
              f"of weights a token), c = {seconds / target:.2f}", flush=True)
        del draft


if __name__ == "__main__":
    main()
