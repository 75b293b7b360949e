"""Logits processing (logit bias, repetition, presence and frequency penalties, temperature, top-k/p, min-p, ε, η), and samplers."""

from verispec.sampling.processors import SamplingParams, greedy_tokens, to_probs, token_counts
from verispec.sampling.samplers import argmax, gumbel_max, gumbel_topk, multinomial

__all__ = ["SamplingParams", "to_probs", "greedy_tokens", "token_counts", "argmax", "multinomial", "gumbel_max", "gumbel_topk"]
