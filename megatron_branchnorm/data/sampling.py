"""Temperature-based sampling weights over languages or translation directions.

With n_i examples in group i and temperature T, group i is drawn with probability
p_i = n_i^(1/T) / sum_j n_j^(1/T): T = 1 follows the data, T -> infinity is uniform, T = 5 is
the usual choice for OPUS-100 (and our default).
"""

from __future__ import annotations

import numpy as np


def temperature_probs(counts: list[int] | np.ndarray, temperature: float) -> np.ndarray:
    """p_i proportional to n_i^(1/T); groups with n_i = 0 get probability 0."""
    if temperature <= 0:
        raise ValueError(f"sampling temperature must be > 0, got {temperature}")
    n = np.asarray(counts, dtype=np.float64)
    if (n < 0).any() or n.sum() <= 0:
        raise ValueError(f"need non-negative counts with a positive sum, got {list(counts)}")
    w = np.where(n > 0, n ** (1.0 / temperature), 0.0)
    return w / w.sum()


def allocate(total: int, probs: np.ndarray) -> np.ndarray:
    """Integer counts summing to ``total`` that follow ``probs`` (largest-remainder rounding,
    ties to the lower index), so each count is within 1 of ``total * p_i``."""
    exact = np.asarray(probs, dtype=np.float64) * total
    base = np.floor(exact).astype(np.int64)
    rest = total - int(base.sum())
    if rest > 0:
        order = np.lexsort((np.arange(exact.size), -(exact - base)))
        base[order[:rest]] += 1
    return base
