"""Training curves from ``metrics.jsonl``: loss and validation loss, gradient norm, learning
rate and BranchNorm alpha against the update step, several runs overlaid (PNG, PDF or SVG,
matplotlib).

Used by ``commands/plot.py`` (``tools/plot_training.py``) and by the demo
(``megatron_branchnorm/workflows/demo.py``). Every figure carries :data:`CREATOR` in its
metadata (PNG ``Software``, PDF and SVG ``Creator``), which is how :func:`is_our_plot` tells a
plot of ours, the only existing file ``plot_training.py`` replaces without ``--overwrite``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from megatron_branchnorm.formats.files import open_regular
from megatron_branchnorm.formats.outputs import open_temp_file_beside
from megatron_branchnorm.formats.records import MetricsFileError, read_metrics

# (metric key, panel title, log-scale y axis when the values span more than 20x)
PANELS: tuple[tuple[str, str, bool], ...] = (
    ("loss", "training loss (label-smoothed) and validation loss", False),
    ("grad_norm", "gradient norm (before clipping)", True),
    ("lr", "learning rate", False),
    ("alpha", "BranchNorm alpha", False),
)


PlotError = MetricsFileError
"""A run directory without usable metrics, labels that do not match the runs, an output of a
format we do not write: one line."""

FORMATS = {"png": "Software", "pdf": "Creator", "svg": "Creator"}
"""The formats a plot is written in (by the output's extension), each with the metadata key
that carries :data:`CREATOR`."""
CREATOR = "megatron_branchnorm plot_training"
"""What every plot of ours says made it (:func:`is_our_plot`)."""
_LOOK_BYTES = 64 << 10
"""How much of each end of a file :func:`is_our_plot` reads: the PNG text chunk and the SVG
metadata come first, the PDF information dictionary last."""


def plot_format(output: str | Path) -> str:
    """The format of the plot ``output`` (its extension: png, pdf or svg); a PlotError naming
    it otherwise."""
    fmt = Path(output).suffix.lower().removeprefix(".")
    if fmt not in FORMATS:
        got = f"its extension {Path(output).suffix!r}" if fmt else "it has no extension"
        raise PlotError(f"--output {output}: {got} is not a format we plot ({', '.join(FORMATS)})")
    return fmt


def is_our_plot(path: Path) -> bool:
    """Whether the regular file ``path`` is a plot we wrote (:data:`CREATOR` in its
    metadata); only its two ends are read."""
    try:
        with open_regular(path) as fh:
            head = fh.read(_LOOK_BYTES)
            size = fh.seek(0, 2)
            fh.seek(max(size - _LOOK_BYTES, len(head)))
            tail = fh.read(_LOOK_BYTES)
    except (OSError, ValueError):  # FileShapeError too: a device or FIFO is not ours
        return False
    tag = CREATOR.encode()
    return tag in head or tag in tail


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
    """Write one figure with a panel per metric (PANELS), each run in its own colour, in the
    format of ``output``'s extension (:data:`FORMATS`); returns it. Written to a new temporary
    file beside ``output`` renamed when complete (an existing device or FIFO is written in
    place, never replaced)."""
    fmt = plot_format(output)
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
    if out.exists() and not out.is_file():  # a device or FIFO: written in place, never replaced
        try:
            with open(out, "wb") as fh:
                fig.savefig(fh, format=fmt, dpi=100, metadata={FORMATS[fmt]: CREATOR})
        finally:
            plt.close(fig)
        return out
    tmp, fh = open_temp_file_beside(out)
    try:
        with fh:
            fig.savefig(fh, format=fmt, dpi=100, metadata={FORMATS[fmt]: CREATOR})
        tmp.replace(out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)
    return out
