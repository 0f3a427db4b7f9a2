"""Plot training curves of one or more runs: loss and validation loss, gradient norm, learning
rate and BranchNorm alpha against the update step, the runs overlaid, as one PNG (or PDF, SVG).

    python tools/plot_training.py runs/demo/train --output runs/demo-training.png
    python tools/plot_training.py runs/a runs/b --labels branchnorm,postln --output cmp.svg

Each RUN_DIR is a train.save_dir holding metrics.jsonl. The format is --output's extension
(png, pdf or svg). An existing --output is replaced only when it is a plot of ours (its
metadata says so) or with --overwrite; --output never goes inside a RUN_DIR or any other
directory a tool of ours writes (a run, a DATA_DIR, an export, a demo...). Both are checked
before any work.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_branchnorm.cli import run_main
from megatron_branchnorm.formats.outputs import OutputError, check_output_file
from megatron_branchnorm.runner.plotting import PlotError, is_our_plot, plot_format, plot_runs

PROG = "plot_training.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
    )
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="train.save_dir of each run")
    p.add_argument(
        "--output",
        default="training.png",
        help="figure to write, .png, .pdf or .svg (default training.png)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --output that is not a plot of ours (one of ours always is)",
    )
    p.add_argument("--labels", default=None, help="comma-separated legend names, one per run")
    return p.parse_args(argv)


def check_plot_output(output: str, runs: list[str], overwrite: bool) -> None:
    """Refuse, before any work, an ``--output`` of a format we do not plot, one that would
    overwrite or go inside an input or a directory of a known kind
    (:func:`cli.check_output_file`), or an existing file that is not a plot of ours (without
    ``overwrite``): a PlotError, one line."""
    plot_format(output)
    try:
        check_output_file(
            output, "--output", [("RUN_DIR", r) for r in runs], lambda _: True, "a plot"
        )
    except OutputError as exc:
        raise PlotError(str(exc)) from None
    path = Path(output)
    if path.is_file() and not overwrite and not is_our_plot(path):
        raise PlotError(
            f"--output {output}: exists and is not a plot of ours; choose a new path or pass "
            "--overwrite to replace it"
        )


def _plot(argv: list[str] | None) -> int:
    args = parse_args(argv)
    check_plot_output(args.output, args.runs, args.overwrite)
    labels = args.labels.split(",") if args.labels else None
    out = plot_runs(args.runs, args.output, labels)
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Plot and say where. Bad input (a run without metrics.jsonl, labels that do not match the
    runs, an --output refused by :func:`check_plot_output`) is one line ``error: ...`` and exit
    2."""
    return run_main(_plot, argv)


if __name__ == "__main__":
    sys.exit(main())
