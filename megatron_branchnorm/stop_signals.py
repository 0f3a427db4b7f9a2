"""SIGUSR1/SIGTERM (SLURM preemption, ``scancel --signal=USR1``) recorded from process start.

SLURM's ``--signal=USR1@LEAD`` can fire while the ranks are still importing torch and
DeepSpeed or building a 1000-layer stage (minutes). SIGUSR1's default action terminates the
process (exit 138) and the job is not requeued. ``train.py`` therefore calls :func:`install`
before anything else; the handler only records the signal, and the trainer acts on it at its
next collective check: before the first update (exit with the requeue code; nothing to save
when no update ran since the last checkpoint) or after the update in progress (save, exit).

A rank started by DeepSpeed's launcher also stops so when that launcher goes: ``timeout``,
``kill``, a container stop or a scheduler other than SLURM ends a job by signalling the
``deepspeed`` command alone, which exits without passing the signal on, and its
``deepspeed.launcher.launch`` child and the ranks would train on, holding ``run.lock``
(docs/reliability.md). :func:`watch_launcher` polls, once a second, that this rank's parent
(``deepspeed.launcher.launch``) and that process's own parent are the processes they were
at start; when either is gone it records SIGTERM, so the rank checkpoints and exits 75.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
LAUNCHER_MODULE = "deepspeed.launcher.launch"
"""The per-node launcher whose children the ranks are (``deepspeed`` starts one per node)."""
POLL_S = 1.0
_received = 0
_watcher: threading.Thread | None = None


def _record(signum: int, frame) -> None:  # noqa: ARG001 - signal handler signature
    global _received
    _received = signum


def install() -> None:
    """Record SIGUSR1/SIGTERM from now on instead of dying, and watch DeepSpeed's launcher
    when it started this process (idempotent)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _record)
    watch_launcher()


def _parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` from ``/proc`` (None: gone, or no ``/proc``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses
    return int(stat.rpartition(")")[2].split()[1])


def _is_launcher(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return LAUNCHER_MODULE.encode() in argv


def watch_launcher(poll_s: float = POLL_S) -> bool:
    """Start the daemon thread that records SIGTERM when this rank's launcher chain breaks
    (module docstring); True when it watches. Only under ``deepspeed.launcher.launch`` on a
    system with ``/proc``; a second call does nothing."""
    global _watcher
    if _watcher is not None:
        return True
    launcher = os.getppid()
    runner = _parent_of(launcher)
    if runner is None or not _is_launcher(launcher):
        return False

    def watch() -> None:
        global _received
        # signals are the main thread's: this thread never takes one (a Ctrl-C held back
        # while the main thread imports must wait for it, cli.interrupts_deferred)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, *STOP_SIGNALS})
        while True:
            threading.Event().wait(poll_s)
            if os.getppid() != launcher:
                gone = f"DeepSpeed's launcher (pid {launcher}) ended"
            elif _parent_of(launcher) != runner:
                gone = f"the deepspeed command (pid {runner}) that started this node ended"
            else:
                continue
            print(
                f"rank {os.environ.get('RANK', '?')}: {gone}: stopping as on SIGTERM "
                "(checkpoint, exit 75)",
                file=sys.stderr,
                flush=True,
            )
            _received = signal.SIGTERM
            return

    _watcher = threading.Thread(target=watch, name="launcher-watch", daemon=True)
    _watcher.start()
    return True


def received() -> int:
    """The last stop signal received (0 when none)."""
    return _received


def clear() -> None:
    """Forget a recorded signal (a new Trainer in the same process starts clean)."""
    global _received
    _received = 0
