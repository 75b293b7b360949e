"""Verifiers: decide which draft tokens to keep given the target's distributions."""

from verispec.verify.chain import residual_distribution, verify_greedy, verify_sampled

__all__ = ["verify_greedy", "verify_sampled", "residual_distribution"]
