"""Logits processing (temperature, top-k/p, min-p, ε, η, repetition penalty), and samplers."""

from verispec.sampling.processors import SamplingParams, greedy_tokens, seen_mask, to_probs
from verispec.sampling.samplers import argmax, gumbel_max, gumbel_topk, multinomial

__all__ = ["SamplingParams", "to_probs", "greedy_tokens", "seen_mask", "argmax", "multinomial", "gumbel_max", "gumbel_topk"]
