"""Starting the ranks of one run on this machine, one process per rank, as ``srun`` would.

Every rank is a plain ``python -m megatron_branchnorm.train`` (or another module, or a script)
with RANK/WORLD_SIZE/LOCAL_RANK/... in its environment (:func:`rank_env`) and a rendezvous port
of its own run, held from its choice on (:class:`HeldPort`: rank 0 inherits the listening
socket and hosts the store on it), its output in ``rank<R>.log``. The rehearsal
(``workflows/rehearse_runs.py``), the benchmark's train.py runs (``experiments/bench_train.py``),
the fault runs (``experiments/fault_runs.py``), the GPU check's train.py runs
(``workflows/gpu_check.py``), ``experiments/bench_pipeline_shapes.py`` and the tests'
multi-rank harnesses start their ranks here (not the launch counter's children: a world of one
picks its own port, ``experiments/launches._child_env`` says why); the deepspeed launcher's single process group is
:func:`megatron_branchnorm.runner.launch.logged_group`.

:class:`Ranks` is the group: reaped without blocking (:meth:`Ranks.poll`, which keeps each
rank's ``ru_maxrss``), sampled for its peak resident set (:meth:`Ranks.sample_peaks`, VmHWM
from ``/proc``), signalled, waited for with a deadline and killed together; used as a context
manager it kills the ranks still running when the block ends (an interrupt, a timeout, a
failed check) and removes the shared-memory segments DeepSpeed's CPU all-reduce leaves behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from megatron_branchnorm.runner.launch import RENDEZVOUS_FD, HeldPort, rank_env

TRAINER = "megatron_branchnorm.train"
"""The module a rank runs unless told otherwise."""


def peak_rss_mb(pid: int) -> float | None:
    """VmHWM (peak resident set) of a live process, MiB; None once it is gone. Unlike the
    ``ru_maxrss`` that reaping it gives, it counts the process alone (not the compilers
    DeepSpeed may start as its children)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError):
        return None
    return None


def remove_shm_leftovers(port: int) -> None:
    """Unlink this user's DeepSpeed shared-memory all-reduce segments of the run whose
    rendezvous is ``port`` (``deepspeed_allreduce_buffer_<uid>_<addr>_<port>_*``, ~66 MB each):
    ranks killed before ``release_shm_workspace`` leave them in /dev/shm."""
    pattern = f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"
    for path in Path("/dev/shm").glob(pattern):
        path.unlink(missing_ok=True)


def wait_ranks(procs: list[subprocess.Popen], timeout: float = 300) -> list[int]:
    """Exit codes of ``procs``; ranks still alive ``timeout`` seconds from now are killed
    (code None is never returned)."""
    deadline = time.time() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.time())))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
    return codes


