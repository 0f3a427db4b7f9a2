"""Rehearse a config at its real depth and topology, width shrunk, on gloo ranks on one machine.

    python tools/rehearse.py --config opus100_1000L            # 16 stages x 2 = 32 ranks
    python tools/rehearse.py --config tiny_cpu --stages 4 --world 4

The pipeline stage count comes from the config, the world size from the config's SLURM
launcher (``#SBATCH --nodes`` x ``--ntasks-per-node`` of ``slurm/<config>.sh``) or ``--world``;
only the width is shrunk (:data:`SHRINK`: d=16, vocabulary 64, synthetic data, fp32, dropout 0).
Every rank is a plain ``python -m megatron_branchnorm.train`` process with RANK/WORLD_SIZE/...
in its environment, as under ``srun``. Five runs:

- ``uninterrupted``: the real topology, ``steps`` updates;
- ``interrupted``: the same, SIGUSR1 to every rank once rank 0 logged update ``signal_after``
  (checkpoint, exit 75), then ``resumed``: the same command again, to ``steps``;
- ``other_topology``: the interrupted run's save_dir continued with ``other_stages`` stages
  (weights, fp32 master weights and Adam's state re-laid per parameter: docs/design.md §17)
  for ``other_steps`` more updates, the global batch
  (micro-batches x data-parallel) kept;
- ``reference``: one process (1 stage) with the whole global batch as its micro-batches.

Then the checks (each pass or fail; the tool exits 1 when one fails):

1. parity: the uninterrupted run's updates equal the reference's (docs/design.md §5: 1e-4
   relative loss per step; lr and alpha exactly);
2. exact resume: the interrupted + resumed run's loss, nll, lr, alpha and grad norm equal the
   uninterrupted run's bit for bit; its metrics.jsonl has every step once;
3. other topology: it resumes at the step, every step once, and its first update equals the
   reference's (1e-4 loss; lr and alpha exactly);
4. export: the real-topology checkpoint (one file per layer) converts, with its checksums
   verified, to an export that computes what the checkpoint does and translates a sentence.

Figures: start-up (launch to the first update logged), time per update, peak RSS of every
rank (``VmHWM``) and the machine's memory in use, checkpoint save and load times, checkpoint
files and bytes, conversion and translation times. ``evaluate``
computes the checks and figures from a finished work directory again (``--evaluate-only``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from megatron_branchnorm.cli import run_main
from megatron_branchnorm.config import ConfigError, load_config
from megatron_branchnorm.errors import UserError
from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.formats.outputs import OutputError, prepare_output, write_marker
from megatron_branchnorm.formats.records import REDONE_KEY
from megatron_branchnorm.formats.records import read_metrics as read_run_metrics
from megatron_branchnorm.runner.launch import CHECKOUT, free_port, rank_env
from megatron_branchnorm.training.exit_codes import REQUEUE_EXIT_CODE
from megatron_branchnorm.training.metrics import training_rows

SHRINK: tuple[str, ...] = (
    "model.vocab_size=64",
    "model.hidden_size=16",
    "model.ffn_hidden_size=32",
    "model.num_attention_heads=2",
    "model.max_positions=64",
    "model.dropout=0",
    "model.attention_dropout=0",
    "model.activation_dropout=0",
    "data.dataset=synthetic",
    "data.max_tokens=128",
    "data.max_length=24",
    "train.deepspeed_config=ds_configs/cpu_fp32.json",
)
"""Overrides that shrink the width only (depth, stages, schedule and micro-batches stay)."""
RUN_KEYS: tuple[str, ...] = (
    "train.log_interval=1",
    "train.save_interval=0",
    "train.eval_interval=0",
)
"""Every update logged; checkpoints only at the end or on the signal; no validation."""
LOSS_RTOL = 1e-4
"""S stages vs 1 stage, relative loss per step (docs/design.md §5)."""
EXPORT_RTOL = 1e-4
"""Export vs checkpoint logits, relative to their largest magnitude."""

EXACT_KEYS = ("loss", "nll_loss", "lr", "alpha", "grad_norm")
RUNS_FILE = "runs.json"
SYNTHETIC_LANGS = ("copy", "reverse")
"""Tags ``<2copy>`` and ``<2reverse>`` get ids 4 and 5: the synthetic task's task tokens."""
TRANSLATE_INPUT = "the cat sits on the mat"


class RehearsalError(UserError, ValueError):
    """Bad input to the rehearsal (config, topology, work directory): a one-line message."""


