"""The trainer ends its process group itself (training.trainer.run): left to the interpreter's exit,
gloo's threads sometimes abort the rank with "terminate called without an active exception"
(exit -6 instead of 0 or 75)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_branchnorm.training import trainer as trainer_mod


class _FakeTrainer:
    def __init__(self, cfg, outcome):
        self.outcome = outcome

    def train(self) -> int:
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


@pytest.mark.parametrize(
    ("outcome", "destroyed"),
    [(0, True), (75, True), (trainer_mod.TrainError("agreed"), True), (OSError("mine"), False)],
)
def test_run_destroys_the_process_group_when_ranks_end_together(monkeypatch, outcome, destroyed):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # port held
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        monkeypatch.setattr(trainer_mod, "Trainer", lambda cfg: _FakeTrainer(cfg, outcome))
        if isinstance(outcome, BaseException):
            with pytest.raises(type(outcome)):
                trainer_mod.run(None)
        else:
            assert trainer_mod.run(None) == outcome
        assert dist.is_initialized() is not destroyed
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_train_py_exit_code_survives_a_failing_interpreter_teardown(tmp_path):
    """Whatever breaks after main() returned (here an atexit abort standing in for the C++
    thread that aborted ranks) cannot change train.py's exit code."""
    script = Path(__file__).resolve().parents[2] / "megatron_branchnorm" / "train.py"
    code = (
        "import atexit, os, runpy, sys; atexit.register(os.abort); "
        f"sys.argv = [{str(script)!r}, '--config', 'no_such_config']; "
        f"runpy.run_path({str(script)!r}, run_name='__main__')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path
    )
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-500:])
    assert proc.stderr.startswith("error: ") and "no_such_config" in proc.stderr
