"""SIGUSR1/SIGTERM (SLURM preemption, ``scancel --signal=USR1``) recorded from process start.

SLURM's ``--signal=USR1@LEAD`` can fire while the ranks are still importing torch and
DeepSpeed or building a 1000-layer stage (minutes). SIGUSR1's default action terminates the
process (exit 138) and the job is not requeued. ``train.py`` therefore calls :func:`install`
before anything else; the handler only records the signal, and the trainer acts on it at its
next collective check: before the first update (exit with the requeue code; nothing to save
when no update ran since the last checkpoint) or after the update in progress (save, exit).
"""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
_received = 0


def _record(signum: int, frame) -> None:  # noqa: ARG001 - signal handler signature
    global _received
    _received = signum


def install() -> None:
    """Record SIGUSR1/SIGTERM from now on instead of dying (idempotent)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _record)


def received() -> int:
    """The last stop signal received (0 when none)."""
    return _received


def clear() -> None:
    """Forget a recorded signal (a new Trainer in the same process starts clean)."""
    global _received
    _received = 0
