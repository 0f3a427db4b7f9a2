"""Whether two training runs recorded the same thing: their metrics.jsonl row by row, exactly,
leaving out the timing keys (tokens_per_sec, tflops_per_gpu, memory_mb, memory_reserved_mb,
elapsed_s, eta_s).

    python tools/compare_metrics.py RUN_A RUN_B     # exit 0 same, 1 different, 2 unreadable

Used to show that a refactor changed nothing: the same fixed-seed runs before and after
(docs/design.md §1; tools/same_runs.sh runs them). The comparison itself is
``training.metrics.first_difference``, next to the writer that knows which keys are timings.
"""

from __future__ import annotations

import argparse
import sys

from megatron_branchnorm.formats.records import MetricsFileError
from megatron_branchnorm.training.metrics import first_difference


def main(argv: list[str] | None = None) -> int:
    """Compare and say so: exit 0 the same rows, 1 the first difference named, 2 (one line
    ``error: ...``) when a run's metrics.jsonl is missing or cannot be read strictly."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_a", help="a save_dir holding metrics.jsonl")
    parser.add_argument("run_b", help="another save_dir")
    args = parser.parse_args(argv)
    try:
        diff = first_difference(args.run_a, args.run_b)
    except (MetricsFileError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if diff is not None:
        print(f"{args.run_a} vs {args.run_b}: {diff}")
        return 1
    print(f"{args.run_a} and {args.run_b}: the same rows (timings left out)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
