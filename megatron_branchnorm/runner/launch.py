"""Starting runs from Python: the ranks' rendezvous port, held (:class:`HeldPort`), the
``deepspeed`` launch of the trainer, and a command in its own process group with its output in
a log file, stopped as a whole (launcher and ranks) on an interrupt or a timeout.

No port is chosen, released and bound again later in the ephemeral range: between the two, any
socket of the machine (an outgoing connection, another program's port 0) can take it, and rank
0 then fails with "address already in use". The ranks' port is held listening until rank 0,
which inherits the socket, hosts the rendezvous store on it; a port that cannot be handed over
(the ``deepspeed`` launcher closes inherited sockets; the local SLURM cluster's daemons) is taken
outside the ephemeral range (:func:`quiet_ports`), which port 0 and outgoing connections never
draw from.

Used by the workflows (``megatron_branchnorm.workflows``) and the research harness
(``megatron_branchnorm.experiments``); :func:`rank_env` is the environment srun and
``slurm/common.sh`` give a rank.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from megatron_branchnorm.errors import UserError

CHECKOUT = Path(__file__).resolve().parents[2]
"""The directory that holds this package: in a checkout, the home of slurm/ (the rehearsals
read the launchers there) and the research harness's working directory (the benchmark
compares this tree with an earlier revision's)."""


class LaunchError(UserError, RuntimeError):
    """A run could not be started (a one-line message)."""


RENDEZVOUS_FD = "MBN_RENDEZVOUS_FD"
"""The variable that gives rank 0 the number of an inherited socket that already listens on
MASTER_PORT (:class:`HeldPort`): rank 0 hosts the rendezvous store on it
(``training.environment``) instead of binding the port anew."""


class HeldPort:
    """A TCP port on 127.0.0.1 that the system picked (port 0), bound and listening from the
    moment this object exists: no other socket can take it before the ranks use it. Rank 0
    inherits the socket (:data:`RENDEZVOUS_FD`, :meth:`fileno`) and hosts the rendezvous store
    on it; the other ranks' connections wait in its queue meanwhile. :meth:`close` this
    process's copy once rank 0 has started. A context manager: closed when the block ends."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.port = int(self._sock.getsockname()[1])
        """MASTER_PORT of the ranks."""

    def fileno(self) -> int:
        """The listening socket's file descriptor (rank 0's :data:`RENDEZVOUS_FD`)."""
        return self._sock.fileno()

    def close(self) -> None:
        """Close this process's copy of the socket (idempotent); a rank that inherited it keeps
        it listening."""
        self._sock.close()

    def __enter__(self) -> HeldPort:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
"""torch's variable that makes every rank, rank 0 included, join the rendezvous store at
MASTER_ADDR:MASTER_PORT as a client (``torch.distributed.rendezvous``; torchrun's agent hosts
that store) instead of rank 0 binding the port and starting one there."""


def check_rendezvous_port() -> None:
    """Refuse at once, with one line naming MASTER_PORT, when this process is rank 0 of a run
    with a given MASTER_PORT (the deepspeed launcher, srun through slurm/common.sh, a user's
    environment) and that port cannot be bound on this host: rank 0 binds it for the rendezvous
    only after the imports and DeepSpeed's CPU op (up to a minute). Nothing is checked where
    rank 0 will not bind the port itself: another rank (rank 0's host, the master node, is the
    only one that can tell), a port this project's launcher already holds for rank 0
    (:data:`RENDEZVOUS_FD`, :class:`HeldPort`), a store hosted by torchrun's agent, or no
    MASTER_PORT at all (a single process hosts its own). A malformed variable is left to the
    trainer's environment check, which names it."""
    env = os.environ
    rank = env.get("RANK") or (env.get("SLURM_PROCID") if "MASTER_ADDR" in env else None)
    port = env.get("MASTER_PORT", "").strip()
    if (
        (rank or "0").strip() != "0"
        or RENDEZVOUS_FD in env
        or env.get(AGENT_STORE) == "True"
        or not (port.isdigit() and 0 < int(port) < 65536)
    ):
        return
    sock = socket.socket()
    try:
        # as torch's store binds it: every address, SO_REUSEADDR (a closed run's TIME_WAIT
        # connections do not count, a listening socket does)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("", int(port)))
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            return  # not ours to judge (no IPv4, a privileged port): the rendezvous says
        where = f"{env.get('MASTER_ADDR', '127.0.0.1')}:{port}"
        raise LaunchError(
            f"environment variable MASTER_PORT: {where} is already in use on this host "
            "(another run or program listens there); choose a free port "
            "(deepspeed --master_port P, or MASTER_PORT=P)"
        ) from None
    finally:
        sock.close()


IP_LOCAL_PORT_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
"""Where Linux keeps its ephemeral port range (two numbers: the first and the last port)."""


