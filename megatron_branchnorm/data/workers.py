"""Preprocessing's worker processes: a pool whose workers ignore Ctrl-C, die with their parent,
return results in input order, with a bounded number of tasks in flight, and whose death ends
the run with one line instead of a wait forever.

Preprocessing's passes (data/preprocess.py, data/clean_pass.py, data/encode_pass.py) run their
chunks here. The guarantees the passes rely on:

- Ctrl-C in a terminal signals the whole process group: the workers ignore it
  (:func:`ignore_sigint`), the parent handles it (kills the pool, removes its temporary
  directory), so an interrupt prints one line, not a traceback per worker;
- a worker ends (SIGKILL) when its parent ends, however it ends (:func:`die_with_parent`,
  Linux ``PR_SET_PDEATHSIG``): a run killed by SIGKILL leaves no SentencePiece trainer or
  encoder behind it;
- a worker that dies (SIGKILL, the OOM killer, a C++ ``std::bad_alloc`` abort) ends the run
  with a :class:`WorkerLost` naming it, what it was doing and how it ended: a
  ``multiprocessing`` pool would start a replacement and wait forever for the lost task, so
  :class:`WorkerPool` waits on its workers' exits together with its results;
- after an error or Ctrl-C the pool is killed at once, never through ``Pool.terminate``, which
  could wait forever for a queue lock (:func:`kill_pool`), and is left terminated (a pool left
  "running" warns, and at exit may print a traceback, when it is collected);
- :func:`in_order` yields results in the order of the tasks, so a pass's output does not depend
  on the number of workers, and reads its tasks lazily, so memory stays bounded.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.pool
import os
import signal
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from megatron_branchnorm.data.phase_stats import PhaseStats
from megatron_branchnorm.formats.data_dir import DataError

IN_FLIGHT_PER_WORKER = 4
"""Tasks submitted, per worker, ahead of the result :func:`in_order` waits for."""
PR_SET_PDEATHSIG = 1
"""prctl(2) option: the signal this process gets when its parent ends (Linux)."""
STARTING, IDLE = -1, -2
"""A worker's entry in the task table before its initializer returned, and between tasks."""


class WorkerLost(DataError):
    """A worker ended while the run needed it (killed: SIGKILL, the OOM killer; aborted: a
    C++ ``std::bad_alloc`` under a memory limit): one line naming it, its task and its end."""


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


_row: tuple[Any, int] | None = None
"""In a worker: the pool's task table and this worker's row in it (None: no row)."""


def _start_worker(
    parent: int, table: Any, rows: Any, initializer: Callable[..., None], initargs: tuple
) -> None:
    """A pool worker's start: it ignores Ctrl-C at once, dies with ``parent``, takes a row of
    the task ``table`` (the next of ``rows``), then runs ``initializer(*initargs)``."""
    global _row
    ignore_sigint()
    die_with_parent(parent)
    with rows.get_lock():
        row = rows.value
        rows.value += 1
    if row < len(table) // 2:  # a replacement for a dead worker has none
        table[2 * row], table[2 * row + 1] = os.getpid(), STARTING
        _row = (table, row)
    initializer(*initargs)
    if _row is not None:
        table[2 * row + 1] = IDLE


def _run_task(fn: Callable[..., Any], number: int, args: tuple) -> Any:
    """``fn(*args)`` in a worker, with the task's ``number`` in the worker's row meanwhile."""
    if _row is not None:
        _row[0][2 * _row[1] + 1] = number
    try:
        return fn(*args)
    finally:
        if _row is not None:
            _row[0][2 * _row[1] + 1] = IDLE


def _how_it_ended(code: int | None) -> str:
    """How a worker with exit code ``code`` ended, in words."""
    if code is None:
        return "ended"
    if code >= 0:
        return f"exited with status {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    if -code == signal.SIGKILL:
        return f"was killed by {name} (out of memory?)"
    if -code == signal.SIGABRT:
        return f"aborted ({name}: out of memory under a memory limit?)"
    return f"was killed by {name}"


