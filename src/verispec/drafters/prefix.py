"""Where two token sequences part: what a drafter's state may keep after a rollback."""

from __future__ import annotations

__all__ = ["common_prefix_length"]


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of `a` and `b`.

    Prefix equality is monotone in the length, so a bisection over C-speed slice comparisons finds
    it in O(n log n) C work and O(log n) Python steps (sequences usually part near their ends).
    """
    low, high = 0, min(len(a), len(b))  # a[:low] == b[:low] holds; the answer is ≤ high
    shorter, longer = (a, b) if len(a) <= len(b) else (b, a)
    if shorter == longer[:high]:  # the common case (one sequence extends the other): one slice, not two
        return high
    while high - low > 1:
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low
