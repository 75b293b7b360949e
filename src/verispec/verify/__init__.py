"""Verifiers: decide which draft tokens to keep given the target's distributions."""

from verispec.verify.chain import residual_distribution, verify_greedy, verify_sampled
from verispec.verify.tree import verify_tree_greedy, verify_tree_sampled

__all__ = ["verify_greedy", "verify_sampled", "residual_distribution", "verify_tree_greedy", "verify_tree_sampled"]
