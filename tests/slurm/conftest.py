"""A real one-node SLURM for the launcher tests: Debian's munge, slurmctld and slurmd, installed
with apt-get when missing and started on private ports with every file in a temp dir."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SLURM_PACKAGES = ("slurmctld", "slurmd", "munge")
SLURM_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "squeue")
POLICY_RC = Path("/usr/sbin/policy-rc.d")


def apt_install(packages: tuple[str, ...]) -> str | None:
    """Install Debian packages (apt-get update first); None on success, else why not.

    Daemons are not started by the packages' scripts: a temporary policy-rc.d denies it
    when the machine has none, so nothing is left running that the tests did not start.
    """
    if shutil.which("apt-get") is None:
        return "apt-get is not available (not a Debian-like system)"
    if os.geteuid() != 0:
        return "installing packages needs root"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    wrote_policy = False
    try:
        if not POLICY_RC.exists():
            POLICY_RC.write_text("#!/bin/sh\nexit 101\n")
            POLICY_RC.chmod(0o755)
            wrote_policy = True
        for cmd in (
            ["apt-get", "update"],
            ["apt-get", "install", "-y", "--no-install-recommends", *packages],
        ):
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
                return f"`{' '.join(cmd)}` failed: {' | '.join(tail)}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"apt-get failed: {exc}"
    finally:
        if wrote_policy:
            POLICY_RC.unlink(missing_ok=True)
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Cluster:
    """A running one-node SLURM: its config, directory and client environment."""

    root: Path
    conf: Path
    env: dict

    def run(self, *cmd: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        """A SLURM client command against this cluster."""
        env = kwargs.pop("env", self.env)
        proc = subprocess.run(
            list(cmd), env=env, capture_output=True, text=True, timeout=60, **kwargs
        )
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr}")
        return proc

    def job_field(self, job_id: str, field: str) -> str:
        """One ``Key=Value`` field of ``scontrol show job`` ('' when the job is gone)."""
        out = self.run("scontrol", "-o", "show", "job", job_id, check=False).stdout
        for item in out.split():
            key, _, value = item.partition("=")
            if key == field:
                return value
        return ""

    def logs(self) -> str:
        """Tails of the daemons' logs, for failure messages."""
        text = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.root / "log" / name
            if path.is_file():
                text.append(f"--- {name}\n" + "\n".join(path.read_text().splitlines()[-15:]))
        return "\n".join(text)


SLURM_CONF = """\
ClusterName=mbtest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
# cred_expire also sets how long a requeued job waits before it may start again (default 120 s)
AuthInfo=socket={root}/munge/munge.socket,cred_expire=10
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
SlurmdParameters=config_overrides
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
KillWait=10
MinJobAge=600
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def _stop(pid_file: Path, timeout: float = 10.0) -> None:
    """SIGTERM the daemon whose pid file we wrote, then wait for it."""
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """Install (if needed) and start munged, slurmctld and slurmd; stop them at the end."""
    if any(shutil.which(b) is None for b in SLURM_BINARIES):
        reason = apt_install(SLURM_PACKAGES)
        if reason is not None:
            pytest.skip(f"SLURM cannot be installed here: {reason}")
    missing = [b for b in SLURM_BINARIES if shutil.which(b) is None]
    if missing:
        pytest.skip(f"SLURM binaries missing after install: {missing}")

    root = Path(tmp_path_factory.mktemp("slurm"))
    for sub in ("munge", "state", "spool", "log"):
        (root / sub).mkdir()
    (root / "munge").chmod(0o755)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    host = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text(
        SLURM_CONF.format(
            host=host,
            root=root,
            ctld_port=free_port(),
            slurmd_port=free_port(),
            cpus=max(2, os.cpu_count() or 1),  # tiny_cpu.sh asks for 2 tasks
        )
    )
    env = dict(os.environ, SLURM_CONF=str(conf))
    for var in (
        "SLURM_JOB_ID",
        "SLURM_JOBID",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        env.pop(var, None)
    cluster = Cluster(root, conf, env)
    pid_files = [root / "slurmd.pid", root / "slurmctld.pid", root / "munge" / "munged.pid"]
    try:
        m = root / "munge"
        subprocess.run(
            [
                "munged",
                "--force",
                f"--key-file={m / 'munge.key'}",
                f"--socket={m / 'munge.socket'}",
                f"--pid-file={m / 'munged.pid'}",
                f"--log-file={m / 'munged.log'}",
                f"--seed-file={m / 'munged.seed'}",
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )
        subprocess.run(["slurmctld", "-f", str(conf)], env=env, check=True, timeout=30)
        subprocess.run(["slurmd", "-f", str(conf)], env=env, check=True, timeout=30)
        deadline = time.time() + 60
        state = ""
        while time.time() < deadline:
            state = cluster.run("sinfo", "-h", "-o", "%t", check=False).stdout.strip()
            if state == "idle":
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"slurmd never became idle (state {state!r})\n{cluster.logs()}")
        yield cluster
    finally:
        if shutil.which("scancel"):
            subprocess.run(
                ["scancel", "--full", "--user=root"], env=env, capture_output=True, timeout=30
            )
            time.sleep(1)
        for pid_file in pid_files:
            _stop(pid_file)