@dataclasses.dataclass
class Plan:
    """What to run: the config, its topology, the step counts."""

    config: str
    """Shipped config name or YAML path."""
    overrides: list[str]
    """SHRINK plus the user's ``--set`` overrides, applied to every run."""
    world: int
    """Ranks of the real topology."""
    world_source: str
    """Where the world size came from (the launcher's #SBATCH lines or --world)."""
    stages: int
    """Pipeline stages of the real topology (the config's, or --stages)."""
    other_stages: int
    """Pipeline stages of the other topology (same world size)."""
    micro_batches: int
    """Micro-batches per update and replica in the real topology."""
    config_micro_batches: int
    """The config's own train.micro_batches."""
    steps: int
    """Updates of the uninterrupted run (and the parity check)."""
    other_steps: int
    """Updates of the other topology after ``steps``."""
    signal_after: int
    """SIGUSR1 once rank 0 logged this update."""
    timeout_s: float
    """Wall-clock limit of each run."""
    layers: tuple[int, int]
    """(encoder, decoder) layers."""
    command: str = ""
    """The command line of the rehearsal (for the report)."""

    @property
    def dp(self) -> int:
        """Data-parallel size of the real topology."""
        return self.world // self.stages

    @property
    def other_dp(self) -> int:
        """Data-parallel size of the other topology."""
        return self.world // self.other_stages

    @property
    def other_micro_batches(self) -> int:
        """Micro-batches per replica in the other topology: the same global batch if it
        divides, else the real topology's per-replica count."""
        total = self.micro_batches * self.dp
        return total // self.other_dp if total % self.other_dp == 0 else self.micro_batches


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------


def launcher_world(config: str) -> tuple[int, str] | None:
    """(nodes x tasks per node, description) from ``slurm/<config>.sh``; None without one."""
    name = Path(config).stem if config.endswith((".yaml", ".yml")) else config
    script = CHECKOUT / "slurm" / f"{name}.sh"  # an installed copy has no slurm/
    if not script.is_file():
        return None
    text = script.read_text(encoding="utf-8")
    nodes = re.search(r"^#SBATCH\s+--nodes[=\s](\d+)", text, re.M)
    tasks = re.search(r"^#SBATCH\s+--ntasks-per-node[=\s](\d+)", text, re.M)
    if not (nodes and tasks):
        return None
    n, t = int(nodes.group(1)), int(tasks.group(1))
    return n * t, f"slurm/{script.name}: {n} node(s) x {t} tasks"


def make_plan(
    config: str,
    sets: list[str] | None = None,
    world: int | None = None,
    stages: int | None = None,
    other_stages: int | None = None,
    micro_batches: int | None = None,
    steps: int = 4,
    other_steps: int = 1,
    signal_after: int = 1,
    timeout_s: float = 3600.0,
) -> Plan:
    """Resolve the topology and check that every run of the rehearsal is a valid config."""
    overrides = [*SHRINK, *(sets or [])]
    try:
        cfg = load_config(config, overrides)
    except ConfigError as exc:
        raise RehearsalError(str(exc)) from None
    stages = stages or cfg.pipeline.stages
    if world is None:
        found = launcher_world(config)
        if found is None:
            raise RehearsalError(
                f"--config {config}: no slurm/<name>.sh with #SBATCH --nodes and "
                "--ntasks-per-node next to it: pass --world"
            )
        world, source = found
    else:
        source = "--world"
    if world < 1 or stages < 1 or world % stages:
        raise RehearsalError(f"{stages} pipeline stages do not divide the world size {world}")
    if other_stages is None:
        other_stages = stages // 2 if stages > 1 else (2 if world % 2 == 0 else 1)
    if world % other_stages or other_stages == stages:
        raise RehearsalError(
            f"--other-stages {other_stages}: must divide the world size {world} and differ "
            f"from the real topology's {stages} stages"
        )
    if not 1 <= signal_after <= steps - 2:
        raise RehearsalError(
            f"--signal-after {signal_after} must be between 1 and --steps - 2 (two updates "
            "after the signal's checkpoint show an exact resume, Adam moments included)"
        )
    if other_steps < 1:
        raise RehearsalError("--other-steps must be >= 1")
    plan = Plan(
        config=config,
        overrides=overrides,
        world=world,
        world_source=source,
        stages=stages,
        other_stages=other_stages,
        micro_batches=micro_batches or cfg.train.micro_batches,
        config_micro_batches=cfg.train.micro_batches,
        steps=steps,
        other_steps=other_steps,
        signal_after=signal_after,
        timeout_s=timeout_s,
        layers=(cfg.model.encoder_layers, cfg.model.decoder_layers),
    )
    for extra in (
        run_overrides(plan, "uninterrupted", Path("x")),
        run_overrides(plan, "other_topology", Path("x")),
        run_overrides(plan, "reference", Path("x")),
    ):
        try:
            load_config(config, extra)
        except ConfigError as exc:
            raise RehearsalError(str(exc)) from None
    return plan


def run_world(plan: Plan, name: str) -> int:
    """Ranks of run ``name``."""
    return 1 if name == "reference" else plan.world


def run_save_dir(workdir: Path, name: str) -> Path:
    """The save_dir of run ``name`` (interrupted, resumed and other_topology share one)."""
    return workdir / ("interrupted" if name in ("resumed", "other_topology") else name)


