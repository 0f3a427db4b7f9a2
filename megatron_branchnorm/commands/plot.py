"""Plot training curves of one or more runs: loss and validation loss, gradient norm, learning
rate and BranchNorm alpha against the update step, the runs overlaid, as one PNG.

    python tools/plot_training.py runs/demo/train --output runs/demo/plots/training.png
    python tools/plot_training.py runs/a runs/b --labels branchnorm,postln --output cmp.png

Each RUN_DIR is a train.save_dir holding metrics.jsonl.
"""

from __future__ import annotations

import argparse
import sys

from megatron_branchnorm.cli import run_main
from megatron_branchnorm.plotting import plot_runs

PROG = "plot_training.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
    )
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="train.save_dir of each run")
    p.add_argument("--output", default="training.png", help="PNG to write (default training.png)")
    p.add_argument("--labels", default=None, help="comma-separated legend names, one per run")
    return p.parse_args(argv)


def _plot(argv: list[str] | None) -> int:
    args = parse_args(argv)
    labels = args.labels.split(",") if args.labels else None
    out = plot_runs(args.runs, args.output, labels)
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Plot and say where. Bad input (a run without metrics.jsonl, labels that do not match the
    runs) is one line ``error: ...`` and exit 2."""
    return run_main(_plot, argv)


if __name__ == "__main__":
    sys.exit(main())
