"""Checkpoint retention (megatron_branchnorm/training/retention.py): keep the last K and the best N,
never the checkpoint a resume loads, the same after a preemption and resume."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_branchnorm.config import ConfigError, load_config
from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.formats.records import (
    BEST_FILE,
    append_bleu_row,
    valid_losses,
    validation_bleus,
)
from megatron_branchnorm.training.retention import (
    apply_retention,
    best_checkpoints,
    checkpoints_to_remove,
)

ROOT = Path(__file__).resolve().parents[2]
TRAIN = str(ROOT / "megatron_branchnorm" / "train.py")


def tags(*steps: int) -> list[str]:
    return [ckpt.tag_for(s) for s in steps]


def test_keep_last_and_best_never_what_a_resume_loads():
    complete = tags(2, 4, 6, 8, 10)
    # keep_last 0: keep everything
    assert checkpoints_to_remove(complete, [], "global_step10", 0, []) == []
    assert checkpoints_to_remove(complete, [], "global_step10", 2, []) == tags(2, 4, 6)
    # the best and the one latest names survive even when older than the last K
    assert checkpoints_to_remove(complete, [], "global_step4", 1, ["global_step2"]) == tags(6, 8)
    # incomplete: older than the newest kept = a killed save's remains; newer = being written
    assert checkpoints_to_remove(tags(2, 4), tags(3, 5), "global_step4", 1, []) == tags(2, 3)


def test_best_by_valid_loss_at_the_checkpoints_step(tmp_path):
    rows = [
        {"step": 2, "valid_loss": 5.0},
        {"step": 3, "loss": 4.0},
        {"step": 4, "valid_loss": 4.5},
        {"step": 6, "valid_loss": 4.5},
        {"step": 8, "valid_loss": float("nan")},
    ]
    text = "\n".join(json.dumps(r) for r in rows) + '\n{"step": 10, "valid_lo'  # cut by a kill
    (tmp_path / "metrics.jsonl").write_text(text)
    losses = valid_losses(tmp_path)
    assert losses == {2: 5.0, 4: 4.5, 6: 4.5}
    # ties go to the earlier step; unscored checkpoints (no validation at their step) never
    assert best_checkpoints(tags(2, 4, 5, 6, 8), losses, 2) == [("global_step4", 4.5), ("global_step6", 4.5)]  # fmt: skip


def test_apply_removes_whole_directories_and_records_the_best(tmp_path):
    for step in (2, 4, 6, 8):
        (tmp_path / ckpt.tag_for(step)).mkdir()
        (tmp_path / ckpt.tag_for(step) / "layer_00-model_states.pt").write_bytes(b"x")
        (tmp_path / ckpt.tag_for(step) / ckpt.MANIFEST).write_text("{}")
    (tmp_path / "global_step3").mkdir()  # a killed save
    (tmp_path / ".removing-global_step1").mkdir()  # a pass killed while deleting
    ckpt.write_latest(tmp_path, "global_step8")
    rows = [{"step": s, "valid_loss": v} for s, v in ((2, 3.0), (4, 5.0), (6, 4.0), (8, 6.0))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    removed, line = apply_retention(tmp_path, keep_last=1, keep_best=1)
    assert removed == tags(4, 6, 3)
    left = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert left == tags(2, 8)
    best = json.loads((tmp_path / BEST_FILE).read_text())
    entry = {"tag": "global_step2", "valid_loss": 3.0, "checkpoint_id": ckpt.checkpoint_id(tmp_path / "global_step2")}  # fmt: skip
    assert best == {"metric": "valid_loss", "checkpoints": [entry]}
    assert "removed global_step4, global_step6, global_step3" in line


def test_keep_best_needs_validation_at_the_saves():
    with pytest.raises(ConfigError, match="train.keep_best: needs train.eval_interval"):
        load_config("tiny_cpu", ["train.keep_best=1", "train.save_interval=4", "train.eval_interval=3"])  # fmt: skip
    with pytest.raises(ConfigError, match="train.keep_last: must be >= 0"):
        load_config("tiny_cpu", ["train.keep_last=-1"])
    load_config("tiny_cpu", ["train.keep_best=1", "train.save_interval=4", "train.eval_interval=2"])  # fmt: skip


def _train(save_dir: Path, steps: int) -> str:
    proc = subprocess.run(
        [sys.executable, TRAIN, "--config", "tiny_cpu", f"train.save_dir={save_dir}",
         f"train.max_steps={steps}", "train.save_interval=2", "train.eval_interval=2",
         "train.keep_last=2", "train.keep_best=1", "train.log_interval=1"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def test_a_run_keeps_the_last_two_and_the_best_across_a_preemption(tmp_path):
    full, split = tmp_path / "full", tmp_path / "split"
    out = _train(full, 10)
    _train(split, 5)  # stopped early (as by a preemption) with an extra end-of-run save
    assert (split / "global_step5").is_dir()
    _train(split, 10)  # the requeued job
    losses = valid_losses(full)
    best = min(losses, key=lambda s: (losses[s], s))
    expected = sorted({8, 10, best})
    for run in (full, split):
        complete, incomplete = ckpt.checkpoint_tags(run)
        assert complete == tags(*expected) and not incomplete
        assert json.loads((run / BEST_FILE).read_text())["checkpoints"][0]["tag"] == ckpt.tag_for(best)  # fmt: skip
    assert valid_losses(split) == losses  # the resume was exact: the same best
    assert "retention (keep_last=2, keep_best=1): removed global_step2" in out or best == 2


def test_convert_the_best_or_the_average_of_the_best(tmp_path):
    """--tag best and --average-best K read best.json; the average is the mean of the K."""
    import torch

    from megatron_branchnorm.inference.convert import load_pipeline_checkpoint, resolve_tags

    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, TRAIN, "--config", "tiny_cpu", f"train.save_dir={run}",
         "train.max_steps=6", "train.save_interval=2", "train.eval_interval=2",
         "train.keep_best=2", "train.log_interval=1"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    best = [c["tag"] for c in json.loads((run / BEST_FILE).read_text())["checkpoints"]]
    assert len(best) == 2 and len(ckpt.checkpoint_tags(run)[0]) == 3  # keep_last 0: all kept
    assert resolve_tags(run, "best") == best[:1]
    averaged, meta = load_pipeline_checkpoint(run, average_best=2)
    assert meta["averaged"] == sorted(best, key=ckpt.tag_step)
    one = [load_pipeline_checkpoint(run, tag=t)[0].state_dict() for t in best]
    for key, value in averaged.state_dict().items():
        assert torch.allclose(value, (one[0][key] + one[1][key]) / 2, atol=1e-7), key
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"), "--checkpoint", str(run),
         "--average-best", "3", "--output", str(tmp_path / "exp")],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 2 and "--average-best 3 but best.json names 2" in out.stderr


DEV = {
    "split": "dev",
    "sentences": 200,
    "references_sha256": "ab12",
    "beam": 4,
    "bleu": "sacrebleu",
}
"""A scoring object as the companion writes it (inference/valid_bleu.py::scoring_of)."""


def fake_checkpoints(run: Path, *steps: int) -> None:
    """Complete checkpoints whose manifests (so ids) differ, ``latest`` at the last."""
    for step in steps:
        (run / ckpt.tag_for(step)).mkdir()
        (run / ckpt.tag_for(step) / ckpt.MANIFEST).write_text(json.dumps({"step": step}))
    ckpt.write_latest(run, ckpt.tag_for(steps[-1]))


def bleu_rows(run: Path, scores: dict[int, float], scoring: dict | None = None) -> None:
    """The companion's rows for the checkpoints now at these steps, scored as ``scoring``."""
    for step, bleu in scores.items():
        tag = ckpt.tag_for(step)
        row = {"step": step, "tag": tag, "checkpoint_id": ckpt.checkpoint_id(run / tag)}
        append_bleu_row(run, {**row, "scoring": scoring or DEV, "valid_bleu": bleu})


