"""γ control: policies choosing the draft length, and the measured costs they use."""

from verispec.control.costs import CostModel
from verispec.control.gamma import POLICIES, GammaPolicy, make_gamma_policy

__all__ = ["CostModel", "GammaPolicy", "make_gamma_policy", "POLICIES"]