class _Pool(mp.pool.Pool):
    """A ``multiprocessing`` pool that keeps every worker process it starts (replacements for
    dead workers included), so that a death is seen however early it comes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.started: list[Any] = []
        super().__init__(*args, **kwargs)

    def Process(self, ctx: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 (Pool's name)
        proc = ctx.Process(*args, **kwargs)
        self.started.append(proc)
        return proc


class WorkerPool:
    """``processes`` worker processes (a ``multiprocessing`` pool), forked where the platform
    can (the parent is small when it forks: no phase keeps the corpus in memory), each ending
    with this process (:func:`die_with_parent`) and started by ``initializer(*initargs)``.

    :meth:`result` waits for a task's result and for the workers' exits together: a worker
    that dies (a ``multiprocessing`` pool would replace it and never return its task) is a
    :class:`WorkerLost` naming its pid, its task (as given to :meth:`submit`) and how it
    ended. Each worker keeps the number of the task it runs in a shared table."""

    def __init__(
        self,
        processes: int,
        stats: PhaseStats,
        initializer: Callable[..., None] = ignore_sigint,
        initargs: tuple = (),
    ) -> None:
        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        ctx = mp.get_context(method)
        self._table = ctx.RawArray("q", 2 * processes)  # per worker: pid, task number
        start = (os.getpid(), self._table, ctx.Value("i", 0), initializer, initargs)
        with stats.paused():
            self.pool = _Pool(processes, _start_worker, start, context=ctx)
        self._what: dict[int, str] = {}
        self._next = 0
        # Finished task numbers, written by the pool's result thread, read while waiting.
        self._done_r, self._done_w = os.pipe()
        self._done: set[int] = set()
        self._lock = threading.Lock()
        self._open = True

    def submit(self, fn: Callable[..., Any], args: tuple, what: str) -> tuple[int, Any]:
        """Start ``fn(*args)`` in a worker; ``what`` says what it does (for :class:`WorkerLost`).
        Returns the handle :meth:`result` takes."""
        number = self._next
        self._next += 1
        self._what[number] = what
        done = partial(self._finished, number)
        res = self.pool.apply_async(
            _run_task, (fn, number, args), callback=done, error_callback=done
        )
        return number, res

    def _finished(self, number: int, _result: object) -> None:
        """Called by the pool's result thread as task ``number`` finishes."""
        with self._lock:
            if self._open:
                os.write(self._done_w, number.to_bytes(8, "little"))

    def result(self, handle: tuple[int, Any]) -> Any:
        """The result of the task ``handle`` (its exception raised), once it is there; a
        :class:`WorkerLost` as soon as a worker has died."""
        number, res = handle
        while number not in self._done and not res.ready():
            workers = {w.sentinel: w for w in list(self.pool.started) if w.pid is not None}
            ready = mp.connection.wait([self._done_r, *workers])
            if self._done_r in ready:
                data = os.read(self._done_r, 8 * 1024)
                self._done.update(
                    int.from_bytes(data[i : i + 8], "little") for i in range(0, len(data), 8)
                )
            else:
                raise self._lost(next(w for s, w in workers.items() if s in ready))
        self._done.discard(number)
        del self._what[number]
        return res.get()

    def _lost(self, worker: Any) -> WorkerLost:
        """The error for ``worker``, which has ended (its exit read once nothing else can
        reap it: stopping the pool's threads makes the other workers end too)."""
        stop_replacing(self.pool)
        worker.join()
        table = self._table
        rows = [table[2 * i + 1] for i in range(len(table) // 2) if table[2 * i] == worker.pid]
        task = rows[0] if rows else None
        doing = {STARTING: "starting", IDLE: "waiting for work"}.get(task) or self._what.get(
            task, "its task unknown"
        )
        return WorkerLost(
            f"preprocess worker {worker.pid} ({doing}) {_how_it_ended(worker.exitcode)}; "
            "nothing was published"
        )

    def close(self) -> None:
        """Let the workers finish and end (all results have been taken)."""
        self.pool.close()
        self.pool.join()
        self._close_pipe()

    def kill(self) -> None:
        """Kill the workers at once (:func:`kill_pool`), after an error or Ctrl-C."""
        kill_pool(self.pool)
        self._close_pipe()

    def _close_pipe(self) -> None:
        with self._lock:
            if self._open:
                self._open = False
                os.close(self._done_r)
                os.close(self._done_w)


@contextmanager
def worker_pool(
    n: int,
    stats: PhaseStats,
    initializer: Callable[..., None] = ignore_sigint,
    initargs=(),
    inline_one: bool = True,
) -> Iterator[WorkerPool | None]:
    """A pool of ``n`` workers (None for one when ``inline_one``: the work runs in this
    process), killed without waiting for queued work when the body fails (Ctrl-C, an error,
    a worker's death), closed and joined when it ends."""
    if n <= 1 and inline_one:
        yield None
        return
    pool = WorkerPool(n, stats, initializer, initargs)
    try:
        yield pool
    except BaseException:
        pool.kill()
        raise
    pool.close()


def stop_replacing(pool: mp.pool.Pool) -> None:
    """Stop the thread of ``pool`` that starts a new worker for each that exited (and reaps
    them); nothing else waits for a worker after this. Idempotent."""
    handler = pool._worker_handler
    handler._state = mp.pool.TERMINATE
    pool._change_notifier.put(None)
    handler.join()


def kill_pool(pool: mp.pool.Pool) -> None:
    """Stop ``pool`` at once, after an error or Ctrl-C, and leave it terminated.

    Not ``Pool.terminate``: it first takes the task queue's read lock, which an idle worker
    holds while it waits for a task, and waits there until the pool's threads have told every
    worker to stop; stopped while they do (a Ctrl-C during encoding, about 1 run in 10 in a
    loop here), it waited forever (CPython 3.11, ``multiprocessing/pool.py``). Instead: no
    more workers are started, every worker is killed and reaped, and the pool's exit handler,
    which would wait for that lock, is dropped. The pool is marked terminated: one left
    "running" warns when it is collected and pokes its dead handler thread, which at
    interpreter exit printed a ``Pool.__del__`` traceback after the error line."""
    if getattr(pool, "_worker_handler", None) is None or not hasattr(pool, "_terminate"):
        pool.terminate()  # another Pool than 3.11's
        pool.join()
        return
    stop_replacing(pool)
    for proc in pool._pool:
        if proc.exitcode is None:
            proc.kill()
    for proc in pool._pool:
        proc.join()
    pool._terminate.cancel()
    pool._state = mp.pool.TERMINATE


def in_order(
    fn: Callable[[Any], Any],
    tasks: Iterable[tuple[Any, Any]],
    pool: WorkerPool | None,
    workers: int,
    doing: Callable[[Any], str],
) -> Iterator[tuple[Any, Any]]:
    """``(meta, fn(arg))`` for each ``(meta, arg)`` of ``tasks``, in order; ``arg`` None is a
    marker passed through as ``(meta, None)``. With a pool at most a few tasks per worker are
    in flight, so neither the tasks (read lazily) nor the results pile up in memory;
    ``doing(meta)`` says what a task's worker does, should it die."""
    if pool is None:
        for meta, arg in tasks:
            yield meta, None if arg is None else fn(arg)
        return
    window = IN_FLIGHT_PER_WORKER * workers
    pending: deque = deque()
    for meta, arg in tasks:
        pending.append((meta, None if arg is None else pool.submit(fn, (arg,), doing(meta))))
        while pending and (len(pending) > window or pending[0][1] is None):
            meta0, handle = pending.popleft()
            yield meta0, None if handle is None else pool.result(handle)
    while pending:
        meta0, handle = pending.popleft()
        yield meta0, None if handle is None else pool.result(handle)
