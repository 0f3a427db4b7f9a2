"""The rehearsal's runs (workflows/rehearse.py): one run of the plan on its ranks on this
machine (runner/ranks.py starts them, as srun would), rank 0's output read as it comes (the
first update, saves, resumes, the stage re-layout, with seconds since launch), the peak RSS of
every rank and the machine's memory in use sampled until every rank exited, and the record of
the run (``runs.json``)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import threading
import time
from pathlib import Path
from typing import Any

from megatron_branchnorm.runner.ranks import start_ranks
from megatron_branchnorm.training.exit_codes import REQUEUE_EXIT_CODE
from megatron_branchnorm.workflows.rehearse_plan import (
    Plan,
    run_overrides,
    run_save_dir,
    run_world,
)

RUNS_FILE = "runs.json"
"""The record of the runs in the work directory: the plan, the CPU and each run's record."""
STEP_LINE = re.compile(r"^step (\d+) \| loss")
SAVE_LINE = re.compile(r"^saved checkpoint (\S+) in ([0-9.]+)s")
RESUME_LINE = re.compile(r"^resumed from (\S+) at step (\d+)")


def used_memory_mb() -> float:
    """MemTotal - MemAvailable of this machine, MiB."""
    info = {}
    with open("/proc/meminfo", encoding="ascii") as fh:
        for line in fh:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0])
    return (info["MemTotal"] - info["MemAvailable"]) / 1024.0


def cpu_description() -> str:
    """CPU model name (as lscpu shows it), core count and memory of this machine."""
    model = "unknown CPU"
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = ""
    with open("/proc/meminfo", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("MemTotal"):
                mem = f", {int(line.split()[1]) / 2**20:.0f} GiB"
    return f"{model}, {os.cpu_count()} cores{mem}"


class _Rank0Reader(threading.Thread):
    """Reads rank 0's output: writes it with seconds since launch, records the events."""

    def __init__(self, stream, log_path: Path, t0: float, on_step) -> None:
        super().__init__(daemon=True)
        self.stream, self.log_path, self.t0, self.on_step = stream, log_path, t0, on_step
        self.events: dict[str, Any] = {"steps": {}, "saves": [], "resumed": None}
        self.tail: list[str] = []

    def run(self) -> None:
        ev = self.events
        with open(self.log_path, "w", encoding="utf-8") as log:
            for line in self.stream:
                t = time.monotonic() - self.t0
                log.write(f"{t:9.3f} {line}")
                log.flush()
                line = line.rstrip("\n")
                self.tail = [*self.tail[-40:], line]
                if m := STEP_LINE.match(line):
                    step = int(m.group(1))
                    ev["steps"].setdefault(str(step), t)
                    self.on_step(step)
                elif m := SAVE_LINE.match(line):
                    ev["saves"].append({"tag": Path(m.group(1)).name, "seconds": float(m[2])})
                elif "in another layout (" in line and line.startswith("resumed from"):
                    ev["relayout"] = line[:300]
                elif m := RESUME_LINE.match(line):
                    ev["resumed"] = {"tag": Path(m.group(1)).name, "step": int(m.group(2))}
                elif line.startswith("Using topology:") and "t_topology" not in ev:
                    ev["t_topology"] = t
                elif line.startswith("world ") and "t_loop" not in ev:
                    ev["t_loop"] = t
                elif "was written with stage layout" in line:
                    ev["layout_warning"] = line.removeprefix("warning: ")[:300]
                elif line.startswith("signal received"):
                    ev["signal_ack"] = t


def launch(plan: Plan, name: str, workdir: Path, signal_after: int | None = None) -> dict[str, Any]:
    """Run ``name`` on its ranks to the end; returns its record (exit codes, events, peaks).
    A rank that fails leaves the others a minute to fail too (their messages) before they are
    killed; so does the run's time limit (``plan.timeout_s``)."""
    world = run_world(plan, name)
    save_dir = run_save_dir(workdir, name)
    log_dir = workdir / "logs" / name
    args = ["--config", plan.config, *run_overrides(plan, name, save_dir)]
    signalled: dict[str, float] = {}
    mem_base = mem_peak = used_memory_mb()
    t0 = time.monotonic()
    with start_ranks(world, args, log_dir, pipe_rank0=True) as ranks:

        def on_step(step: int) -> None:
            if signal_after is not None and step >= signal_after and not signalled:
                signalled["t"] = time.monotonic() - t0
                signalled["after_step"] = step
                ranks.send(signal.SIGUSR1)

        reader = _Rank0Reader(ranks[0].stdout, ranks.logs[0], t0, on_step)
        reader.start()
        codes: list[int | None] = [None] * world
        first_failure = None
        killed = ""
        while any(c is None for c in codes):
            # VmHWM counts the rank alone (wait4's ru_maxrss would count the compilers
            # DeepSpeed may start); read until the process is reaped
            ranks.sample_peaks()
            codes = ranks.poll()
            mem_peak = max(mem_peak, used_memory_mb())
            now = time.monotonic()
            bad = [c for c in codes if c not in (None, 0, REQUEUE_EXIT_CODE)]
            if bad and first_failure is None:
                first_failure = now
            late = first_failure is not None and now - first_failure > 60
            if not killed and (late or now - t0 > plan.timeout_s):
                killed = "a rank failed" if late else f"timeout {plan.timeout_s:.0f}s"
                ranks.send(signal.SIGKILL)
            time.sleep(0.25)
        wall = time.monotonic() - t0
        reader.join(timeout=30)
    return {
        "name": name,
        "world": world,
        "argv": shlex.join(["python", *ranks.argv[1:]]),
        "save_dir": str(save_dir),
        "exit_codes": codes,
        "killed": killed,
        "wall_s": wall,
        "peak_rss_mb": ranks.peak_rss_mb,
        "machine_mem_base_mb": mem_base,
        "machine_mem_peak_mb": mem_peak,
        "signal": signalled or None,
        "tail": reader.tail[-25:],
        **reader.events,
    }


def run_ok(record: dict[str, Any] | None, expect: int = 0) -> bool:
    """Whether every rank of the run exited with ``expect``."""
    return bool(record) and all(c == expect for c in record["exit_codes"])
