"""A real SLURM cluster of K nodes on this one host, for testing and rehearsing the launchers.

Debian's ``munged``, ``slurmctld`` and K ``slurmd`` daemons (``slurmd -N n1`` ... ``-N nK``,
each on its own port, ``SlurmdParameters=config_overrides`` so that each node announces the
CPUs the config gives it), every file under one directory, private ports, ``SlurmUser=root``.
The node names are 127.0.0.1 aliases: a launcher's ``MASTER_ADDR`` is the first node's name,
so they must resolve; :func:`ensure_resolvable` adds the missing ones to ``/etc/hosts``.

    cluster = start_cluster(Path("/tmp/slurm"), nodes=4, cpus=8)
    cluster.run("sbatch", "--gres=none", "slurm/opus100_1000L.sh")
    cluster.stop()

:func:`main` is the command line (``tools/local_slurm.py``, :data:`USAGE`);
``tests/slurm/conftest.py`` the test fixture.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_branchnorm.cli import run_main
from megatron_branchnorm.errors import UserError
from megatron_branchnorm.formats.outputs import check_scratch_dir
from megatron_branchnorm.runner.launch import quiet_ports

SLURM_PACKAGES = ("slurmctld", "slurmd", "munge")
SLURM_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "squeue")
POLICY_RC = Path("/usr/sbin/policy-rc.d")
HOSTS = Path("/etc/hosts")
HOSTS_MARK = "# megatron-branchnorm local_slurm nodes"
NODE_PREFIX = "mbn"  # node names mbn1..mbnK: unlikely to shadow a real host
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
# variables of an enclosing job or launcher that must not leak into the clients' environment
JOB_VARS = ("SLURM_JOB_ID", "SLURM_JOBID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
JOB_VARS += ("MASTER_PORT",)

SLURM_CONF = """\
# written by megatron_branchnorm/local_slurm.py: {nodes} node(s) on this host
ClusterName=mblocal
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
AuthType=auth/munge
CredType=cred/munge
# cred_expire also sets how long a requeued job waits before it may start again (default 120 s)
AuthInfo=socket={root}/munge/munge.socket,cred_expire={cred_expire}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
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
SlurmdTimeout=300
MessageTimeout=30
KillWait=10
MinJobAge=600
NodeName={prefix}[1-{nodes}] NodeHostname={host} NodeAddr=127.0.0.1 Port=[{port}-{last_port}] CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={prefix}[1-{nodes}] Default=YES MaxTime=INFINITE State=UP
"""


class ClusterError(UserError, RuntimeError):
    """The local cluster could not be installed, started or used (a one-line message)."""


def apt_install(packages: tuple[str, ...]) -> str | None:
    """Install Debian packages (apt-get update first); None on success, else why not.

    Daemons are not started by the packages' scripts: a temporary policy-rc.d denies it
    when the machine has none, so nothing is left running that we did not start.
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


def ensure_installed() -> str | None:
    """Install slurm and munge with apt-get when a binary is missing; None when all are there,
    else why they cannot be."""
    if all(shutil.which(b) for b in SLURM_BINARIES):
        return None
    reason = apt_install(SLURM_PACKAGES)
    if reason is not None:
        return reason
    missing = [b for b in SLURM_BINARIES if shutil.which(b) is None]
    return f"SLURM binaries missing after install: {missing}" if missing else None


def node_names(nodes: int, prefix: str = NODE_PREFIX) -> list[str]:
    """The cluster's node names, in SLURM's order."""
    return [f"{prefix}{i}" for i in range(1, nodes + 1)]


def _resolves(name: str) -> bool:
    try:
        socket.getaddrinfo(name, None)
    except OSError:
        return False
    return True


def ensure_resolvable(names: list[str], hosts: Path = HOSTS) -> list[str]:
    """Add the names that do not resolve to ``hosts`` as 127.0.0.1 aliases (one marked line
    per name, never twice); returns the names added. Left in place by :meth:`Cluster.stop`:
    another cluster on this host may use them."""
    missing = [n for n in names if not _resolves(n)]
    if missing:
        try:
            with hosts.open("a") as fh:
                for name in missing:
                    fh.write(f"127.0.0.1 {name}  {HOSTS_MARK}\n")
        except OSError as exc:
            raise ClusterError(f"node names {missing} do not resolve and {exc}") from exc
    still = [n for n in missing if not _resolves(n)]
    if still:
        raise ClusterError(f"node names do not resolve after adding them to {hosts}: {still}")
    return missing


def _free_ports(count: int) -> int:
    """The first of ``count`` consecutive TCP ports free on 127.0.0.1 (slurm.conf's Port=[a-b]),
    outside the ephemeral range: the daemons bind them seconds later, and port 0 or an outgoing
    connection of any process could take an ephemeral one meanwhile."""
    base = quiet_ports(count)
    if base is None:
        raise ClusterError(f"no {count} consecutive free ports found outside the ephemeral range")
    return base


