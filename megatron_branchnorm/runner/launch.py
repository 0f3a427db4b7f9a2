"""Starting runs from Python: a free rendezvous port, the ``deepspeed`` launch of the trainer,
and a command in its own process group with its output in a log file, stopped as a whole
(launcher and ranks) on an interrupt or a timeout.

Used by the workflows (``megatron_branchnorm.workflows``) and the research harness
(``megatron_branchnorm.experiments``); :func:`rank_env` is the environment srun and
``slurm/common.sh`` give a rank.
"""

from __future__ import annotations

import os
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


def free_port() -> int:
    """A TCP port free on localhost right now (for the ranks' rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """The environment of one rank, as srun + slurm/common.sh would give it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MBN_FAULT"))}
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        PYTHONUNBUFFERED="1",
    )
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
    Python). Raises LaunchError when no deepspeed launcher is installed."""
    venv_bin = Path(sys.executable).parent
    launcher = venv_bin / "deepspeed"
    if not launcher.exists():
        found = shutil.which("deepspeed")
        if found is None:
            raise LaunchError("the deepspeed launcher is not installed (pip install deepspeed)")
        launcher = Path(found)
    env = dict(os.environ)
    env["PATH"] = f"{venv_bin}{os.pathsep}{env.get('PATH', '')}"
    cmd = [str(launcher), "--num_gpus", str(ranks), "--master_port", str(free_port())]
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
