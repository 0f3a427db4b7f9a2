"""workflows/local_slurm.py's config and tools/local_slurm.py, the rehearsal's log parsing,
and slurm/common.sh's time parsing: the parts that need no job."""

from __future__ import annotations

import subprocess
import sys

from megatron_branchnorm.workflows.local_slurm import Cluster, node_names, write_config
from megatron_branchnorm.workflows.rehearse_slurm import ranks_exited
from tests.slurm.conftest import ROOT


def test_config_has_one_slurmd_per_node_on_its_own_port(tmp_path):
    conf = write_config(tmp_path, nodes=4, cpus=8).read_text()
    assert "SlurmdParameters=config_overrides" in conf
    for key in ("SlurmdSpoolDir", "SlurmdPidFile", "SlurmdLogFile"):
        assert f"{key}={tmp_path}/" in conf and "%n" in conf.split(f"{key}=")[1].split()[0]
    node = next(line for line in conf.splitlines() if line.startswith("NodeName="))
    assert node.startswith("NodeName=mbn[1-4] ") and "NodeAddr=127.0.0.1" in node
    first, last = node.split("Port=[")[1].split("]")[0].split("-")
    assert int(last) - int(first) == 3 and "CPUs=8" in node
    assert node_names(4) == ["mbn1", "mbn2", "mbn3", "mbn4"]
    assert Cluster.from_dir(tmp_path).nodes == node_names(4)


def test_srun_exit_lines_name_every_rank():
    log = (
        "srun: error: mbn1: tasks 0-1,3: Exited with exit code 75\n"
        "srun: error: mbn2: task 5: Exited with exit code 75\n"
        "srun: error: mbn2: task 4: Exited with exit code 1\n"
    )
    assert ranks_exited(log, 75) == {0, 1, 3, 5}
    assert ranks_exited(log, 1) == {4}


def test_the_peers_of_a_lost_node_said_why_even_where_a_lost_rank_did_too():
    """rehearse_node_loss's check: 8 ranks, 4 a node, the last node lost. Its rank 7, missed by
    one /proc scan, saw its peers die and exited 4 before its SIGKILL landed (a fresh-clone run,
    2026-11-28): the survivors still all said why. An off-node rank that did not, or a rank
    outside the job, fails the check."""
    from megatron_branchnorm.workflows.rehearse_node_loss import peers_said_why

    assert peers_said_why({0, 1, 2, 3}, 8, 4)
    assert peers_said_why({0, 1, 2, 3, 7}, 8, 4)
    assert not peers_said_why({0, 1, 3}, 8, 4)
    assert not peers_said_why({0, 1, 3, 7}, 8, 4)
    assert not peers_said_why({0, 1, 2, 3, 8}, 8, 4)


def test_common_sh_reads_slurm_time_limits():
    cases = {"5": 300, "05:30": 330, "1:00:00": 3600, "2-03:04": 183840, "1-00:00:00": 86400}
    script = "source slurm/common.sh; " + "; ".join(f"mb_seconds {t}" for t in cases)
    script += '; echo "[$(mb_seconds UNLIMITED)]"'
    out = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.split() == [*map(str, cases.values()), "[]"], out.stderr


def test_tool_prints_the_client_env_of_a_running_cluster(slurm_cluster):
    tool = str(ROOT / "tools" / "local_slurm.py")
    out = subprocess.run(
        [sys.executable, tool, "env", "--dir", str(slurm_cluster.root)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"export SLURM_CONF={slurm_cluster.conf}"
    status = subprocess.run(
        [sys.executable, tool, "status", "--dir", str(slurm_cluster.root)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "mbn1" in status.stdout and "mbn2" in status.stdout, status.stderr
