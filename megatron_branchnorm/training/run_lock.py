"""One run per ``save_dir``: ``SAVE_DIR/run.lock``, held by rank 0 of the run that trains there.

Two runs in one save_dir would interleave ``metrics.jsonl`` and alternate checkpoints that each
pass their checksums, so a resume or ``--average-last`` would silently mix them. The lock is a
file created with ``O_CREAT | O_EXCL`` (atomic on local file systems and on NFSv3+/Lustre/GPFS)
holding who owns it: host, pid, the pid's start time, the SLURM job id, and a heartbeat (the
file's mtime, touched every :data:`HEARTBEAT_S` seconds by a daemon thread). A lock left by a
crashed run must not block the save_dir forever; a lock is taken over, with a warning, when

- it is this SLURM job's own (same ``SLURM_JOB_ID``: a requeued job, whose earlier incarnation
  SLURM has ended before starting this one), or
- its host is this host and its pid is gone, or now belongs to another process (start time
  differs: pid reuse), or is this process (a trainer built earlier in it), or
- its host is another host and SLURM says its job (not this one) has ended (``squeue``: a
  node that died with rank 0 on it), or
- its host is another host (we cannot see its processes) and its heartbeat is older than
  :data:`STALE_S` (a live holder touches it every :data:`HEARTBEAT_S`; on a shared file
  system mtimes come from the file server, so clock skew between nodes does not matter much
  as long as the server's clock and this node's are within minutes).

Otherwise the new run refuses to start, naming the holder. A clean exit (any exit code the
trainer returns) removes the lock; a ``kill -9`` leaves it, to be taken over as above. The
holder marks the save_dir as a run (``formats.dirs.mark_run_dir``); every rank checked before
that the save_dir is new, empty or a run of ours (``formats.dirs.check_run_dir``).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path

from megatron_branchnorm.errors import UserError
from megatron_branchnorm.formats import dirs
from megatron_branchnorm.formats.files import FileShapeError, read_small_file
from megatron_branchnorm.formats.owners import (  # noqa: F401 - run_lock.owner_record is public
    STALE_S,
    describe,
    owner_record,
    stale_reason,
)

LOCK_NAME = dirs.RUN_LOCK
HEARTBEAT_S = 60.0
"""How often the holder touches the lock."""


class LockError(UserError, RuntimeError):
    """Another live run holds the save_dir: the message names it."""


class RunLock:
    """Acquire with :meth:`acquire`; :meth:`release` (or a clean exit) removes it."""

    def __init__(self, save_dir: str | Path) -> None:
        self.path = Path(save_dir) / LOCK_NAME
        self.me = owner_record()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.warnings: list[str] = []

    @staticmethod
    def check_dir(save_dir: str | Path) -> None:
        """Every rank, before anything is written there: ``save_dir`` is new, empty or a run
        of ours (:func:`megatron_branchnorm.formats.dirs.check_run_dir`); a
        :class:`~megatron_branchnorm.formats.dirs.DirectoryError` otherwise."""
        dirs.check_run_dir(save_dir)

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(self.me, fh)
            fh.write("\n")
        return True

    def _read(self) -> tuple[dict, float] | None:
        try:
            text = read_small_file(self.path, dirs.MAX_MARKER_BYTES, follow_symlinks=False)
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return None
        except FileShapeError as exc:  # a FIFO would block, a device read without end
            raise LockError(f"{exc}: not a lock of ours; remove it if no run uses it") from None
        try:
            holder = json.loads(text)
        except ValueError:
            holder = None
        if not isinstance(holder, dict):
            holder = {"host": "?", "pid": None, "started": "? (unreadable lock)"}
        return holder, age

    def acquire(self) -> None:
        """Take the lock or raise :class:`LockError` naming the live holder."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            if self._create():
                if self.owned():
                    try:  # the save_dir's identity: a run (formats/dirs.py)
                        dirs.mark_run_dir(self.path.parent)
                    except OSError:
                        with contextlib.suppress(FileNotFoundError):
                            self.path.unlink()
                        raise
                    self._start_heartbeat()
                    return
                continue  # removed or replaced under us by a concurrent take-over: look again
            found = self._read()
            if found is None:
                continue
            holder, age = found
            reason = stale_reason(holder, age, self.me)
            if reason is None:
                raise LockError(
                    f"{self.path}: another run trains in this train.save_dir ({describe(holder)}, "
                    f"heartbeat {age:.0f} s ago); use another train.save_dir, or stop that run "
                    f"(a lock from another host counts as stale after {STALE_S / 60:.0f} min)"
                )
            self.warnings.append(f"taking over {self.path} from {describe(holder)}: {reason}")
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        raise LockError(f"{self.path}: could not take the lock (another run is starting here)")

    def owned(self) -> bool:
        """Whether the lock file is (still) ours."""
        found = self._read()
        return found is not None and found[0].get("token") == self.me["token"]

    def _start_heartbeat(self) -> None:
        def beat() -> None:
            while not self._stop.wait(HEARTBEAT_S):
                with contextlib.suppress(OSError):
                    os.utime(self.path)

        self._thread = threading.Thread(target=beat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still ours."""
        self._stop.set()
        if self.owned():
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
