"""Preprocessing's worker processes: a pool whose workers ignore Ctrl-C, die with their parent
and return results in input order, with a bounded number of tasks in flight.

Preprocessing's passes (data/preprocess.py, data/clean_pass.py, data/encode_pass.py) run their
chunks here. The guarantees the passes rely on:

- Ctrl-C in a terminal signals the whole process group: the workers ignore it
  (:func:`ignore_sigint`), the parent handles it (kills the pool, removes its temporary
  directory), so an interrupt prints one line, not a traceback per worker;
- a worker ends (SIGKILL) when its parent ends, however it ends (:func:`die_with_parent`,
  Linux ``PR_SET_PDEATHSIG``): a run killed by SIGKILL leaves no SentencePiece trainer or
  encoder behind it;
- after an error or Ctrl-C the pool is killed at once, never through ``Pool.terminate``, which
  could wait forever for a queue lock (:func:`kill_pool`);
- :func:`in_order` yields results in the order of the tasks, so a pass's output does not depend
  on the number of workers, and reads its tasks lazily, so memory stays bounded.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import multiprocessing.pool
import os
import signal
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from megatron_branchnorm.data.phase_stats import PhaseStats

IN_FLIGHT_PER_WORKER = 4
"""Tasks submitted, per worker, ahead of the result :func:`in_order` waits for."""
PR_SET_PDEATHSIG = 1
"""prctl(2) option: the signal this process gets when its parent ends (Linux)."""


def ignore_sigint() -> None:
    """A pool worker: Ctrl-C in a terminal signals the whole process group; the parent
    handles it (terminates the pool, removes its temporary directory), workers ignore it
    instead of each printing a traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def die_with_parent(parent: int) -> None:
    """Make this forked worker end (SIGKILL) when its parent ``parent`` ends, however it
    ends: a run killed by SIGKILL must not leave SentencePiece training, or encoding, on
    behind it. Linux (prctl ``PR_SET_PDEATHSIG``); elsewhere nothing is done."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(
        ctypes.c_int(PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGKILL), *[ctypes.c_ulong(0)] * 3
    )
    if os.getppid() != parent:  # the parent ended before the request was made
        os._exit(1)


def _start_worker(parent: int, initializer: Callable[..., None], initargs: tuple) -> None:
    """A pool worker's start: it ignores Ctrl-C at once, dies with ``parent``, then runs
    ``initializer(*initargs)``."""
    ignore_sigint()
    die_with_parent(parent)
    initializer(*initargs)


def start_pool(
    processes: int,
    stats: PhaseStats,
    initializer: Callable[..., None] = ignore_sigint,
    initargs: tuple = (),
) -> mp.pool.Pool:
    """Worker processes, forked where the platform can (the parent is small when it forks:
    no phase keeps the corpus in memory), each ending with this process
    (:func:`die_with_parent`) and started by ``initializer(*initargs)``."""
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    start = (os.getpid(), initializer, initargs)
    with stats.paused():
        return mp.get_context(method).Pool(processes, initializer=_start_worker, initargs=start)


@contextmanager
def worker_pool(
    n: int,
    stats: PhaseStats,
    initializer: Callable[..., None] = ignore_sigint,
    initargs=(),
    inline_one: bool = True,
) -> Iterator[mp.pool.Pool | None]:
    """A pool of ``n`` workers (None for one when ``inline_one``: the work runs in this
    process), terminated without waiting for queued work when the body fails (Ctrl-C, an
    error)."""
    if n <= 1 and inline_one:
        yield None
        return
    pool = start_pool(n, stats, initializer, initargs)
    try:
        yield pool
    except BaseException:
        kill_pool(pool)
        raise
    pool.close()
    pool.join()


def kill_pool(pool: mp.pool.Pool) -> None:
    """Stop ``pool`` at once, after an error or Ctrl-C.

    Not ``Pool.terminate``: it first takes the task queue's read lock, which an idle worker
    holds while it waits for a task, and waits there until the pool's threads have told every
    worker to stop; stopped while they do (a Ctrl-C during encoding, about 1 run in 10 in a
    loop here), it waited forever (CPython 3.11, ``multiprocessing/pool.py``). Instead: no
    more workers are started, every worker is killed and reaped, and the pool's exit handler,
    which would wait for that lock, is dropped."""
    handler = getattr(pool, "_worker_handler", None)
    if handler is None or not hasattr(pool, "_terminate"):  # another Pool than 3.11's
        pool.terminate()
        pool.join()
        return
    handler._state = mp.pool.TERMINATE  # the thread that replaces exited workers stops
    pool._change_notifier.put(None)
    handler.join()
    for proc in pool._pool:
        if proc.exitcode is None:
            proc.kill()
    for proc in pool._pool:
        proc.join()
    pool._terminate.cancel()


def in_order(
    fn: Callable[[Any], Any],
    tasks: Iterable[tuple[Any, Any]],
    pool: mp.pool.Pool | None,
    workers: int,
) -> Iterator[tuple[Any, Any]]:
    """``(meta, fn(arg))`` for each ``(meta, arg)`` of ``tasks``, in order; ``arg`` None is a
    marker passed through as ``(meta, None)``. With a pool at most a few tasks per worker are
    in flight, so neither the tasks (read lazily) nor the results pile up in memory."""
    if pool is None:
        for meta, arg in tasks:
            yield meta, None if arg is None else fn(arg)
        return
    window = IN_FLIGHT_PER_WORKER * workers
    pending: deque = deque()
    for meta, arg in tasks:
        pending.append((meta, None if arg is None else pool.apply_async(fn, (arg,))))
        while pending and (len(pending) > window or pending[0][1] is None):
            meta0, res = pending.popleft()
            yield meta0, None if res is None else res.get()
    while pending:
        meta0, res = pending.popleft()
        yield meta0, None if res is None else res.get()
