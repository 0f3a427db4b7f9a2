"""The research harness's progress lines (tools/benchmark.py and its sections): each on stderr
with the time and the machine's load averages, since timings on a shared machine are only as
good as the load they ran under."""

from __future__ import annotations

import os
import sys
import time


def load() -> str:
    """The 1/5/15-minute load averages."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} load {load()}] {msg}", file=sys.stderr, flush=True)