def client_env(conf: Path, base: dict | None = None) -> dict:
    """An environment for SLURM clients (sbatch, squeue, ...) that talk to this cluster."""
    env = dict(os.environ if base is None else base, SLURM_CONF=str(conf))
    for var in JOB_VARS:
        env.pop(var, None)
    return env


@dataclass
class Cluster:
    """A local SLURM cluster: its directory, config, node names and client environment."""

    root: Path
    conf: Path
    env: dict
    nodes: list[str] = field(default_factory=list)
    hosts_added: list[str] = field(default_factory=list)  # names start_cluster put in /etc/hosts

    @classmethod
    def from_dir(cls, root: Path) -> Cluster:
        """The cluster whose files are in ``root`` (started by :func:`start_cluster`)."""
        root = Path(root).resolve()
        conf = root / "slurm.conf"
        if not conf.is_file():
            raise FileNotFoundError(f"{conf} does not exist: no cluster was started there")
        nodes = sorted((p.name for p in (root / "spool").iterdir()), key=_node_index)
        return cls(root, conf, client_env(conf), nodes)

    def run(self, *cmd: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        """A SLURM client command against this cluster."""
        env = kwargs.pop("env", self.env)
        timeout = kwargs.pop("timeout", 60)
        proc = subprocess.run(
            list(cmd), env=env, capture_output=True, text=True, timeout=timeout, **kwargs
        )
        if check and proc.returncode != 0:
            raise ClusterError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr}")
        return proc

    def job_field(self, job_id: str, key: str) -> str:
        """One ``Key=Value`` field of ``scontrol show job`` ('' when the job is gone)."""
        out = self.run("scontrol", "-o", "show", "job", job_id, check=False).stdout
        for item in out.split():
            name, _, value = item.partition("=")
            if name == key:
                return value
        return ""

    def node_states(self) -> dict[str, str]:
        """Each node's short state (idle, alloc, down, ...)."""
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Wait until every node is idle."""
        deadline = time.time() + timeout
        states: dict[str, str] = {}
        while time.time() < deadline:
            states = self.node_states()
            if sorted(states) == sorted(self.nodes) and set(states.values()) == {"idle"}:
                return
            time.sleep(0.5)
        raise ClusterError(f"nodes not idle after {timeout:.0f}s: {states}\n{self.logs()}")

    def wait_job(self, job_id: str, timeout: float, poll: float = 1.0) -> str:
        """Wait until the job leaves the queue for good; its final state ('' on timeout)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            state = self.job_field(job_id, "JobState")
            if state in FINAL_STATES:
                return state
            time.sleep(poll)
        return ""

    def logs(self, lines: int = 15) -> str:
        """Tails of the daemons' logs, for failure messages."""
        text = []
        for path in sorted((self.root / "log").glob("*.log")):
            tail = "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
            text.append(f"--- {path.name}\n{tail}")
        return "\n".join(text)

    def pid_files(self) -> list[Path]:
        """The daemons' pid files, in the order to stop them (slurmd, slurmctld, munged)."""
        run = self.root / "run"
        return [
            *sorted(run.glob("slurmd-*.pid")),
            run / "slurmctld.pid",
            self.root / "munge" / "munged.pid",
        ]

    def stop(self) -> None:
        """Cancel every job, then stop the daemons (SIGTERM, SIGKILL after 10 s)."""
        if (self.root / "run" / "slurmctld.pid").is_file():
            self.run("scancel", "--full", "--user=root", check=False, timeout=30)
            deadline = time.time() + 30
            while time.time() < deadline:
                if not self.run("squeue", "-h", "-t", "R,CG", check=False).stdout.strip():
                    break
                time.sleep(0.5)
        files = self.pid_files()
        _stop(files[:-2])  # the slurmd daemons
        _stop(files[-2:-1])  # slurmctld
        _stop(files[-1:])  # munged


def _node_index(name: str) -> int:
    digits = name.lstrip("abcdefghijklmnopqrstuvwxyz")
    return int(digits) if digits.isdigit() else 0