def run_overrides(plan: Plan, name: str, save_dir: Path) -> list[str]:
    """The trainer's key=value arguments for run ``name``."""
    steps = plan.steps
    stages, micro = plan.stages, plan.micro_batches
    if name == "other_topology":
        stages, micro, steps = plan.other_stages, plan.other_micro_batches, steps + plan.other_steps
    elif name == "reference":
        stages, micro, steps = 1, plan.micro_batches * plan.dp, steps + plan.other_steps
    return [
        *plan.overrides,
        *RUN_KEYS,
        f"pipeline.stages={stages}",
        f"train.micro_batches={micro}",
        "pipeline.data_parallel=0",  # micro is per replica here: no config batch to share
        f"train.max_steps={steps}",
        f"train.save_dir={save_dir}",
    ]


# --------------------------------------------------------------------------------------------
# Running ranks
# --------------------------------------------------------------------------------------------

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


def peak_rss_mb(pid: int) -> float | None:
    """VmHWM (peak resident set) of a live process, MiB; None once it is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError):
        return None
    return None


def remove_shm_leftovers(port: int) -> None:
    """Unlink DeepSpeed's shared-memory segments of the run on ``port`` (left only by ranks
    killed before ``release_shm_workspace``)."""
    pattern = f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_*"
    for path in Path("/dev/shm").glob(pattern):
        path.unlink(missing_ok=True)


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
    """Run ``name`` on its ranks to the end; returns its record (exit codes, events, peaks)."""
    world = run_world(plan, name)
    save_dir = run_save_dir(workdir, name)
    log_dir = workdir / "logs" / name
    log_dir.mkdir(parents=True, exist_ok=True)
    overrides = run_overrides(plan, name, save_dir)
    argv = [sys.executable, "-u", "-m", "megatron_branchnorm.train", "--config", plan.config]
    argv += overrides
    port = free_port()
    procs: list[subprocess.Popen] = []
    signalled: dict[str, float] = {}
    t0 = time.monotonic()

    def on_step(step: int) -> None:
        if signal_after is not None and step >= signal_after and not signalled:
            signalled["t"] = time.monotonic() - t0
            signalled["after_step"] = step
            for p in procs:
                if p.returncode is None:
                    os.kill(p.pid, signal.SIGUSR1)

    mem_base = mem_peak = used_memory_mb()
    logs = []
    try:
        for rank in range(world):
            out = subprocess.PIPE if rank == 0 else open(log_dir / f"rank{rank}.log", "w")  # noqa: SIM115
            if rank:
                logs.append(out)
            procs.append(
                subprocess.Popen(
                    argv,
                    env=rank_env(rank, world, port),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    text=True,
                    errors="replace",
                )
            )
        reader = _Rank0Reader(procs[0].stdout, log_dir / "rank0.log", t0, on_step)
        reader.start()
        codes: list[int | None] = [None] * world
        peaks: list[float | None] = [None] * world
        first_failure = None
        killed = ""
        while any(c is None for c in codes):
            for i, p in enumerate(procs):
                if codes[i] is None:
                    # VmHWM counts the rank alone (wait4's ru_maxrss would count the
                    # compilers DeepSpeed may start); read until the process is reaped
                    peaks[i] = peak_rss_mb(p.pid) or peaks[i]
                    pid, status, _ = os.wait4(p.pid, os.WNOHANG)
                    if pid:
                        codes[i] = os.waitstatus_to_exitcode(status)
                        p.returncode = codes[i]
            mem_peak = max(mem_peak, used_memory_mb())
            now = time.monotonic()
            bad = [c for c in codes if c not in (None, 0, REQUEUE_EXIT_CODE)]
            if bad and first_failure is None:
                first_failure = now
            late = first_failure is not None and now - first_failure > 60
            if not killed and (late or now - t0 > plan.timeout_s):
                killed = "a rank failed" if late else f"timeout {plan.timeout_s:.0f}s"
                for i, p in enumerate(procs):
                    if codes[i] is None:
                        p.kill()
            time.sleep(0.25)
        wall = time.monotonic() - t0
        reader.join(timeout=30)
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
                p.wait()
        for fh in logs:
            fh.close()
        remove_shm_leftovers(port)
    return {
        "name": name,
        "world": world,
        "argv": shlex.join(["python", *argv[2:]]),
        "save_dir": str(save_dir),
        "exit_codes": codes,
        "killed": killed,
        "wall_s": wall,
        "peak_rss_mb": peaks,
        "machine_mem_base_mb": mem_base,
        "machine_mem_peak_mb": mem_peak,
        "signal": signalled or None,
        "tail": reader.tail[-25:],
        **reader.events,
    }


REHEARSAL_KIND = "rehearsal"
"""The marker kind of a rehearsal's --workdir (outputs.MARKER)."""


def run_ok(record: dict[str, Any] | None, expect: int = 0) -> bool:
    """Whether every rank of the run exited with ``expect``."""
    return bool(record) and all(c == expect for c in record["exit_codes"])


