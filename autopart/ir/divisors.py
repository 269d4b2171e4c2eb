"""The divisors of a count (a batch's share, a world size), which the options and the search enumerate."""

from __future__ import annotations

import math

__all__ = ["divisors"]


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, in increasing order, found in √n steps: counting up to ``n`` took
    minutes for a global batch of a billion rows, before anything could refuse it."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]