def ephemeral_ports() -> range:
    """The ports the system hands out for port 0 and outgoing connections
    (:data:`IP_LOCAL_PORT_RANGE`; Linux's default where it cannot be read)."""
    try:
        low, high = (int(n) for n in Path(IP_LOCAL_PORT_RANGE).read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def quiet_ports(count: int, tries: int = 200) -> int | None:
    """The first of ``count`` consecutive TCP ports above 1023 and outside
    :func:`ephemeral_ports` (no port 0 and no outgoing connection takes them meanwhile), each
    bound once on 127.0.0.1 to check that it is free now; chosen at random, again after a port
    in use, up to ``tries`` times; None when none was found. For ports that a program started
    later listens on, where no :class:`HeldPort` can be handed over."""
    taken = ephemeral_ports()
    starts = [*range(1024, taken.start - count + 1), *range(taken.stop, 65536 - count + 1)]
    for _ in range(tries if starts else 0):
        base = random.choice(starts)
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:  # in use (EADDRINUSE): another pick
            continue
        finally:
            for sock in socks:
                sock.close()
    return None


def rank_env(rank: int, world: int, port: int | None) -> dict[str, str]:
    """The environment of one rank, as srun + slurm/common.sh would give it; MASTER_PORT
    ``port`` (None: none, for a world of one, which then hosts its own rendezvous store)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MBN_FAULT"))}
    for key in ("MASTER_PORT", RENDEZVOUS_FD, AGENT_STORE):
        env.pop(key, None)  # this process's own rendezvous is not the rank's
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        PYTHONUNBUFFERED="1",
    )
    if port is not None:
        env["MASTER_PORT"] = str(port)
    return env


WORKFLOWS = (
    "demo",
    "rehearse",
    "gpu_check",
    "local_slurm",
    "rehearse_slurm",
    "rehearse_node_loss",
)
"""The user commands whose module is ``megatron_branchnorm.workflows.<name>``; every other one
(but ``train``) is ``megatron_branchnorm.commands.<name>``. The registry of front doors
(``commands.FRONT_DOORS``) sits in a room above this one (docs/design.md §9), so these names
are kept here and tests/core/test_front_doors.py checks them, and :func:`tool_command` for
every user command, against it."""


def tool_command(name: str) -> list[str]:
    """The command line that runs the user command ``name`` (``commands.COMMANDS``) with this
    interpreter: ``python -m megatron_branchnorm.{commands,workflows}.<name>``."""
    if name == "train":
        return [sys.executable, "-m", "megatron_branchnorm.train"]
    package = "workflows" if name in WORKFLOWS else "commands"
    return [sys.executable, "-m", f"megatron_branchnorm.{package}.{name}"]


def deepspeed_command(ranks: int, args: list[str]) -> tuple[list[str], dict[str, str]]:
    """``deepspeed --num_gpus R --master_port P --module megatron_branchnorm.train ARGS`` and
    the environment to run it in (this interpreter's bin/ first on PATH, so the ranks run this
    Python). P is outside the ephemeral range (:func:`quiet_ports`): the launcher closes every
    inherited socket, so rank 0 binds P itself, seconds later. Raises LaunchError when no
    deepspeed launcher is installed or no such port is free."""
    venv_bin = Path(sys.executable).parent
    launcher = venv_bin / "deepspeed"
    if not launcher.exists():
        found = shutil.which("deepspeed")
        if found is None:
            raise LaunchError("the deepspeed launcher is not installed (pip install deepspeed)")
        launcher = Path(found)
    port = quiet_ports(1)
    if port is None:
        raise LaunchError("no free TCP port outside the ephemeral range for the rendezvous")
    env = dict(os.environ)
    for key in (RENDEZVOUS_FD, AGENT_STORE):
        env.pop(key, None)  # this process's own rendezvous is not the ranks'
    env["PATH"] = f"{venv_bin}{os.pathsep}{env.get('PATH', '')}"
    cmd = [str(launcher), "--num_gpus", str(ranks), "--master_port", str(port)]
    return [*cmd, "--module", "megatron_branchnorm.train", *args], env


def stop_group(proc: subprocess.Popen, grace_s: float = 40.0) -> None:
    """SIGTERM ``proc``'s process group (ranks checkpoint and exit), SIGKILL it after grace."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


@contextmanager
def logged_group(
    cmd: list[str],
    log: Path,
    *,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    mode: str = "a",
) -> Iterator[subprocess.Popen]:
    """Start ``cmd`` in its own process group with its output in ``log`` (after a ``$ cmd``
    line; ``mode`` "a" appends, "w" starts the file afresh) and yield the process; an
    exception in the block (an interrupt, a timeout) stops the whole group before it
    propagates, so the launcher *and* the ranks it started end."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, mode, encoding="utf-8") as fh:
        fh.write(f"$ {' '.join(cmd)}\n")
        fh.flush()
        proc = subprocess.Popen(
            cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=cwd, env=env, start_new_session=True
        )
        try:
            yield proc
        except BaseException:
            stop_group(proc)
            raise
