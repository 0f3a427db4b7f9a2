"""Who owns a file or a directory: the owner record that run locks (``SAVE_DIR/run.lock``,
training/run_lock.py) and the markers of temporary output directories (formats/outputs.py)
carry, and whether the process that wrote it can still be alive.

The record: host, pid, the pid's start time (pid reuse), the SLURM job id, a random token and
the start time as text. A holder on this host is alive while its pid runs with the same start
time; on another host SLURM (``squeue``) or the age of a heartbeat decides.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

STALE_S = 15 * 60.0
"""A lock from another host untouched for this long belongs to a dead run."""


SLURM_ENDED = (
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
)
"""Job states (squeue's ``%T``) after which a job's ranks no longer run."""


def _pid_start_time(pid: int) -> str | None:
    """The start time of ``pid`` in clock ticks since boot (field 22 of /proc/PID/stat), or
    None when no such process exists (or /proc is not there)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive_here(pid: int, start: str | None) -> bool:
    """Whether the process ``pid`` started at ``start`` still runs on this host."""
    now = _pid_start_time(pid)
    if now is None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return start is None  # no /proc: trust the pid alone
    return start is None or now == start


def owner_record() -> dict:
    """Who we are, as written into the lock."""
    pid = os.getpid()
    return {
        "host": socket.gethostname(),
        "pid": pid,
        "pid_start": _pid_start_time(pid),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "token": uuid.uuid4().hex,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def describe(holder: dict) -> str:
    """One line about a lock's holder."""
    job = f", SLURM job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
    return f"pid {holder.get('pid')} on {holder.get('host')}{job}, started {holder.get('started')}"


def stale_reason(holder: dict, age_s: float, me: dict) -> str | None:
    """Why a lock held by ``holder`` (last touched ``age_s`` ago) belongs to a dead run, or
    None when its run may be alive."""
    job = holder.get("slurm_job_id")
    if job and job == me.get("slurm_job_id"):
        return f"it is this SLURM job's own (job {job} was requeued)"
    if holder.get("host") == me["host"]:
        pid = holder.get("pid")
        if pid == me["pid"] and holder.get("pid_start") == me.get("pid_start"):
            return "it is this process's own (an earlier trainer that did not release it)"
        if not isinstance(pid, int) or not _alive_here(pid, holder.get("pid_start")):
            return f"its process {pid} no longer runs on {me['host']}"
        return None
    if job and me.get("slurm_job_id") and slurm_job_ended(job):
        return f"its SLURM job {job} has ended (squeue)"
    if age_s > STALE_S:
        return f"its heartbeat is {age_s / 60:.0f} min old (> {STALE_S / 60:.0f} min)"
    return None


def slurm_job_ended(job_id: str) -> bool:
    """Whether SLURM says job ``job_id`` is no longer pending, running or completing: the
    lock of a job whose node died (rank 0's among them) need not wait out :data:`STALE_S`
    before the resubmitted job may start. False when squeue cannot tell (not installed, the
    controller unreachable): then only the heartbeat decides."""
    if not job_id.isdigit() or shutil.which("squeue") is None:
        return False
    try:
        proc = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-t", "all", "-o", "%T"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    if proc.returncode == 0:
        return proc.stdout.strip() in ("", *SLURM_ENDED)
    return "invalid job id" in proc.stderr.lower()  # purged from the controller
