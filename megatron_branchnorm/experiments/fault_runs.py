"""Shared pieces of the fault suite (tests/faults) and of the fault sweep (fault_sweep.py):
the reference configuration, a launcher of gloo ranks that can inject faults, metrics and
parameter-hash readers."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import time
from pathlib import Path

import torch

from megatron_branchnorm.experiments.fault_inject import FAULT_ENV
from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.formats.records import read_metrics, read_rows
from megatron_branchnorm.runner.launch import CHECKOUT
from megatron_branchnorm.runner.ranks import TRAINER, start_ranks, wait_ranks

INJECTOR = "megatron_branchnorm.experiments.fault_inject"
"""The module a launch with a fault runs instead of megatron_branchnorm.train."""
STEPS = 12
"""Length of the reference run; checkpoints every 4 (reference) or 2 (fault runs) updates."""
BASE = [
    "pipeline.stages=2",
    "model.encoder_layers=2",
    "model.decoder_layers=2",
    "model.dropout=0.1",
    "pipeline.activation_checkpoint_interval=1",
    "train.log_interval=1",
    "train.eval_interval=0",
    "train.collective_timeout_s=60",
]
"""A tiny deep-ish BranchNorm model with dropout and activation checkpointing on 2 stages."""
COMPARED = ("loss", "nll_loss", "lr", "alpha", "grad_norm", "ids_hash")
DP_WORLD = 4
"""pp2 x dp2: BASE's 2 stages on 4 ranks. DeepSpeed numbers rank = stage * 2 + replica, so
rank 3 is the last stage's second data-parallel replica."""
DP_STEPS = 6
DP_RUN = ["train.micro_batches=1", "train.save_interval=0"]
"""The 4-rank runs (with train.max_steps=DP_STEPS): one micro-batch per replica, so an update takes the same 2 micro-batches
from the sample stream as a 2-rank update (tiny_cpu: train.micro_batches=2)."""
EQUIV_STEPS = 3
EQUIV = ["model.dropout=0.0", "train.save_interval=0"]
"""Dropout 0 runs, on 2 ranks with 2 micro-batches and on 4 ranks with 1 per replica: the
data-parallel split must not change what an update computes."""


def launch(
    save_dir: Path, overrides: list[str], log_dir: Path, fault: str = "", world: int = 2
) -> list[subprocess.Popen]:
    """Start ``world`` ranks (as srun would, runner/ranks.py) with BASE + overrides: train.py's
    main, or with a ``fault`` (MBN_FAULT_INJECT's spec) the fault injector around it
    (fault_inject.py); each rank's output is appended to ``log_dir/rank<R>.log``."""
    args = ["--config", "tiny_cpu", *BASE, f"train.save_dir={save_dir}", *overrides]
    ranks = start_ranks(
        world,
        args,
        log_dir,
        module=INJECTOR if fault else TRAINER,
        env={FAULT_ENV: fault} if fault else None,  # rank_env gives no MBN_FAULT* variable
        cwd=CHECKOUT,
        mode="a",
    )
    return ranks.procs


def records(save_dir: Path) -> list[dict]:
    """Every metrics.jsonl row with a loss (applied updates), in file order as written (the
    steps a resume redid included; a line being written is left out)."""
    return [r for r in read_rows(save_dir) if "loss" in r]


def last_by_step(save_dir: Path) -> dict[int, dict]:
    """The row of each step's applied update the run kept (a resumed run redoes the steps
    after its checkpoint: the reader gives the latest run's)."""
    return {r["step"]: r for r in read_metrics(save_dir) if "loss" in r}


def signal_when(
    procs: list[subprocess.Popen],
    save_dir: Path,
    victim: int,
    min_rows: int,
    timeout: float = 240,
    sig: int = signal.SIGKILL,
) -> float:
    """Send ``sig`` to rank ``victim`` once ``save_dir``/metrics.jsonl has ``min_rows`` rows
    (or as soon as any rank has exited); returns the time it was sent."""
    deadline = time.time() + timeout
    while time.time() < deadline and len(records(save_dir)) < min_rows:
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.05)
    if procs[victim].poll() is None:
        os.kill(procs[victim].pid, sig)
    return time.time()


def kill_hard_when(
    procs: list[subprocess.Popen],
    save_dir: Path,
    victim: int,
    min_rows: int,
    timeout: float = 240,
    sig: int = signal.SIGKILL,
) -> tuple[float, list[int]]:
    """Send ``sig`` (SIGKILL) to rank ``victim`` once metrics.jsonl has ``min_rows`` rows;
    returns (seconds until every rank exited, exit codes)."""
    t0 = signal_when(procs, save_dir, victim, min_rows, timeout, sig)
    codes = wait_ranks(procs, timeout=180)
    return time.time() - t0, codes


def param_hash(tag_dir: Path) -> str:
    """SHA-256 over every tensor of a checkpoint's layer files (index order, sorted keys)."""
    digest = hashlib.sha256()
    for idx, path in sorted(ckpt.layer_files(tag_dir).items()):
        state = torch.load(path, map_location="cpu", weights_only=True)
        for key in sorted(state):
            digest.update(f"{idx}.{key}".encode())
            digest.update(state[key].detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def max_difference(run: Path, ref: Path, steps: range) -> dict[str, float]:
    """Largest |run - ref| per compared field over ``steps`` (ids_hash: count of mismatches)."""
    a, b = last_by_step(run), last_by_step(ref)
    out = {k: 0.0 for k in COMPARED}
    for s in steps:
        for k in COMPARED:
            if k == "ids_hash":
                out[k] += float(a[s][k] != b[s][k])
            else:
                out[k] = max(out[k], abs(a[s][k] - b[s][k]))
    return out


def kill_tree(procs: list[subprocess.Popen]) -> None:
    """Kill ranks still running (after a failed check)."""
    for p in procs:
        if p.poll() is None:
            p.kill()


def assert_matches_reference(run: Path, ref: Path, steps: int = STEPS) -> None:
    """Every step 1..steps of ``run`` equals the reference in COMPARED, and so do the final
    parameters."""
    got, want = last_by_step(run), last_by_step(ref)
    assert sorted(got) == list(range(1, steps + 1))
    for step in got:
        for key in COMPARED:
            assert got[step][key] == want[step][key], (step, key)
    tag = ckpt.tag_for(steps)
    assert param_hash(run / tag) == param_hash(ref / tag)


def handles_signal(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler installed for ``sig`` (SigCgt in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def signal_at_handler(procs: list[subprocess.Popen], victim: int, sig: int, timeout: float = 60):
    """Send ``sig`` to rank ``victim`` the moment its handler exists (while it is starting);
    returns the seconds from now until then."""
    t0 = time.time()
    pid = procs[victim].pid
    while not handles_signal(pid, sig):
        if time.time() - t0 > timeout or procs[victim].poll() is not None:
            raise RuntimeError(f"rank {victim} never installed a handler for signal {sig}")
        time.sleep(0.005)
    os.kill(pid, sig)
    return time.time() - t0
