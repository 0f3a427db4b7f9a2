"""Ctrl-C during a save, and a resume with nothing left to train."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_branchnorm.experiments.fault_inject import SAVE_POINTS
from megatron_branchnorm.experiments.fault_runs import handles_signal
from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.training.run_lock import LOCK_NAME
from tests.faults.common import TRAIN
from tests.faults.test_misuse_train import error_line, train
from tests.pipeline.conftest import ROOT

pytestmark = pytest.mark.faults


@pytest.mark.parametrize("point", [p for p in SAVE_POINTS if p != "after_manifest"])
def test_ctrl_c_during_a_save_keeps_nothing_half_written(tmp_path: Path, point: str) -> None:
    """The line says "nothing half-written was kept": the unfinished tag is gone and
    ``latest`` names the last complete checkpoint."""
    save_dir = tmp_path / "run"
    overrides = ["train.max_steps=4", "train.save_interval=1"]
    ((code, _, stderr),) = train(save_dir, overrides, fault=f"save_interrupt@{point}:step2")
    assert code == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    assert "interrupted (Ctrl-C): nothing half-written was kept" in stderr
    assert not (save_dir / ckpt.tag_for(2)).exists()
    assert ckpt.checkpoint_tags(save_dir) == ([ckpt.tag_for(1)], [])
    assert ckpt.read_latest(save_dir) == ckpt.tag_for(1)
    assert not (save_dir / LOCK_NAME).exists()


def test_a_resume_with_nothing_left_to_train_says_so(tmp_path: Path) -> None:
    save_dir = tmp_path / "run"
    ((code, _, stderr),) = train(save_dir, ["train.max_steps=3", "train.save_interval=0"])
    assert code == 0, stderr[-3000:]
    ((code, stdout, stderr),) = train(save_dir, ["train.max_steps=2", "train.save_interval=0"])
    assert code == 0, stderr[-3000:]
    assert "nothing to train: the run is at step 3 and train.max_steps is 2" in stdout
    assert ckpt.read_latest(save_dir) == ckpt.tag_for(3)


def test_a_resume_whose_data_parallel_size_cannot_keep_the_global_batch_is_one_line(
    tmp_path: Path,
) -> None:
    """A bf16 + ZeRO-1 checkpoint of 2 replicas x 1 micro-batch (2 per update) resumed on 3
    ranks at 1 stage: 3 replicas cannot share 2 micro-batches per update. One line names the
    layouts that would keep them (docs/design.md §17), and nothing is written; the
    checkpoint's own 2 ranks still resume it, at another data-parallel size than 3."""
    save_dir = tmp_path / "run"
    bf16 = ["train.deepspeed_config=ds_configs/zero1_bf16.json", "pipeline.stages=1"]
    saved = train(save_dir, [*bf16, "train.max_steps=1", "train.micro_batches=1"], world=2)
    assert [code for code, _, _ in saved] == [0, 0], saved[0][2][-3000:]
    before = sorted(p.name for p in save_dir.iterdir())
    results = train(save_dir, [*bf16, "train.max_steps=2", "train.micro_batches=1"], world=3)
    line = error_line(results[0])
    assert "does not divide the checkpoint's 2 micro-batches per update" in line, line
    assert "3 x 1 (2 micro-batches)" in line, line
    assert sorted(p.name for p in save_dir.iterdir()) == before


def _wait_for_the_stop_signal_handlers(proc: subprocess.Popen) -> None:
    """Return once train.py has run ``stop_signals.install()``, the first thing its code does
    (SIGTERM, which Python leaves alone, is then caught: /proc/PID/status's SigCgt). From there
    on a Ctrl-C is train.py's to handle; before it, Python is still starting, which is not."""
    while proc.poll() is None:
        if handles_signal(proc.pid, signal.SIGTERM):
            return
        time.sleep(0.001)  # a poll of the event, not a delay the verdict depends on
    raise AssertionError(f"train.py exited {proc.returncode} before it installed its handlers")


@pytest.mark.parametrize("after_s", [0.0, 0.1, 0.3, 0.6, 1.0, 2.0])
def test_ctrl_c_while_train_imports_is_one_line(tmp_path: Path, after_s: float) -> None:
    """Wherever the interrupt lands in starting up (our imports, then torch, NumPy and
    DeepSpeed's, which swallow a KeyboardInterrupt in places: NumPy was left without
    ``multiply``, a traceback, exit 1), it ends the run with one line and exit 130. The
    interrupt comes ``after_s`` past the event that train.py handles signals (not a delay from
    the process's start, which at 0.1 s once landed in Python's own start-up beside other
    jobs); each delay only moves where it lands, and the run is too long to end first."""
    proc = subprocess.Popen(
        [sys.executable, TRAIN, "--config", "tiny_cpu", f"train.save_dir={tmp_path / 'run'}",
         "train.max_steps=100000"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal has it
    )  # fmt: skip
    _wait_for_the_stop_signal_handlers(proc)
    time.sleep(after_s)  # where it lands; any place past the event must give the same verdict
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == "interrupted (Ctrl-C): nothing half-written was kept"
