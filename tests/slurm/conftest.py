"""A real 2-node SLURM on this host for the launcher tests (workflows/local_slurm.py):
Debian's munge, slurmctld and two slurmd, installed with apt-get when missing and started on
private ports with every file in a temp dir; one cluster serves every test in the session."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_branchnorm.workflows.local_slurm import (
    Cluster,
    apt_install,
    ensure_installed,
    start_cluster,
)

__all__ = ["ROOT", "Cluster", "apt_install"]

ROOT = Path(__file__).resolve().parents[2]
NODES, CPUS = 2, 4  # the multi-node test's 2 nodes x 4 ranks; tiny_cpu.sh takes 2 on one node


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """Install (if needed) and start munged, slurmctld and 2 slurmd; stop them at the end."""
    reason = ensure_installed()
    if reason is not None:
        pytest.skip(f"SLURM cannot be installed here: {reason}")
    root = Path(tmp_path_factory.mktemp("slurm"))
    try:
        cluster = start_cluster(root, nodes=NODES, cpus=CPUS)
    except RuntimeError as exc:
        pytest.fail(str(exc))
    try:
        yield cluster
    finally:
        cluster.stop()