def rehearse(plan: Plan, workdir: Path, overwrite: bool = False, echo=print) -> dict[str, Any]:
    """Run the five runs into ``workdir`` (stopping at the first that fails); writes and
    returns the runs record (``runs.json``)."""
    try:  # --overwrite removes only a workdir a rehearsal wrote (its marker, or runs.json)
        replace = prepare_output(
            workdir,
            REHEARSAL_KIND,
            overwrite,
            "--workdir",
            legacy=lambda p: (p / "runs.json").is_file(),
        )
    except OutputError as exc:
        raise RehearsalError(str(exc)) from None
    if replace:
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    write_marker(workdir, "rehearse", REHEARSAL_KIND)
    record: dict[str, Any] = {"plan": dataclasses.asdict(plan), "cpu": cpu_description()}
    record["runs"] = {}
    order = [
        ("uninterrupted", None, 0),
        ("interrupted", plan.signal_after, REQUEUE_EXIT_CODE),
        ("resumed", None, 0),
        ("other_topology", None, 0),
        ("reference", None, 0),
    ]
    for name, signal_after, expect in order:
        w = run_world(plan, name)
        echo(f"[rehearse] {name}: {w} rank(s) ...", flush=True)
        run = launch(plan, name, workdir, signal_after)
        record["runs"][name] = run
        (workdir / RUNS_FILE).write_text(json.dumps(record, indent=1), encoding="utf-8")
        echo(
            f"[rehearse] {name}: exit codes {sorted(set(run['exit_codes']))} in "
            f"{run['wall_s']:.0f}s",
            flush=True,
        )
        if not run_ok(run, expect):
            echo("\n".join(run["tail"]), flush=True)
            break
    return record


# --------------------------------------------------------------------------------------------
# Checks and figures
# --------------------------------------------------------------------------------------------


def read_training_rows(save_dir: Path) -> list[dict[str, Any]]:
    """The training rows of ``save_dir/metrics.jsonl`` (no validation or skip rows)."""
    return training_rows(read_run_metrics(save_dir))


def rel_diff(a: float, b: float) -> float:
    """|a - b| / |b| (inf when either is not finite)."""
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(b), 1e-30)


def _check(name: str, ok: bool, detail: str) -> dict[str, Any]:
    return {"name": name, "ok": bool(ok), "detail": detail}


def _run_problem(runs: dict[str, Any], name: str, expect: int = 0) -> str | None:
    run = runs.get(name)
    if run is None:
        return f"run '{name}' did not run"
    if not run_ok(run, expect):
        why = f" ({run['killed']})" if run.get("killed") else ""
        return f"run '{name}' exited {run['exit_codes']}{why}, expected {expect} on every rank"
    return None


def check_parity(plan: dict, runs: dict, workdir: Path) -> dict[str, Any]:
    """(1) uninterrupted (real topology) vs reference (one process), steps 1..steps."""
    name = "(1) parity with one process"
    for r in ("uninterrupted", "reference"):
        if problem := _run_problem(runs, r):
            return _check(name, False, problem)
    real = {r["step"]: r for r in read_training_rows(workdir / "uninterrupted")}
    ref = {r["step"]: r for r in read_training_rows(workdir / "reference")}
    steps = range(1, plan["steps"] + 1)
    missing = [s for s in steps if s not in real or s not in ref]
    if missing:
        return _check(name, False, f"steps {missing} missing from metrics.jsonl")
    worst = max(max(rel_diff(real[s][k], ref[s][k]) for k in ("loss", "nll_loss")) for s in steps)
    unequal = [
        s for s in steps if real[s]["lr"] != ref[s]["lr"] or real[s]["alpha"] != ref[s]["alpha"]
    ]
    gn = max(rel_diff(real[s]["grad_norm"], ref[s]["grad_norm"]) for s in steps)
    ok = worst <= LOSS_RTOL and not unequal
    detail = (
        f"steps 1-{plan['steps']}: worst relative loss/nll difference {worst:.1e} "
        f"(tolerance {LOSS_RTOL:g}); lr and alpha "
        + ("equal" if not unequal else f"differ at steps {unequal}")
        + f"; grad norm within {gn:.1e} (not checked)"
    )
    return _check(name, ok, detail)


def _span(first: int, last: int) -> str:
    """'step 5' or 'steps 3-4'."""
    return f"step {first}" if first == last else f"steps {first}-{last}"


def _steps_once(rows: list[dict], last: int) -> str | None:
    """None when ``rows`` (read through the resumes) are steps 1..last, none of them redone
    (an exact resume repeats no update)."""
    got = [r["step"] for r in rows]
    redone = [r["step"] for r in rows if r.get(REDONE_KEY)]
    if got != list(range(1, last + 1)) or redone:
        miss = sorted(set(range(1, last + 1)) - set(got))
        return f"metrics.jsonl steps {got}: missing {miss}, repeated (redone) {redone}"
    return None


