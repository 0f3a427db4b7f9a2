"""Early stopping on the validation loss (train.patience, megatron_branchnorm/training/patience.py) and
the time left in the console line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.training.metrics import format_eta
from megatron_branchnorm.training.patience import Patience

ROOT = Path(__file__).resolve().parents[2]
TRAIN = str(ROOT / "megatron_branchnorm" / "train.py")


def test_patience_counts_validations_without_improvement():
    p = Patience(2)
    assert [p.update(s, v) for s, v in ((1, 5.0), (2, 4.0), (3, 4.0), (4, 3.9), (5, 4.1))] == [
        False, False, False, False, False,
    ]  # fmt: skip
    assert p.update(6, 3.95) is True and (p.best, p.best_step) == (3.9, 4)
    off = Patience(0)
    assert not any(off.update(s, 9.0 + s) for s in range(9))  # 0: never stops


def test_restore_ignores_what_a_killed_run_logged_after_the_checkpoint():
    p = Patience(3)
    p.restore({2: 5.0, 4: 5.5, 6: 6.0, 8: 1.0}, up_to=6)
    assert (p.best, p.best_step, p.since_best) == (5.0, 2, 2)


def test_format_eta():
    assert format_eta(0) == "0:00:00"
    assert format_eta(3725.4) == "1:02:05"
    assert format_eta(2 * 86400 + 61) == "2d 0:01:01"


def _train(save_dir: Path, steps: int) -> subprocess.CompletedProcess:
    # a learning rate of ~1e-14 over the first updates: the weights (and the validation
    # loss) do not change, so no validation improves on the first
    proc = subprocess.run(
        [sys.executable, TRAIN, "--config", "tiny_cpu", f"train.save_dir={save_dir}",
         f"train.max_steps={steps}", "train.eval_interval=1", "train.patience=2",
         "train.lr=1e-9", "train.warmup_init_lr=0", "train.warmup_steps=100000",
         "train.save_interval=0", "train.log_interval=1", "model.dropout=0"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_early_stop_saves_and_ends_the_run_also_across_a_resume(tmp_path):
    full = _train(tmp_path / "full", 20)
    assert (
        "early stop at step 3: no improvement of the validation loss in 2 validations"
        in full.stdout
    )
    stop = [r for r in _rows(tmp_path / "full") if r.get("early_stop")]
    assert stop == [{"step": 3, "early_stop": True, "best_valid_loss": stop[0]["best_valid_loss"], "best_step": 1}]  # fmt: skip
    assert ckpt.read_latest(tmp_path / "full") == "global_step3"
    # the console line and metrics.jsonl say how long is left (none at the end)
    assert " | eta 0:" in full.stdout
    updates = [r for r in _rows(tmp_path / "full") if "loss" in r]
    assert all(r["eta_s"] >= 0 for r in updates)
    # stopped after 2 updates (one validation without improvement), then requeued
    _train(tmp_path / "split", 2)
    resumed = _train(tmp_path / "split", 20)
    assert "early stop at step 3" in resumed.stdout
    assert ckpt.read_latest(tmp_path / "split") == "global_step3"
