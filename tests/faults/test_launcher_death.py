"""The launcher's death stops its ranks (stop_signals.watch_launcher).

``timeout``, ``kill``, a container stop or a non-SLURM scheduler end a job by signalling the
``deepspeed`` command alone: it exits 143 without passing the signal on. Its
``deepspeed.launcher.launch`` child and the ranks must not train on, holding ``run.lock``: each
rank checkpoints and exits 75, as on SIGTERM. Run with the real launcher and 2 ranks.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.formats.records import read_metrics
from megatron_branchnorm.runner.launch import quiet_ports
from megatron_branchnorm.training.run_lock import LOCK_NAME
from tests.faults.common import TRAIN
from tests.pipeline.conftest import ROOT

pytestmark = pytest.mark.faults


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait(predicate, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.5)
    return predicate()


def test_killing_the_deepspeed_command_checkpoints_and_stops_the_ranks(tmp_path: Path) -> None:
    deepspeed = shutil.which("deepspeed", path=str(Path(sys.executable).parent))
    assert deepspeed is not None
    save_dir = tmp_path / "run"
    cmd = [
        deepspeed, "--num_gpus", "2", "--master_port", str(quiet_ports(1)), TRAIN,
        "--config", "tiny_cpu", "pipeline.stages=2", "train.max_steps=100000",
        "train.log_interval=1", "train.eval_interval=0", "train.save_interval=0",
        f"train.save_dir={save_dir}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = tmp_path / "log"
    with log.open("w") as out:
        # its own session: the launcher and the ranks stay findable as one process group
        runner = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        assert _wait(lambda: len(read_metrics(save_dir)) >= 3, 240), log.read_text()[-3000:]
        runner.send_signal(signal.SIGTERM)  # the deepspeed command alone, as `kill` does
        assert runner.wait(timeout=60) != 0
        # the launcher and both ranks end by themselves (the watch polls once a second)
        assert _wait(lambda: not _group_alive(runner.pid), 120), log.read_text()[-3000:]
    finally:
        if _group_alive(runner.pid):
            os.killpg(runner.pid, signal.SIGKILL)
    text = log.read_text()
    assert text.count("stopping as on SIGTERM (checkpoint, exit 75)") == 2, text[-3000:]
    assert "signal received: checkpoint saved, exiting 75" in text
    assert "exits with return code = 75" in text  # DeepSpeed's launcher reports its ranks
    tag = ckpt.read_latest(save_dir)
    assert tag is not None and (save_dir / tag / ckpt.MANIFEST).is_file()
    steps = [r["step"] for r in read_metrics(save_dir) if "loss" in r]
    assert ckpt.tag_step(tag) == steps[-1]  # the last update is in the checkpoint
    assert not (save_dir / LOCK_NAME).exists()  # released: a requeue can start at once