def check_resume(plan: dict, runs: dict, workdir: Path) -> dict[str, Any]:
    """(2) SIGUSR1 checkpoint, then an exact resume on the same topology."""
    name = "(2) SIGUSR1 + exact resume, same topology"
    if problem := _run_problem(runs, "uninterrupted"):
        return _check(name, False, problem)
    if problem := _run_problem(runs, "interrupted", REQUEUE_EXIT_CODE):
        return _check(name, False, problem)
    if problem := _run_problem(runs, "resumed"):
        return _check(name, False, problem)
    n = plan["steps"]
    inter = runs["interrupted"]
    saves = inter.get("saves") or []
    if not saves:
        return _check(name, False, "the interrupted run logged no checkpoint")
    stop = ckpt.tag_step(saves[-1]["tag"])
    if not 1 <= stop <= n - 2:
        return _check(
            name,
            False,
            f"the signal's checkpoint is at step {stop}: at least 2 resumed steps are needed "
            f"(restored Adam moments first show in the loss of the second): raise --steps (was {n})",
        )
    if not (workdir / "interrupted" / saves[-1]["tag"] / "checksums.json").is_file():
        return _check(name, False, f"{saves[-1]['tag']}: no checksums.json (incomplete)")
    resumed = runs["resumed"].get("resumed")
    if not resumed or resumed["step"] != stop:
        return _check(name, False, f"the resumed run did not log 'resumed from ... step {stop}'")
    rows = [r for r in read_training_rows(workdir / "interrupted") if r["step"] <= n]
    if problem := _steps_once(rows, n):
        return _check(name, False, problem)
    ref = {r["step"]: r for r in read_training_rows(workdir / "uninterrupted")}
    diffs = [
        f"step {r['step']} {k} {r[k]!r} != {ref.get(r['step'], {}).get(k)!r}"
        for r in rows
        for k in EXACT_KEYS
        if r.get(k) != ref.get(r["step"], {}).get(k)
    ]
    if diffs:
        return _check(name, False, f"{len(diffs)} difference(s): " + "; ".join(diffs[:3]))
    after = (inter.get("signal") or {}).get("after_step")
    return _check(
        name,
        True,
        f"SIGUSR1 after step {after} logged: checkpoint at step {stop}, "
        f"exit 75 on all ranks; resumed {_span(stop + 1, n)} equal the uninterrupted run's "
        f"{', '.join(EXACT_KEYS)} exactly (and the steps before the signal); metrics.jsonl "
        f"has steps 1-{n}, each once",
    )


def check_other_topology(plan: dict, runs: dict, workdir: Path) -> dict[str, Any]:
    """(3) the checkpoint continued with another stage count."""
    name = "(3) resume on another topology"
    for r in ("resumed", "other_topology", "reference"):
        if problem := _run_problem(runs, r):
            return _check(name, False, problem)
    n, more = plan["steps"], plan["other_steps"]
    other = runs["other_topology"]
    if not other.get("relayout"):
        why = other.get("layout_warning") or "no 'in another layout' line"
        return _check(name, False, f"the whole training state was not re-laid: {why}")
    resumed = other.get("resumed")
    rows = read_training_rows(workdir / "interrupted")
    if problem := _steps_once(rows, n + more):
        return _check(name, False, problem)
    ref = {r["step"]: r for r in read_training_rows(workdir / "reference")}
    first = rows[n]  # step n + 1
    if first["step"] not in ref:
        return _check(name, False, f"the reference has no step {first['step']}")
    want = ref[first["step"]]
    same_batch = plan["micro_batches"] * (plan["world"] // plan["stages"]) == (
        other_micro_batches(plan) * (plan["world"] // plan["other_stages"])
    )
    loss_diff = rel_diff(first["loss"], want["loss"])
    problems = []
    if first["lr"] != want["lr"] or first["alpha"] != want["alpha"]:
        problems.append(
            f"step {first['step']}: lr/alpha {first['lr']}/{first['alpha']} != "
            f"{want['lr']}/{want['alpha']}"
        )
    if same_batch and loss_diff > LOSS_RTOL:
        problems.append(f"step {first['step']}: loss differs by {loss_diff:.1e} from the reference")
    if resumed is not None:
        problems.append("logged a same-layout resume, expected one in another layout")
    detail = (
        f"{plan['other_stages']} stages x {plan['world'] // plan['other_stages']}: resumed the "
        f"step-{n} checkpoint with its whole state re-laid per parameter and ran "
        f"{_span(n + 1, n + more)}, every step logged "
        f"once; step {n + 1}'s lr and alpha equal the reference's, its loss within "
        f"{loss_diff:.1e}" + ("" if same_batch else " (global batch differs: loss not checked)")
    )
    return _check(name, not problems, "; ".join(problems) if problems else detail)


def other_micro_batches(plan: dict) -> int:
    """Plan.other_micro_batches for a plan read back from JSON."""
    return Plan(**{**plan, "layers": tuple(plan["layers"])}).other_micro_batches


def checkpoint_figures(tag_dir: Path) -> dict[str, Any]:
    """Files, layer files and bytes of one checkpoint (from its checksums.json)."""
    manifest = json.loads((tag_dir / ckpt.MANIFEST).read_text(encoding="utf-8"))
    files = manifest["files"]
    layer = [f for f in files if ckpt.layer_index(f) is not None]
    return {
        "files": len(files) + 1,
        "layer_files": len(layer),
        "bytes": sum(f["bytes"] for f in files.values())
        + (tag_dir / "checksums.json").stat().st_size,
    }


def train_spm(out_dir: Path, vocab_size: int) -> Path:
    """A tiny SentencePiece model whose tags ``<2copy>``/``<2reverse>`` get ids 4 and 5 (the
    synthetic task tokens), so a synthetic run's export can translate text."""
    import random

    import sentencepiece as spm

    from megatron_branchnorm.tokens import SPM_SPECIALS, lang_tag

    out_dir.mkdir(parents=True, exist_ok=True)
    words = "the a cat dog sits runs on under mat house big small red open close file".split()
    rng = random.Random(1)
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))) for _ in range(400)]
    (out_dir / "train.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(out_dir / "train.txt"),
        model_prefix=str(out_dir / "spm"),
        vocab_size=vocab_size,
        hard_vocab_limit=False,
        **SPM_SPECIALS,
        user_defined_symbols=[lang_tag(lang) for lang in SYNTHETIC_LANGS],
        character_coverage=1.0,
        num_threads=1,
        minloglevel=2,
    )
    return out_dir / "spm.model"