def best_json(run: Path) -> list[tuple[str, float]]:
    record = json.loads((run / BEST_FILE).read_text())
    return [(c["tag"], c["valid_bleu"]) for c in record["checkpoints"]]


def test_best_by_valid_bleu_keeps_the_highest_and_what_awaits_scoring(tmp_path):
    fake_checkpoints(tmp_path, 2, 4, 6, 8, 10)
    # the companion has scored 2, 4 and 6 (valid_bleu.jsonl); 8 and 10 await it
    bleu_rows(tmp_path, {2: 10.0, 4: 30.0, 6: 20.0})
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 4, "valid_loss": 9.0}) + "\n")
    removed, line = apply_retention(tmp_path, keep_last=1, keep_best=1, metric="valid_bleu")
    assert removed == tags(2, 6)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == tags(10, 4, 8)
    best = json.loads((tmp_path / BEST_FILE).read_text())
    assert best == {"metric": "valid_bleu", "checkpoints": [{"tag": "global_step4", "valid_bleu": 30.0, "checkpoint_id": ckpt.checkpoint_id(tmp_path / "global_step4")}]}  # fmt: skip
    assert "best by valid_bleu: global_step4 (30.0000)" in line
    assert "2 checkpoints await their validation BLEU" in line
    # once 8 and 10 are scored, only the last and the best stay
    bleu_rows(tmp_path, {8: 5.0, 10: 25.0})
    removed, _ = apply_retention(tmp_path, keep_last=1, keep_best=1, metric="valid_bleu")
    assert removed == tags(8)
    assert best_checkpoints(tags(4, 10), {4: 30.0, 10: 25.0}, 2, higher_is_better=True) == [
        ("global_step4", 30.0),
        ("global_step10", 25.0),
    ]


