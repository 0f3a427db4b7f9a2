"""Training curves from ``metrics.jsonl``: loss and validation loss, gradient norm, learning
rate and BranchNorm alpha against the update step, several runs overlaid (PNG, matplotlib).

Used by ``commands/plot.py`` (``tools/plot_training.py``) and by the demo
(``megatron_branchnorm/workflows/demo.py``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from megatron_branchnorm.formats.records import MetricsFileError, read_metrics

# (metric key, panel title, log-scale y axis when the values span more than 20x)
PANELS: tuple[tuple[str, str, bool], ...] = (
    ("loss", "training loss (label-smoothed) and validation loss", False),
    ("grad_norm", "gradient norm (before clipping)", True),
    ("lr", "learning rate", False),
    ("alpha", "BranchNorm alpha", False),
)


PlotError = MetricsFileError
"""A run directory without usable metrics, or labels that do not match the runs: one line."""


def series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric; later rows for the same step win (a resumed run)."""
    points: dict[int, float] = {}
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            points[int(row["step"])] = float(value)
    steps = sorted(points)
    return steps, [points[s] for s in steps]


def plot_runs(
    run_dirs: list[str | Path], output: str | Path, labels: list[str] | None = None
) -> Path:
    """Write one PNG with a panel per metric (PANELS), each run in its own colour; returns it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if labels is not None and len(labels) != len(run_dirs):
        raise PlotError(f"{len(labels)} labels for {len(run_dirs)} runs")
    runs = [
        (labels[i] if labels else Path(d).name, read_metrics(d, strict=True))
        for i, d in enumerate(run_dirs)
    ]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), constrained_layout=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, title, log_y) in zip(axes.flat, PANELS, strict=True):
        drawn, lo, hi = False, math.inf, 0.0
        for i, (label, rows) in enumerate(runs):
            colour = colours[i % len(colours)]
            steps, values = series(rows, key)
            if steps:
                name = f"{label} train" if key == "loss" else label
                ax.plot(steps, values, color=colour, linewidth=1.2, label=name)
                drawn, lo, hi = True, min(lo, *values), max(hi, *values)
            if key == "loss":
                vsteps, vvalues = series(rows, "valid_loss")
                if vsteps:
                    ax.plot(
                        vsteps,
                        vvalues,
                        color=colour,
                        linestyle="--",
                        marker="o",
                        markersize=4,
                        linewidth=1.2,
                        label=f"{label} valid",
                    )
                    drawn = True
        ax.set_title(title)
        ax.set_xlabel("update step")
        ax.grid(True, alpha=0.3)
        if log_y and drawn and lo > 0 and hi / lo > 20:  # log only when it spans decades
            ax.set_yscale("log")
        if drawn:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.stem}.tmp{out.suffix}")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(out)
    return out
