"""Wall time and peak memory per phase of a run (``tools/preprocess_data.py --stats FILE``).

Memory is the resident set (RSS) of this process plus all its descendants (pool workers, the
SentencePiece trainer), summed, read from /proc by a background thread every
:data:`INTERVAL` seconds and at each phase's start and end. The summary is the JSON object

    {"phases": {"<phase>": {"seconds": float, "peak_rss_mb": float}, ...},
     "total_seconds": float, "peak_rss_mb": float}

with MiB (2^20 bytes) for ``_mb``; ``total_seconds`` runs from the creation of the
:class:`PhaseStats` to :meth:`PhaseStats.summary`, and the overall peak includes the time
between phases. Summing counts pages that a forked worker shares with its parent once per
process, so it overstates what the machine gives up; it never understates it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

INTERVAL = 0.05
_MIB = float(1 << 20)


class PhaseStats:
    """Times named phases; with ``sample_memory``, also tracks peak summed RSS."""

    def __init__(self, sample_memory: bool, interval: float = INTERVAL) -> None:
        self.phases: dict[str, dict[str, float]] = {}
        self._start = time.perf_counter()
        self._lock = threading.Lock()
        self._current: str | None = None
        self._peak = 0
        self._phase_peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if sample_memory:
            import psutil

            self._psutil = psutil
            self._proc = psutil.Process()
            self._sample()
            self._thread = threading.Thread(
                target=self._run, args=(interval,), name="rss-sampler", daemon=True
            )
            self._thread.start()

    def _rss(self) -> int:
        total = self._proc.memory_info().rss
        for child in self._proc.children(recursive=True):
            try:
                total += child.memory_info().rss
            except self._psutil.Error:  # ended meanwhile
                pass
        return total

    def _sample(self) -> None:
        """One reading, taken with the lock held."""
        rss = self._rss()
        self._peak = max(self._peak, rss)
        if self._current is not None:
            self._phase_peak = max(self._phase_peak, rss)

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            with self._lock:
                self._sample()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the body as phase ``name`` (and its peak memory when sampling)."""
        with self._lock:
            self._current, self._phase_peak = name, 0
            if self._thread is not None:
                self._sample()
            start = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                if self._thread is not None:
                    self._sample()
                self.phases[name] = {
                    "seconds": time.perf_counter() - start,
                    "peak_rss_mb": self._phase_peak / _MIB,
                }
                self._current = None

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No reading while the body runs: fork worker processes inside it, so that none is
        forked while the sampling thread holds a lock the child would inherit."""
        with self._lock:
            yield

    def stop(self) -> None:
        """End the sampling thread (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def summary(self) -> dict:
        """The ``--stats`` object (module docstring); stops the sampling."""
        total = time.perf_counter() - self._start
        self.stop()
        return {
            "phases": {name: dict(v) for name, v in self.phases.items()},
            "total_seconds": total,
            "peak_rss_mb": self._peak / _MIB,
        }
