"""Stop signals and the launcher watch of a training rank, from its first instruction.

``train.py`` calls :func:`install` before anything else. A rank then lives in two phases.

**Starting** (imports, DeepSpeed's CPU op build, the rendezvous, the stage and DeepSpeed's
engine, the resume): nothing has been trained, so there is nothing to save, and no training
loop yet to read a recorded signal. SIGTERM ends the process at once with one line and the
requeue code (75, as a stop before the first update always did); SIGINT (Ctrl-C) with
``interrupted (Ctrl-C): ...`` and 130. The main thread may be inside C++ for minutes (gloo's
TCPStore connect in the rendezvous, a collective waiting for a hung peer), where a Python
handler only runs once control returns to Python, so a watcher thread does it: the signal's
C-level handler writes its number to :func:`signal.set_wakeup_fd`'s pipe, which wakes the
watcher whatever the main thread is doing. A SIGINT that arrives while imports defer it
(``cli.interrupts_deferred``) is acted on when they end. SIGUSR1, SLURM's advance warning
(``--signal=USR1@LEAD``, ``scancel --signal=USR1``), is only recorded: it comes with time to
spare, and the ranks agree on it before the first update and exit 75 together even when it
reached one rank only (tests/faults/test_signals.py).

**Training** (from :func:`training_started`, which the trainer calls right before its first
collective stop check): SIGUSR1 and SIGTERM are recorded, and the trainer acts on them at its
next collective check: before the first update it exits with the requeue code (nothing new to
save), after an update it saves and exits. SIGINT raises KeyboardInterrupt again.

A rank started by DeepSpeed's launcher also stops when that launcher goes: ``timeout``,
``kill``, a container stop or a scheduler other than SLURM ends a job by signalling the
``deepspeed`` command alone, which exits without passing the signal on, and its
``deepspeed.launcher.launch`` child and the ranks would train on, holding ``run.lock``
(docs/reliability.md). At its first instruction the rank checks the chain above it: a rank
whose environment says the launcher started it (``CROSS_RANK``/``CROSS_SIZE``, which only
``deepspeed.launcher.launch`` sets) but with no launcher among its parents, or a launcher
already adopted by another session's process (the ``deepspeed`` command that started it is
gone), stops there. Then the watcher polls, on every whole second of the clock (the ranks of a
node see a break together), that every process of the chain (this rank's parent, up to the
launcher and the launcher's parent) still has the parent it had at start; when one is gone the
rank stops at once while starting, and records SIGTERM once training, so it checkpoints and
exits 75.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from megatron_branchnorm.training.exit_codes import REQUEUE_EXIT_CODE

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
LAUNCHER_MODULE = "deepspeed.launcher.launch"
"""The per-node launcher whose children the ranks are (``deepspeed`` starts one per node)."""
LAUNCHER_ENV = ("CROSS_RANK", "CROSS_SIZE")
"""Set by ``deepspeed.launcher.launch`` in the environment of the ranks it starts, and by
nothing else: a rank that has them was started by that launcher."""
MAX_WRAPPERS = 3
"""Processes allowed between a rank and its launcher (``deepspeed --no_python`` runs a wrapper
script; ``numactl`` core binding execs, so it adds none)."""
EXIT_INTERRUPTED = 130
INTERRUPTED_LINE = "interrupted (Ctrl-C): nothing half-written was kept"
"""Ctrl-C's line and exit code, as ``cli.run_main`` prints them (this module imports nothing
of the package but the exit codes: it runs before anything else)."""
POLL_S = 1.0

_received = 0
_interrupted = False
_starting = True
_installed = False
_took_sigint = False
_phase = threading.Lock()  # held while the phase changes, and by a start-up stop for good
_final = threading.Lock()  # taken for good by the one stop_now that ends the process
_cleanups: list[Callable[[], None]] = []
_watcher: threading.Thread | None = None


def _record(signum: int, frame) -> None:  # noqa: ARG001 - signal handler signature
    global _received, _interrupted
    if signum == signal.SIGINT:
        _interrupted = True
    else:
        _received = signum


def _rank() -> str:
    env = os.environ
    return env.get("RANK") or env.get("SLURM_PROCID") or "0"


def install() -> None:
    """Handle the stop signals as the module docstring says from now on, check this rank's
    launcher chain and start the watcher (idempotent; from the main thread)."""
    global _installed, _took_sigint
    # The handlers every time (a no-op when they are ours): a caller that put its own back
    # since (an in-process test's clean-up) would otherwise leave SIGUSR1's default action,
    # which kills the process, behind a module that believes itself installed.
    for sig in STOP_SIGNALS:
        signal.signal(sig, _record)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not SIG_IGN (nohup, &)
        signal.signal(signal.SIGINT, _record)
        _took_sigint = True
    if _installed:
        return
    _installed = True
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    chain = _chain_at_start()
    _start_watcher(read_end, chain)
    stop_if_signalled()  # one that came before the wakeup pipe existed


def training_started() -> None:
    """The training loop runs: from now on SIGTERM is recorded for the trainer's collective
    check, SIGINT raises KeyboardInterrupt, and a launcher gone records SIGTERM (module
    docstring). A Ctrl-C recorded while starting is raised here. Call from the main thread."""
    global _starting
    with _phase:
        if not _starting:
            return
        _starting = False
        _cleanups.clear()
        if _took_sigint:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    if _interrupted:
        raise KeyboardInterrupt


def on_stop(cleanup: Callable[[], None]) -> None:
    """Run ``cleanup`` (release ``run.lock``) when a stop while starting ends the process."""
    _cleanups.append(cleanup)


def stop_now(line: str, code: int) -> NoReturn:
    """End the process at once: ``line`` on stderr, the :func:`on_stop` clean-ups, exit
    ``code``. From any thread; the first caller ends the process and a later one waits for
    that, so a process prints one such line."""
    _final.acquire()
    try:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # closed, or a reader gone
                stream.flush()
        os.write(2, f"{line}\n".encode())
        for cleanup in _cleanups:
            cleanup()
    finally:
        os._exit(code)


def stop_if_signalled() -> None:
    """While starting, when SIGTERM or SIGINT has come: end the process as the watcher does
    (an error it caused, such as a build interrupted by the same SIGTERM, then is that stop
    and not a second message); otherwise return."""
    if _interrupted:
        _stop_while_starting(signal.SIGINT)
    if _received == signal.SIGTERM:
        _stop_while_starting(signal.SIGTERM)


def _stop_while_starting(signum: int) -> None:
    """End the process for ``signum`` (SIGTERM or SIGINT) if the rank is still starting."""
    with _phase:
        if not _starting:
            return
        if signum == signal.SIGINT:
            stop_now(INTERRUPTED_LINE, EXIT_INTERRUPTED)
        stop_now(
            f"rank {_rank()}: SIGTERM while starting, before the first update: nothing to "
            f"save, exiting {REQUEUE_EXIT_CODE}",
            REQUEUE_EXIT_CODE,
        )


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state, ppid, pgrp, session,
    ...); None: gone, or no ``/proc``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()  # "pid (comm) state ppid ...": comm may hold ")"


def _parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` (None: gone, or no ``/proc``)."""
    fields = _stat(pid)
    return None if fields is None else int(fields[1])