def check_export(plan: dict, runs: dict, workdir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(4) convert the real-topology checkpoint, compare the export, translate a sentence;
    returns the check and its figures."""
    import torch

    from megatron_branchnorm.data.synthetic import SyntheticData, collate
    from megatron_branchnorm.formats.checkpoint import CheckpointError, verify_checkpoint
    from megatron_branchnorm.inference.convert import ConvertError, load_pipeline_checkpoint
    from megatron_branchnorm.inference.export import ExportError, load_export, save_export
    from megatron_branchnorm.inference.translate import SearchOptions, Translator

    name = "(4) convert + translate"
    figures: dict[str, Any] = {}
    if problem := _run_problem(runs, "resumed"):
        return _check(name, False, problem), figures
    tag = ckpt.tag_for(plan["steps"])
    save_dir = workdir / "interrupted"
    try:
        figures["checkpoint"] = checkpoint_figures(save_dir / tag)
        t = time.monotonic()
        verify_checkpoint(save_dir / tag)
        figures["verify_s"] = time.monotonic() - t
        t = time.monotonic()
        model, meta = load_pipeline_checkpoint(save_dir, tag)
        figures["load_s"] = time.monotonic() - t
        spm_path = train_spm(workdir / "spm", model.cfg.vocab_size)
        t = time.monotonic()
        out = save_export(model, workdir / "export", spm_path, meta, overwrite=True)
        figures["export_s"] = time.monotonic() - t
        figures["export_bytes"] = sum(p.stat().st_size for p in out.iterdir())
        exported, _, _ = load_export(out)
        batch = collate(SyntheticData(8, model.cfg.vocab_size, 20), list(range(8)))
        with torch.no_grad():
            want = model(batch["src_tokens"], batch["prev_output_tokens"])
            got = exported(batch["src_tokens"], batch["prev_output_tokens"])
        err = float((want - got).abs().max() / want.abs().max())
        t = time.monotonic()
        translator = Translator.from_export(out)
        hyps = translator.translate_hypotheses(
            [TRANSLATE_INPUT], SYNTHETIC_LANGS[0], SYNTHETIC_LANGS[0], SearchOptions()
        )
        figures["translate_s"] = time.monotonic() - t
    except (CheckpointError, ConvertError, ExportError, OSError, ValueError, KeyError) as exc:
        return _check(name, False, f"{type(exc).__name__}: {exc}"), figures
    text = translator.decode(hyps[0][0].tokens) if hyps[0] else ""
    figures["translation"] = text
    problems = []
    if err > EXPORT_RTOL:
        problems.append(f"export logits differ from the checkpoint's by {err:.1e}")
    if not hyps[0] or not math.isfinite(hyps[0][0].score):
        problems.append("beam search returned no hypothesis")
    n_layers = sum(plan["layers"])
    detail = (
        f"{tag}: {figures['checkpoint']['layer_files']:,} layer files ({n_layers} encoder/decoder "
        f"layers) verified and converted; export logits within {err:.1e} of the checkpoint's; "
        f"'{TRANSLATE_INPUT}' (<2copy>, beam 4) -> {text!r} ({len(hyps[0][0].tokens)} tokens; "
        "a tiny SentencePiece model stands in for the synthetic data's)"
    )
    return _check(name, not problems, "; ".join(problems) if problems else detail), figures


def _median_update_s(run: dict | None) -> float | None:
    if not run:
        return None
    t = {int(k): v for k, v in run.get("steps", {}).items()}
    gaps = [t[s] - t[s - 1] for s in sorted(t) if s - 1 in t]
    return statistics.median(gaps) if gaps else None


def evaluate(workdir: Path) -> dict[str, Any]:
    """Checks and figures of a finished (or failed) rehearsal in ``workdir``."""
    path = workdir / RUNS_FILE
    if not path.is_file():
        raise RehearsalError(f"{path}: missing (no rehearsal ran in {workdir})")
    record = json.loads(path.read_text(encoding="utf-8"))
    plan, runs = record["plan"], record["runs"]
    checks = [
        check_parity(plan, runs, workdir),
        check_resume(plan, runs, workdir),
        check_other_topology(plan, runs, workdir),
    ]
    export_check, export_fig = check_export(plan, runs, workdir)
    checks.append(export_check)
    return {
        "config": plan["config"],
        "command": plan["command"],
        "cpu": record["cpu"],
        "plan": plan,
        "checks": checks,
        "ok": all(c["ok"] for c in checks),
        "figures": figures(plan, runs, export_fig),
    }


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f} MB"


def figures(plan: dict, runs: dict, export_fig: dict) -> dict[str, Any]:
    """The figures of the table, by name (JSON-friendly values)."""
    out: dict[str, Any] = {}
    dp, other_dp = plan["world"] // plan["stages"], plan["world"] // plan["other_stages"]
    u = runs.get("uninterrupted")
    first = (u or {}).get("steps", {}).get("1")
    out["startup_s"] = first
    out["loop_start_s"] = (u or {}).get("t_loop")
    out["update_s"] = _median_update_s(u)
    out["reference_update_s"] = _median_update_s(runs.get("reference"))
    peaks = {}
    for name, run in runs.items():
        p = [x for x in run.get("peak_rss_mb", []) if x is not None]
        if p:
            peaks[name] = {
                "max_mb": max(p),
                "mean_mb": sum(p) / len(p),
                "sum_mb": sum(p),
                "machine_rise_mb": run["machine_mem_peak_mb"] - run["machine_mem_base_mb"],
            }
    out["peak_rss"] = peaks
    saves = (runs.get("interrupted") or {}).get("saves") or []
    out["save_signal_s"] = saves[-1]["seconds"] if saves else None
    end_saves = (u or {}).get("saves") or []
    out["save_end_s"] = end_saves[-1]["seconds"] if end_saves else None
    out["build_s"] = {
        name: run["t_loop"] - run["t_topology"]
        for name, run in runs.items()
        if run.get("t_loop") is not None and run.get("t_topology") is not None
    }
    out.update(export_fig)
    out["topology"] = f"{plan['stages']} stages x {dp} data-parallel = {plan['world']} ranks"
    out["other_topology"] = f"{plan['other_stages']} stages x {other_dp} = {plan['world']} ranks"
    return out


def _s(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.2f} s" if abs(x) < 10 else f"{x:,.0f} s"


def table_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """(figure, value) rows of the report's table, the checks last."""
    plan, f = report["plan"], report["figures"]
    dp = plan["world"] // plan["stages"]
    enc, dec = plan["layers"]
    mb = plan["micro_batches"]
    mb_note = (
        "the config's own"
        if mb == plan["config_micro_batches"]
        else f"**reduced** from the config's {plan['config_micro_batches']}, for time"
    )
    shrunk = [o.removeprefix("model.") for o in plan["overrides"] if o.startswith("model.")]
    build = f.get("build_s", {})
    rows = [
        ("model", f"{enc}L-{dec}L, width shrunk: " + ", ".join(shrunk)),
        ("topology", f"{f['topology']} ({plan['world_source']})"),
        ("micro-batches per update", f"{mb} per replica x {dp} = {mb * dp} ({mb_note})"),
        (
            "other topology (check 3)",
            f"{f['other_topology']}, {other_micro_batches(plan)} micro-batches per replica",
        ),
        (
            "start-up: launch to first update logged",
            _s(f.get("startup_s"))
            + f" (rank 0 entered the training loop at {_s(f.get('loop_start_s'))})",
        ),
        (
            "time per update (median)",
            _s(f.get("update_s"))
            + f"; one process, same global batch: {_s(f.get('reference_update_s'))}",
        ),
    ]
    for name, label in (
        ("uninterrupted", "peak RSS per rank (VmHWM), real topology"),
        ("other_topology", "peak RSS per rank, other topology"),
        ("reference", "peak RSS, one process"),
    ):
        p = f["peak_rss"].get(name)
        if p:
            rows.append(
                (
                    label,
                    f"max {_mb(p['max_mb'])}, mean {_mb(p['mean_mb'])}, sum over ranks "
                    f"{_mb(p['sum_mb'])}; the machine's memory in use rose by at most "
                    f"{_mb(p['machine_rise_mb'])} (other processes included)",
                )
            )
    rows += [
        (
            "save: SIGUSR1 checkpoint; end of run",
            f"{_s(f.get('save_signal_s'))}; {_s(f.get('save_end_s'))}",
        ),
        (
            "rank 0, 'Using topology' to training loop: build + initialize (+ load)",
            f"fresh {_s(build.get('uninterrupted'))}; resumed, same topology "
            f"{_s(build.get('resumed'))}; other topology, state re-laid "
            f"{_s(build.get('other_topology'))}",
        ),
    ]
    c = f.get("checkpoint")
    if c:
        rows.append(
            (
                "checkpoint",
                f"{c['files']:,} files ({c['layer_files']:,} layer files), "
                f"{c['bytes'] / 2**20:,.1f} MiB",
            )
        )
    if "load_s" in f:
        rows.append(
            ("checksums of the whole checkpoint (every rank verifies on resume)", _s(f["verify_s"]))
        )
        rows.append(
            (
                "convert (verify + read + build); export; translate one sentence",
                f"{_s(f['load_s'])}; {_s(f.get('export_s'))} "
                f"({f.get('export_bytes', 0) / 2**20:,.1f} MiB); {_s(f.get('translate_s'))}",
            )
        )
    for check in report["checks"]:
        rows.append((check["name"], ("PASS: " if check["ok"] else "**FAIL**: ") + check["detail"]))
    return rows


def format_table(report: dict[str, Any]) -> str:
    """The report as one markdown table, the command and the CPU above it."""
    verdict = "all checks passed" if report["ok"] else "**a check failed**"
    head = [
        f"`{report['command']}`" if report["command"] else f"config {report['config']}",
        "",
        f"CPU: {report['cpu']}; {verdict}.",
        "",
        "| figure | value |",
        "| --- | --- |",
    ]
    rows = [f"| {a} | {b.replace('|', '/')} |" for a, b in table_rows(report)]
    return "\n".join(head + rows) + "\n"


def write_outputs(report: dict[str, Any], json_path: str | None, md_path: str | None) -> None:
    """Write the report as JSON and/or markdown."""
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    if md_path:
        Path(md_path).write_text(format_table(report), encoding="utf-8")


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

USAGE = """Rehearse a config at its real depth and topology, width shrunk, on gloo ranks on this machine.

    python tools/rehearse.py --config opus100_1000L --markdown rehearsal.md --json rehearsal.json
    python tools/rehearse.py --config tiny_cpu --stages 4 --world 4

Runs the config's pipeline stages x the data-parallel size of its SLURM launcher (or --world)
as plain processes, with d=16 and synthetic data, and checks: the first updates equal one
process's; SIGUSR1 saves and the same topology resumes exactly; another stage count resumes
at the step; the checkpoint converts to an export that translates. Prints one table with the
start-up time, time per update, peak memory per rank, save/resume times and checkpoint size.
Exit codes: 0 all checks passed, 1 a check failed, 2 bad input. Details: docs/rehearsal.md.
"""
"""The command line's help (``tools/rehearse.py --help``)."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line (see :data:`USAGE`)."""
    head, _, rest = USAGE.partition("\n\n")
    p = argparse.ArgumentParser(
        prog="rehearse.py",
        description=head,
        epilog=rest,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, help="shipped config name or YAML path")
    p.add_argument(
        "--world", type=int, default=None, help="ranks (default: from slurm/<config>.sh)"
    )
    p.add_argument("--stages", type=int, default=None, help="pipeline stages (default: config's)")
    p.add_argument(
        "--other-stages",
        type=int,
        default=None,
        help="stages of the resume on another topology (default: half the stages)",
    )
    p.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        help="micro-batches per update and replica (default: the config's; the table says so "
        "when reduced)",
    )
    p.add_argument("--steps", type=int, default=4, help="updates compared (default 4)")
    p.add_argument(
        "--other-steps", type=int, default=1, help="updates on the other topology (default 1)"
    )
    p.add_argument(
        "--signal-after", type=int, default=1, help="SIGUSR1 once update N is logged (default 1)"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra config override for every run (after the width-shrinking ones)",
    )
    p.add_argument("--workdir", default=None, help="default: runs/rehearse/<config>")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --workdir")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run (default 3600)")
    p.add_argument("--json", default=None, help="write the report as JSON")
    p.add_argument("--markdown", default=None, help="write the table as markdown")
    p.add_argument(
        "--evaluate-only",
        action="store_true",
        help="run no training: check and tabulate the finished rehearsal in --workdir again",
    )
    return p.parse_args(argv)


def _rehearse(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    workdir = Path(args.workdir or Path("runs") / "rehearse" / Path(args.config).stem)
    if not args.evaluate_only:
        plan = make_plan(
            args.config,
            args.set,
            world=args.world,
            stages=args.stages,
            other_stages=args.other_stages,
            micro_batches=args.micro_batches,
            steps=args.steps,
            other_steps=args.other_steps,
            signal_after=args.signal_after,
            timeout_s=args.timeout,
        )
        plan.command = shlex.join(["python", "tools/rehearse.py", *argv])
        rehearse(plan, workdir, overwrite=args.overwrite)
    report = evaluate(workdir)
    print(format_table(report), flush=True)
    write_outputs(report, args.json, args.markdown)
    return 0 if report["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point (``tools/rehearse.py``, ``mbn-rehearse``): parse, rehearse, check, print the
    table. Bad input is one line ``error: ...`` and exit 2."""
    return run_main(_rehearse, argv)


if __name__ == "__main__":
    sys.exit(main())