class Ranks:
    """The processes of one run's ranks (:func:`start_ranks`); a sequence of their Popen
    objects, rank order."""

    def __init__(self, world: int, argv: list[str], port: int, logs: list[Path]) -> None:
        self.procs: list[subprocess.Popen] = []
        """The ranks started so far, rank order (all ``world`` once :func:`start_ranks` returns)."""
        self.argv = argv
        """The command line every rank runs (its interpreter first)."""
        self.port = port
        """The rendezvous port (MASTER_PORT) of the run."""
        self.logs = logs
        """Each rank's log file (rank 0's: where its reader writes it, with ``pipe_rank0``);
        none when the ranks' output is piped (:func:`start_ranks` without a ``log_dir``)."""
        self.maxrss_mb: list[float | None] = [None] * world
        """ru_maxrss of each rank :meth:`poll` reaped, MiB (its waited-for children included)."""
        self.peak_rss_mb: list[float | None] = [None] * world
        """The last VmHWM :meth:`sample_peaks` read of each rank, MiB."""

    @property
    def codes(self) -> list[int | None]:
        """Exit codes of the ranks reaped so far (:meth:`poll`, :meth:`wait`); None while
        running."""
        return [p.returncode for p in self.procs]

    def __len__(self) -> int:
        return len(self.procs)

    def __iter__(self) -> Iterator[subprocess.Popen]:
        return iter(self.procs)

    def __getitem__(self, rank: int) -> subprocess.Popen:
        return self.procs[rank]

    def poll(self) -> list[int | None]:
        """Reap, without blocking, every rank that has exited (``os.wait4``, so its
        ``ru_maxrss`` is kept); returns the exit codes so far, None for a rank still running."""
        for i, p in enumerate(self.procs):
            if p.returncode is None:
                pid, status, usage = os.wait4(p.pid, os.WNOHANG)
                if pid:
                    p.returncode = os.waitstatus_to_exitcode(status)
                    self.maxrss_mb[i] = usage.ru_maxrss / 1024.0
        return self.codes

    def sample_peaks(self) -> None:
        """Read the VmHWM of every rank not yet reaped into :attr:`peak_rss_mb` (call before
        :meth:`poll`: a rank's last reading is taken while it still exists)."""
        for i, p in enumerate(self.procs):
            if p.returncode is None:
                self.peak_rss_mb[i] = peak_rss_mb(p.pid) or self.peak_rss_mb[i]

    def send(self, sig: int) -> None:
        """Send ``sig`` to every rank still running."""
        for p in self.procs:
            if p.returncode is None:
                try:
                    os.kill(p.pid, sig)
                except ProcessLookupError:
                    pass

    def wait(self, timeout: float = 300) -> list[int]:
        """Exit codes of every rank; ranks alive after ``timeout`` seconds are killed."""
        return wait_ranks(self.procs, timeout)

    def kill(self) -> None:
        """SIGKILL every rank still running and reap it."""
        self.send(signal.SIGKILL)
        for p in self.procs:
            if p.returncode is None:
                p.wait()

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc: object) -> None:
        """Kill the ranks still running (the block ended early) and remove the run's
        shared-memory leftovers."""
        self.kill()
        remove_shm_leftovers(self.port)


def start_ranks(
    world: int,
    args: list[str],
    log_dir: Path | None,
    *,
    module: str | None = TRAINER,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    mode: str = "w",
    pipe_rank0: bool = False,
    log_prefix: str = "",
) -> Ranks:
    """Start ``world`` ranks of ``python -m MODULE ARGS`` (``module`` None: ``python ARGS``, a
    script and its arguments) on a fresh rendezvous port (:class:`HeldPort`, handed to rank 0
    as :data:`RENDEZVOUS_FD`), each with :func:`rank_env` plus
    ``env`` (added last: it may override) and its output in ``log_dir/rank<R>.log`` (``mode``
    "w" starts it afresh, "a" appends; ``log_prefix`` goes before the name, for the logs of
    several runs in one directory). ``pipe_rank0``: rank 0's output (text, undecodable bytes
    replaced) is a pipe, ``ranks[0].stdout``, for the caller to read and log. ``log_dir``
    None: no logs; every rank's stdout and stderr are pipes of their own (text, undecodable
    bytes replaced), for the caller to read (``Popen.communicate``), where a check needs the
    two streams apart.

    The ranks run in this process group (a Ctrl-C reaches them too); a rank that cannot be
    started kills those already started."""
    argv = [sys.executable, *(["-m", module] if module else []), *args]
    held = HeldPort()
    port = held.port
    logs: list[Path] = []
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        logs = [log_dir / f"{log_prefix}rank{r}.log" for r in range(world)]
    group = Ranks(world, argv, port, logs)
    try:
        for rank in range(world):
            rank_environment = {**rank_env(rank, world, port), **(env or {})}
            fds = (held.fileno(),) if rank == 0 else ()  # rank 0 hosts the store on it
            if fds:
                rank_environment[RENDEZVOUS_FD] = str(fds[0])
            if log_dir is None or (rank == 0 and pipe_rank0):
                proc = subprocess.Popen(
                    argv,
                    env=rank_environment,
                    cwd=cwd,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE if log_dir is None else subprocess.STDOUT,
                    text=True,
                    errors="replace",
                    pass_fds=fds,
                )
            else:
                with open(logs[rank], mode, encoding="utf-8") as log:  # the rank has its own fd
                    proc = subprocess.Popen(
                        argv,
                        env=rank_environment,
                        cwd=cwd,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        pass_fds=fds,
                    )
            group.procs.append(proc)
    except BaseException:
        group.kill()
        raise
    finally:
        held.close()  # rank 0 holds the port now
    return group
