"""Benchmarks: verispec against Hugging Face generation on a small built-in prompt set."""
