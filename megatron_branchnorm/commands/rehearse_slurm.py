"""Rehearse a shipped sbatch launcher at its real topology on a local CPU SLURM cluster before
spending GPU hours: start K local nodes, submit the launcher unchanged (only the model's width
shrunk), send SIGUSR1 after a few updates, and check that every rank checkpoints and exits 75,
the job requeues, resumes and finishes, and metrics.jsonl has every step once. Prints the checks,
the figures (start-up, time per update, signal to exit, save, requeue to resume, total) and the
exact sbatch command; exit 0 when every check passed.

    python tools/rehearse_slurm.py                                     # opus100_1000L, 4 x 8 ranks
    python tools/rehearse_slurm.py --launcher slurm/opus100_200L.sh --nodes 2
    python tools/rehearse_slurm.py --cluster /tmp/mbslurm              # a cluster already started

The 1000-layer case needs ~10-13 GB of memory for its 32 ranks and ~13 minutes on 2 cores: run
it alone. Logic: megatron_branchnorm/rehearse_slurm.py and megatron_branchnorm/local_slurm.py.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from megatron_branchnorm.config import load_config
from megatron_branchnorm.local_slurm import Cluster, ensure_installed, start_cluster
from megatron_branchnorm.rehearse_slurm import (
    ROOT,
    default_spec,
    format_result,
    rehearse,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launcher", default="slurm/opus100_1000L.sh")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4, help="train.max_steps")
    parser.add_argument("--signal-after", type=int, default=2, help="updates before SIGUSR1")
    parser.add_argument(
        "--micro-batches", type=int, default=None, help="train.micro_batches (default: config's)"
    )
    parser.add_argument("--time", default="60", help="sbatch --time (above the signal lead)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds for the job")
    parser.add_argument("--work", type=Path, default=None, help="job log and run directory")
    parser.add_argument(
        "--cluster", type=Path, default=None, help="use the cluster in this directory"
    )
    return parser.parse_args(argv)


def launcher_stages(launcher: str) -> int:
    """pipeline.stages of the config a launcher runs by default (CONFIG=${CONFIG:-name})."""
    text = (ROOT / launcher).read_text()
    name = re.search(r"CONFIG=\$\{CONFIG:-([\w./-]+)\}", text).group(1)
    return load_config(name).pipeline.stages


def main(argv: list[str] | None = None) -> int:
    """Parse, start a cluster (unless given one), rehearse, print the tables."""
    args = parse_args(argv)
    spec = default_spec(
        args.launcher,
        args.nodes,
        args.ranks_per_node,
        launcher_stages(args.launcher),
        args.steps,
        args.signal_after,
        args.micro_batches,
    )
    spec.time_limit = args.time
    work = args.work or Path(tempfile.mkdtemp(prefix="rehearse_"))
    own = args.cluster is None
    if own:
        reason = ensure_installed()
        if reason is not None:
            print(f"error: SLURM cannot be installed: {reason}", file=sys.stderr)
            return 1
        cluster = start_cluster(work / "slurm", args.nodes, args.ranks_per_node)
        if cluster.hosts_added:
            print(f"added to /etc/hosts as 127.0.0.1: {' '.join(cluster.hosts_added)}")
    else:
        cluster = Cluster.from_dir(args.cluster)
    try:
        result = rehearse(cluster, spec, work / "job", timeout=args.timeout, echo=True)
    finally:
        if own:
            cluster.stop()
    print(format_result(result))
    failures = result.failures()
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