def _stop(pid_files: list[Path], timeout: float = 10.0) -> None:
    """SIGTERM the daemons whose pid files we wrote, wait for them, SIGKILL what is left."""
    pids = []
    for pid_file in pid_files:
        try:
            pid = int(pid_file.read_text().strip())
            os.kill(pid, signal.SIGTERM)
            pids.append(pid)
        except (OSError, ValueError):
            pass  # no pid file, or the daemon is gone already
        pid_file.unlink(missing_ok=True)
    deadline = time.time() + timeout
    while pids and time.time() < deadline:
        time.sleep(0.1)
        pids = [pid for pid in pids if _alive(pid)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _alive(pid: int) -> bool:
    """Whether the process runs (a zombie does not; one that is our child is reaped)."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass  # not our child
    try:
        os.kill(pid, 0)
        stat = Path(f"/proc/{pid}/stat").read_text()
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def write_config(
    root: Path, nodes: int, cpus: int, cred_expire: int = 10, prefix: str = NODE_PREFIX
) -> Path:
    """Create the cluster's directories, munge key and slurm.conf under ``root``."""
    for sub in ("munge", "state", "spool", "log", "run"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for name in node_names(nodes, prefix):
        (root / "spool" / name).mkdir(exist_ok=True)
    (root / "munge").chmod(0o755)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    port = _free_ports(nodes)
    conf = root / "slurm.conf"
    conf.write_text(
        SLURM_CONF.format(
            host=socket.gethostname().split(".")[0],
            root=root,
            nodes=nodes,
            prefix=prefix,
            ctld_port=_free_ports(1),
            port=port,
            last_port=port + nodes - 1,
            cpus=cpus,
            cred_expire=cred_expire,
        )
    )
    return conf


def start_cluster(
    root: Path,
    nodes: int = 1,
    cpus: int = 2,
    cred_expire: int = 10,
    timeout: float = 60.0,
) -> Cluster:
    """Write the config under ``root`` and start munged, slurmctld and one slurmd per node;
    returns once every node is idle. ``cred_expire`` is also the requeue delay in seconds.
    Raises ClusterError (after stopping what it started) when a daemon does not come up."""
    if not 1 <= nodes <= 64:
        raise ClusterError(f"nodes must be 1..64, not {nodes}")
    root = Path(root).resolve()
    if (root / "run" / "slurmctld.pid").is_file():
        raise ClusterError(f"{root} already holds a cluster: stop it first")
    names = node_names(nodes)
    added = ensure_resolvable(names)
    conf = write_config(root, nodes, cpus, cred_expire)
    cluster = Cluster(root, conf, client_env(conf), names, added)
    m = root / "munge"
    try:
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
        subprocess.run(["slurmctld", "-f", str(conf)], env=cluster.env, check=True, timeout=30)
        for name in names:
            subprocess.run(
                ["slurmd", "-f", str(conf), "-N", name], env=cluster.env, check=True, timeout=30
            )
        cluster.wait_idle(timeout)
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        logs = cluster.logs()
        cluster.stop()
        raise ClusterError(f"the local SLURM did not start: {exc}\n{logs}") from exc
    return cluster


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

USAGE = """Start or stop a real SLURM cluster of K nodes on this host (munged, slurmctld, K slurmd),
every file in one directory; for rehearsing the sbatch launchers on CPU before GPU hours.

    python tools/local_slurm.py start --dir /tmp/mbslurm --nodes 4 --cpus 8
    export SLURM_CONF=/tmp/mbslurm/slurm.conf          # what `start` and `env` print
    sbatch --nodes=4 --gres=none --cpus-per-task=1 slurm/opus100_1000L.sh
    python tools/local_slurm.py stop --dir /tmp/mbslurm

Needs root (SlurmUser=root, and slurm/munge are installed with apt-get when missing). The node
names (mbn1..mbnK) are added to /etc/hosts as 127.0.0.1 aliases when they do not resolve, and
left there. Errors: one line ``error: ...``, exit 2.
"""
"""The command line's help (``tools/local_slurm.py --help``)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see :data:`USAGE`)."""
    parser = argparse.ArgumentParser(
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(USAGE.split("\n\n")[1:]),
        description=USAGE.split("\n\n")[0],
    )
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


CLUSTER_ENTRIES = ("munge", "state", "spool", "log", "run", "slurm.conf")
"""What :func:`write_config` and the daemons put in a cluster's directory: one holding only
these is an earlier cluster of ours, started again in place."""


def _act(argv: list[str] | None) -> int:
    args = parse_args(argv)
    if args.action == "start":  # before anything is installed or started
        check_scratch_dir(args.dir, "--dir", "local_slurm", CLUSTER_ENTRIES)
        reason = ensure_installed()
        if reason is not None:
            raise ClusterError(f"SLURM cannot be installed: {reason}")
        cluster = start_cluster(args.dir, args.nodes, args.cpus, args.requeue_delay)
        if cluster.hosts_added:
            print(
                f"added to /etc/hosts as 127.0.0.1: {' '.join(cluster.hosts_added)}",
                file=sys.stderr,
            )
        nodes = ", ".join(f"{n}: {s}" for n, s in cluster.node_states().items())
        print(f"started {len(cluster.nodes)} node(s) x {args.cpus} CPUs ({nodes})", file=sys.stderr)
    else:
        cluster = Cluster.from_dir(args.dir)
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


def main(argv: list[str] | None = None) -> int:
    """Parse, act, print the client environment (``tools/local_slurm.py``). An error (SLURM
    missing, a daemon that does not start, no cluster in --dir) is one line and exit 2."""
    return run_main(_act, argv)


if __name__ == "__main__":
    sys.exit(main())
