"""Temperature-based sampling weights over languages or translation directions.

With n_i examples in group i and temperature T, group i is drawn with probability
p_i = n_i^(1/T) / sum_j n_j^(1/T): T = 1 follows the data, T -> infinity is uniform, T = 5 is
the usual choice for OPUS-100 (and our default).

At start-up the trainer prints, and writes into its save_dir as :data:`SAMPLING_FILE`, the
table of :func:`sampling_table`: each direction's usable pairs, natural share and share at T.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


def temperature_probs(counts: list[int] | np.ndarray, temperature: float) -> np.ndarray:
    """p_i proportional to n_i^(1/T); groups with n_i = 0 get probability 0. Finite and
    summing to 1 for every T > 0 (computed in log space where n_i^(1/T) would overflow)."""
    if temperature <= 0:
        raise ValueError(f"sampling temperature must be > 0, got {temperature}")
    n = np.asarray(counts, dtype=np.float64)
    if (n < 0).any() or n.sum() <= 0:
        raise ValueError(f"need non-negative counts with a positive sum, got {list(counts)}")
    with np.errstate(over="ignore", under="ignore", invalid="ignore", divide="ignore"):
        w = np.where(n > 0, n ** (1.0 / temperature), 0.0)
        total = w.sum()
        if np.isfinite(total) and total > 0:
            # The direct formula, bit for bit as before, wherever it is finite: fixed-seed
            # runs at the usual temperatures keep their exact sample streams.
            return w / total
        # A small T overflows n^(1/T) (0.01: 3000^100 = inf, and inf/inf = NaN):
        # the same ratio in log space, shifted by the largest exponent, stays finite.
        logw = np.where(n > 0, np.log(np.where(n > 0, n, 1.0)) / temperature, -np.inf)
        top = logw.max()
        if np.isfinite(top):
            w = np.where(n > 0, np.exp(logw - top), 0.0)
        else:  # T so small that even log n / T overflows: the limit T -> 0, the largest group
            w = (n == n.max()).astype(np.float64)
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


SAMPLING_FILE = "sampling.tsv"
"""The start-up sampling table in a run's save_dir (:func:`write_sampling_table`)."""
_COLUMNS = ("direction", "pairs", "natural", "sampled")


def sampling_table(
    directions: list[str], counts: list[int] | np.ndarray, temperature: float
) -> list[dict]:
    """What each direction is trained on: ``{"direction", "pairs" (usable samples n_i),
    "natural" (n_i / sum n), "sampled" (p_i ~ n_i^(1/T))}`` per direction, in the given
    order. Both shares sum to 1; at T = 1 they are equal."""
    if len(directions) != len(counts):
        raise ValueError(f"{len(directions)} directions but {len(counts)} counts")
    n = np.asarray(counts, dtype=np.int64)
    natural = temperature_probs(n, 1.0)
    sampled = temperature_probs(n, temperature)
    return [
        {"direction": d, "pairs": int(c), "natural": float(a), "sampled": float(b)}
        for d, c, a, b in zip(directions, n, natural, sampled, strict=True)
    ]


def format_sampling_table(rows: list[dict], temperature: float) -> list[str]:
    """The table as console lines: a header, one line per direction, the total."""
    width = max([len("direction"), *(len(r["direction"]) for r in rows)])
    lines = [
        f"sampling over {len(rows)} directions at temperature {temperature:g}:",
        f"  {'direction':<{width}} {'pairs':>12} {'natural':>8} {'sampled':>8}",
    ]
    for r in rows:
        lines.append(
            f"  {r['direction']:<{width}} {r['pairs']:>12,} {r['natural']:>8.2%} "
            f"{r['sampled']:>8.2%}"
        )
    total = sum(r["pairs"] for r in rows)
    lines.append(f"  {'total':<{width}} {total:>12,} {1:>8.2%} {1:>8.2%}")
    return lines


def write_sampling_table(path: str | Path, rows: list[dict]) -> None:
    """``rows`` as a tab-separated file with a header (``direction pairs natural sampled``;
    shares as fractions with 8 decimals), written to a temporary name and renamed."""
    path = Path(path)
    lines = ["\t".join(_COLUMNS)]
    lines += [
        f"{r['direction']}\t{r['pairs']}\t{r['natural']:.8f}\t{r['sampled']:.8f}" for r in rows
    ]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    os.replace(tmp, path)