def test_valid_bleu_ranks_by_the_dev_split_under_one_scoring(tmp_path):
    """A companion run with --split test wrote rows for the same steps; keep_best
    ranked by them (the last row of a step won). Only dev rows rank, under one scoring; rows
    of an older companion (no key) never do."""
    fake_checkpoints(tmp_path, 2, 4, 6)
    bleu_rows(tmp_path, {2: 10.0, 4: 30.0, 6: 20.0})  # the companion's dev rows
    bleu_rows(tmp_path, {2: 50.0, 4: 12.0, 6: 11.0}, {**DEV, "split": "test"})
    bleu_rows(tmp_path, {6: 90.0}, {**DEV, "sentences": 10})  # a one-off look, other options
    append_bleu_row(tmp_path, {"step": 2, "valid_bleu": 99.0, "split": "dev"})  # unkeyed
    steps = {s: ckpt.checkpoint_id(tmp_path / ckpt.tag_for(s)) for s in (2, 4, 6)}
    assert validation_bleus(tmp_path, steps) == {2: 10.0, 4: 30.0, 6: 20.0}
    removed, line = apply_retention(tmp_path, keep_last=1, keep_best=2, metric="valid_bleu")
    assert best_json(tmp_path) == [("global_step4", 30.0), ("global_step6", 20.0)]
    assert removed == tags(2) and "best by valid_bleu: global_step4 (30.0000)" in line


def test_a_rewritten_checkpoint_loses_its_score_for_retention_and_convert(tmp_path):
    """After a rollback (global_step6 deleted, latest at 4, trained to 6 again) the
    deleted branch's BLEU ranked the new step 6. A score counts only for the checkpoint it
    scored; a best.json written before the rewrite is refused by convert."""
    from megatron_branchnorm.inference.convert import ConvertError, resolve_tags

    fake_checkpoints(tmp_path, 2, 4, 6)
    bleu_rows(tmp_path, {2: 10.0, 4: 20.0, 6: 30.0})
    apply_retention(tmp_path, keep_last=0, keep_best=1, metric="valid_bleu")
    assert best_json(tmp_path) == [("global_step6", 30.0)]
    assert resolve_tags(tmp_path, "best") == tags(6)
    # the rollback: global_step6 deleted, latest at 4, and step 6 saved again (other contents)
    shutil.rmtree(tmp_path / "global_step6")
    ckpt.write_latest(tmp_path, "global_step4")
    with pytest.raises(ConvertError, match="not a complete checkpoint"):
        resolve_tags(tmp_path, "best")
    fake_checkpoints(tmp_path, 6)
    (tmp_path / "global_step6" / ckpt.MANIFEST).write_text(json.dumps({"step": 6, "new": 1}))
    with pytest.raises(ConvertError, match=r"best.json: ranks a global_step6 that has been rewritten"):  # fmt: skip
        resolve_tags(tmp_path, "best")
    # the new step 6 is unscored: it waits for the companion and never takes the old score
    removed, line = apply_retention(tmp_path, keep_last=1, keep_best=1, metric="valid_bleu")
    assert best_json(tmp_path) == [("global_step4", 20.0)]
    assert removed == tags(2)
    assert resolve_tags(tmp_path, "best") == tags(4)
    assert resolve_tags(tmp_path, None, average_best=1) == tags(4)
    # scored, it ranks by its own row
    bleu_rows(tmp_path, {6: 25.0})
    apply_retention(tmp_path, keep_last=1, keep_best=1, metric="valid_bleu")
    assert best_json(tmp_path) == [("global_step6", 25.0)]


def test_best_metric_is_checked():
    with pytest.raises(ConfigError, match="train.best_metric: must be valid_loss or valid_bleu"):
        load_config("tiny_cpu", ["train.best_metric=bleu"])
    # BLEU comes from the companion for every checkpoint: no validation interval needed
    cfg = load_config("tiny_cpu", ["train.keep_best=1", "train.best_metric=valid_bleu", "train.save_interval=4", "train.eval_interval=3"])  # fmt: skip
    assert cfg.train.best_metric == "valid_bleu"
