"""metrics.jsonl across a resume from an earlier checkpoint: the file is only
appended to (a kill can land at any moment), the writer marks each restart, and the one reader
(megatron_branchnorm/formats/records.py) gives every step once, the latest run's row marked
"redone"; retention, the plots, the run comparison and the rehearsal's check read that."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_branchnorm.formats.records import (
    MetricsFileError,
    read_metrics,
    read_metrics_history,
    read_rows,
    valid_losses,
)
from megatron_branchnorm.runner.plotting import series
from megatron_branchnorm.training.metrics import (
    MetricsLog,
    Progress,
    UpdateFigures,
    first_difference,
    training_rows,
)
from megatron_branchnorm.training.retention import best_checkpoints, read_scores
from megatron_branchnorm.training.stopping import NonfiniteSkips
from megatron_branchnorm.workflows.rehearse_checks import _steps_once, read_training_rows


class Run:
    """One process of the trainer as far as metrics.jsonl goes: its writer, the training
    rows (Progress), the validation rows (as training/validation.py writes them) and the
    skipped-update rows (NonfiniteSkips); TensorBoard off."""

    def __init__(self, save_dir: Path, start: int, branch: float) -> None:
        self.metrics = MetricsLog(save_dir, is_logger=True)
        self.metrics.tb = False
        self.progress = Progress(self.metrics, log_interval=1, max_steps=100, max_time_minutes=0)
        self.skips = NonfiniteSkips(100, False, save_dir, self.metrics, is_logger=True)
        self.branch = branch  # what tells this run's rows from another's
        self.progress.start(start)

    def update(self, step: int) -> None:
        loss = self.branch + step
        figures = UpdateFigures(step, loss, loss, 1e-3, 1.0, 0.5, 1.0, 8 * step, f"h{step}", 0, 1.0)
        self.progress.write(figures)

    def validate(self, step: int) -> None:
        self.metrics.write({"step": step, "valid_loss": self.branch + step / 10})

    def skip(self, step: int) -> None:
        self.skips.stop_after_skip(
            update=step + 1, applied_updates=step, where=None, loss_scale=1.0, ids_hash="x"
        )

    def early_stop(self, step: int) -> None:
        self.metrics.write({"step": step, "early_stop": True, "best_valid_loss": 1.0})


def kill_at_17_resume_from_15(save_dir: Path, last: int = 19) -> None:
    """Steps 1-17 (validation every 5 steps and at 16 and 17, a checkpoint at 15, a skipped
    update after it), killed while writing step 18's row; restarted from the checkpoint at 15
    and run to ``last``, each row of the restart other than the first run's."""
    save_dir.mkdir(parents=True, exist_ok=True)
    first = Run(save_dir, 0, branch=0.0)
    for step in range(1, 18):
        first.update(step)
        if step % 5 == 0 or step >= 16:
            first.validate(step)
        if step == 15:
            first.skip(15)  # update 16 skipped once, after the checkpoint at 15
    with open(save_dir / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 18, "loss": 0.')  # kill -9 mid-row
    second = Run(save_dir, 15, branch=100.0)
    for step in range(16, last + 1):
        second.update(step)
        if step == 16:
            second.validate(16)


def test_each_step_once_after_a_resume_from_an_earlier_checkpoint(tmp_path):
    kill_at_17_resume_from_15(tmp_path)
    written = read_rows(tmp_path)
    assert [r["step"] for r in written if "loss" in r][14:] == [15, 16, 17, 16, 17, 18, 19]
    assert {"step": 15, "resumed_from": 15} in written  # on a line of its own after the cut

    rows = read_metrics(tmp_path, strict=True)
    train = training_rows(rows)
    assert [r["step"] for r in train] == list(range(1, 20))
    assert [(r["step"], r["loss"]) for r in train if r.get("redone")] == [(16, 116.0), (17, 117.0)]
    assert [r["loss"] for r in train[17:]] == [118.0, 119.0]  # new steps: not marked
    valid = [(r["step"], r["valid_loss"], r.get("redone")) for r in rows if "valid_loss" in r]
    assert valid == [(5, 0.5, None), (10, 1.0, None), (15, 1.5, None), (16, 101.6, True)]
    assert not [r for r in rows if r.get("skipped")]  # update 16's skip was redone as applied

    history = read_metrics_history(tmp_path)
    assert history.rows == rows and history.resumes == [15]
    lost = [(r["step"], "skipped" if r.get("skipped") else next(iter(r.keys() - {"step"})))
            for r in history.replaced if "loss" not in r]  # fmt: skip
    assert lost == [(15, "skipped"), (16, "valid_loss"), (17, "valid_loss")]
    assert [r["loss"] for r in history.replaced if "loss" in r] == [16.0, 17.0]
    assert not any("redone" in r for r in written)  # the mark is the reader's, not on disk


def test_retention_plots_and_checks_read_the_deduplicated_steps(tmp_path):
    """The restart ends at 16: step 17 of the lost run (its update and its validation) is
    gone for every reader."""
    kill_at_17_resume_from_15(tmp_path, last=16)
    assert valid_losses(tmp_path) == {5: 0.5, 10: 1.0, 15: 1.5, 16: 101.6}
    assert read_scores(tmp_path, "valid_loss", {}) == valid_losses(tmp_path)  # retention's
    ranked = best_checkpoints(["global_step15", "global_step16"], valid_losses(tmp_path), 1)
    assert ranked == [("global_step15", 1.5)]  # the lost run's 1.6 at 16 does not rank it
    steps, losses = series(read_metrics(tmp_path, strict=True), "loss")
    assert steps == list(range(1, 17)) and losses[-1] == 116.0
    assert series(read_metrics(tmp_path, strict=True), "valid_loss")[0] == [5, 10, 15, 16]
    # the rehearsal's "every step once" still catches an inexact resume (a redone update)
    problem = _steps_once(read_training_rows(tmp_path), 16)
    assert problem is not None and "redone) [16]" in problem


def test_a_resumed_run_compares_equal_to_the_uninterrupted_one(tmp_path):
    """Same updates, same rows: the marker, the lost rows and the redone mark are not part of
    what was trained (tools/compare_metrics.py)."""
    kill_at_17_resume_from_15(tmp_path / "resumed")
    (tmp_path / "whole").mkdir()
    whole = Run(tmp_path / "whole", 0, branch=0.0)
    for step in range(1, 20):
        whole.branch = 0.0 if step <= 15 else 100.0  # the resumed run's values
        whole.update(step)
        if step in (5, 10, 15, 16):
            whole.validate(step)
    assert first_difference(tmp_path / "whole", tmp_path / "resumed") is None


def test_restart_marks_skips_and_early_stops_after_the_checkpoint_obsolete(tmp_path):
    """An early stop at 4 (after its checkpoint), resumed from 4 with more patience: the
    early stop and the skipped update after the checkpoint are the lost run's; a restart
    from scratch (no checkpoint yet) drops everything before it."""
    run = Run(tmp_path, 0, branch=0.0)
    for step in range(1, 5):
        run.update(step)
    run.skip(4)
    run.early_stop(4)
    Run(tmp_path, 4, branch=1.0).update(5)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert not any(r.get("early_stop") or r.get("skipped") for r in rows)

    again = tmp_path / "again"
    again.mkdir()
    Run(again, 0, branch=0.0).update(1)
    Run(again, 0, branch=1.0).update(1)
    assert [(r["loss"], r.get("redone")) for r in read_metrics(again)] == [(2.0, True)]
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    Run(fresh, 0, branch=0.0).update(1)
    assert "resumed_from" not in (fresh / "metrics.jsonl").read_text()  # nothing to mark


def test_a_file_from_before_the_markers_still_reads_each_step_once(tmp_path):
    steps = [14, 15, 16, 17, 16, 17, 18, 19]
    rows = [{"step": s, "loss": float(i)} for i, s in enumerate(steps)]
    rows.insert(4, {"step": 16, "valid_loss": 9.0})
    rows.append({"step": 16, "valid_loss": 3.0})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = read_metrics(tmp_path, strict=True)
    assert [(r["step"], r["loss"]) for r in training_rows(got)] == [
        (14, 0.0), (15, 1.0), (16, 4.0), (17, 5.0), (18, 6.0), (19, 7.0)
    ]  # fmt: skip
    assert [r["step"] for r in got if r.get("redone")] == [16, 17, 16]
    assert valid_losses(tmp_path) == {16: 3.0}


def test_a_malformed_marker_is_named_or_skipped(tmp_path):
    text = '{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 2.0}\n{"step": 1, "resumed_from": "1"}\n'
    (tmp_path / "metrics.jsonl").write_text(text)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    with pytest.raises(MetricsFileError, match=r"metrics.jsonl:3: 'resumed_from' must be a step"):
        read_metrics(tmp_path, strict=True)
    # strict: a cut line is a kill's remains only where a restart's marker follows it
    text = '{"step": 1, "loss": 1.0}\n{"step": 2, "lo\n{"step": 2, "loss": 2.0}\n'
    (tmp_path / "metrics.jsonl").write_text(text)
    with pytest.raises(MetricsFileError, match=r"metrics.jsonl:2: not a JSON object"):
        read_metrics(tmp_path, strict=True)
