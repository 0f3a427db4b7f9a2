"""Start or stop a real SLURM cluster of K nodes on this host (munged, slurmctld, K slurmd),
every file in one directory; for rehearsing the sbatch launchers on CPU before GPU hours.

    python tools/local_slurm.py start --dir /tmp/mbslurm --nodes 4 --cpus 8
    export SLURM_CONF=/tmp/mbslurm/slurm.conf          # what `start` and `env` print
    sbatch --nodes=4 --gres=none --cpus-per-task=1 slurm/opus100_1000L.sh
    python tools/local_slurm.py stop --dir /tmp/mbslurm

Needs root (SlurmUser=root, and slurm/munge are installed with apt-get when missing). The node
names (mbn1..mbnK) are added to /etc/hosts as 127.0.0.1 aliases when they do not resolve, and
left there. Logic: megatron_branchnorm/local_slurm.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_branchnorm.local_slurm import (
    Cluster,
    ensure_installed,
    start_cluster,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("start", "stop", "env", "status"))
    parser.add_argument("--dir", required=True, type=Path, help="the cluster's directory")
    parser.add_argument("--nodes", type=int, default=2, help="slurmd daemons (start)")
    parser.add_argument("--cpus", type=int, default=8, help="CPUs each node announces (start)")
    parser.add_argument(
        "--requeue-delay",
        type=int,
        default=10,
        help="seconds before a requeued job may start again (munge cred_expire; SLURM's "
        "default is 120)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Parse, act, print the client environment."""
    args = parse_args(argv)
    if args.action == "start":
        reason = ensure_installed()
        if reason is not None:
            print(f"error: SLURM cannot be installed: {reason}", file=sys.stderr)
            return 1
        try:
            cluster = start_cluster(args.dir, args.nodes, args.cpus, args.requeue_delay)
        except (RuntimeError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        if cluster.hosts_added:
            print(
                f"added to /etc/hosts as 127.0.0.1: {' '.join(cluster.hosts_added)}",
                file=sys.stderr,
            )
        nodes = ", ".join(f"{n}: {s}" for n, s in cluster.node_states().items())
        print(f"started {len(cluster.nodes)} node(s) x {args.cpus} CPUs ({nodes})", file=sys.stderr)
    else:
        try:
            cluster = Cluster.from_dir(args.dir)
        except FileNotFoundError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        if args.action == "stop":
            cluster.stop()
            print(f"stopped the cluster in {cluster.root}", file=sys.stderr)
            return 0
        if args.action == "status":
            print(cluster.run("sinfo", "-N", check=False).stdout, end="")
            print(cluster.run("squeue", check=False).stdout, end="")
            return 0
    print(f"export SLURM_CONF={cluster.conf}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