def _session_of(pid: int) -> int | None:
    fields = _stat(pid)
    return None if fields is None else int(fields[3])


def _is_launcher(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return LAUNCHER_MODULE.encode() in argv


def _adopted(pid: int, parent: int) -> bool:
    """Whether ``parent`` adopted ``pid`` (the one that started it is gone): a child stays in
    its parent's session unless it leads its own, and init or a subreaper that adopts an orphan
    is in another session."""
    session, parent_session = _session_of(pid), _session_of(parent)
    if session is None or parent_session is None:
        return False
    return session != parent_session and session != pid


def _chain_at_start() -> list[int] | None:
    """The processes to watch, from this rank's parent up to its launcher's parent; None when
    DeepSpeed's launcher did not start this rank (or there is no ``/proc``). Ends the process
    (:func:`stop_now`) when the chain is already broken."""
    if _stat(os.getpid()) is None:
        return None
    launched = all(name in os.environ for name in LAUNCHER_ENV)
    chain: list[int] = []
    pid = os.getppid()
    while pid >= 1 and len(chain) <= MAX_WRAPPERS:
        chain.append(pid)
        if _is_launcher(pid):
            runner = _parent_of(pid)
            if runner is None:
                _gone(f"DeepSpeed's launcher (pid {pid}) ended")
                return None
            if _adopted(pid, runner):
                _gone(
                    f"the deepspeed command that started this node ended (its launcher, pid "
                    f"{pid}, was adopted by pid {runner})"
                )
            return [*chain, runner]
        if pid == 1:
            break
        pid = _parent_of(pid) or 0
    if not launched:
        return None
    _gone(
        f"DeepSpeed's launcher ended before this rank started ({'/'.join(LAUNCHER_ENV)} are "
        f"set, but no {LAUNCHER_MODULE} is among its parents; its parent is pid {os.getppid()})"
    )
    return None


def _chain_broken(chain: list[int]) -> str | None:
    """What ended, when a process of ``chain`` no longer has the parent it had at start."""
    for index, pid in enumerate(chain):
        parent = os.getppid() if index == 0 else _parent_of(chain[index - 1])
        if parent == pid:
            continue
        if index == len(chain) - 1:
            return f"the deepspeed command (pid {pid}) that started this node ended"
        return f"DeepSpeed's launcher (pid {chain[-2]}) ended"
    return None


def _gone(what: str) -> None:
    """The launcher chain broke: while starting, end the process; once training, record
    SIGTERM (the trainer checkpoints and exits 75)."""
    global _received
    with _phase:
        if _starting:
            stop_now(
                f"rank {_rank()}: {what}: stopping before the first update (nothing to save), "
                f"exiting {REQUEUE_EXIT_CODE}",
                REQUEUE_EXIT_CODE,
            )
    print(
        f"rank {_rank()}: {what}: stopping as on SIGTERM (checkpoint, exit {REQUEUE_EXIT_CODE})",
        file=sys.stderr,
        flush=True,
    )
    _received = signal.SIGTERM


def _start_watcher(wakeup: int, chain: list[int] | None, poll_s: float = POLL_S) -> None:
    """The daemon thread that acts on stop signals while starting (woken through ``wakeup``)
    and on a broken launcher ``chain`` (polled every ``poll_s``)."""
    global _watcher

    def watch() -> None:
        watched = chain
        # signals are the main thread's: this thread never takes one (a Ctrl-C held back
        # while the main thread imports must wait for it, cli.interrupts_deferred)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, *STOP_SIGNALS})
        while True:
            # polls on the clock's whole periods: the ranks of a node see a break together
            timeout = poll_s - time.time() % poll_s if watched else None
            ready, _, _ = select.select([wakeup], [], [], timeout)
            if ready:
                for signum in os.read(wakeup, 64):
                    if signum in (signal.SIGTERM, signal.SIGINT):
                        _stop_while_starting(signum)
            gone = _chain_broken(watched) if watched else None
            if gone is not None:
                watched = None
                _gone(gone)

    _watcher = threading.Thread(target=watch, name="stop-watch", daemon=True)
    _watcher.start()


def received() -> int:
    """The last stop signal received (0 when none)."""
    return _received


def clear() -> None:
    """Forget a recorded signal (a new Trainer in the same process starts clean)."""
    global _received
    _received = 0
