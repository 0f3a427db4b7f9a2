"""tools/convert_checkpoint.py on checkpoints written by the 2-stage harness run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from megatron_branchnorm.data.synthetic import SyntheticData, collate
from megatron_branchnorm.formats.checkpoint import CheckpointError
from megatron_branchnorm.inference.convert import load_pipeline_checkpoint
from megatron_branchnorm.inference.export import load_export
from megatron_branchnorm.model import build_model, fold_to_postln
from tests.pipeline.conftest import ROOT

CONVERT = str(ROOT / "tools" / "convert_checkpoint.py")


def _batch(vocab: int) -> dict:
    return collate(SyntheticData(16, vocab, 20), list(range(6)))


def test_convert_round_trip_matches_checkpoint(harness, tmp_path):
    out = tmp_path / "export"
    proc = subprocess.run(
        [sys.executable, CONVERT, "--checkpoint", str(harness / "full"), "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    model, meta = load_pipeline_checkpoint(harness / "full")
    assert meta["tag"] == "global_step20" and meta["pipeline_stages"] == 2
    assert model.step == 20
    exported, _, export_meta = load_export(out)
    b = _batch(model.cfg.vocab_size)
    with torch.no_grad():
        ref = model(b["src_tokens"], b["prev_output_tokens"])
        got = exported.eval()(b["src_tokens"], b["prev_output_tokens"])
    # BranchNorm at alpha = 20/100 folded into Post-LN: 1e-6 (docs/design.md §5), relative to scale
    assert (ref - got).abs().max() <= 1e-5 * ref.abs().max()
    assert exported.cfg.residual == "postln"
    # the flat model built from the checkpoint has trained (non-initial) weights
    fresh = build_model(model.cfg, seed=1)
    assert not torch.equal(fresh.embedding.weight, model.embedding.weight)
    assert fold_to_postln(model).cfg.residual == "postln"


def test_checkpoints_average(harness):
    model, meta = load_pipeline_checkpoint(harness / "resume", "global_step20", average_last=2)
    assert meta["averaged"] == ["global_step10", "global_step20"]
    m10, _ = load_pipeline_checkpoint(harness / "resume", "global_step10")
    m20, _ = load_pipeline_checkpoint(harness / "resume", "global_step20")
    expect = (m10.embedding.weight.double() + m20.embedding.weight.double()) / 2
    assert torch.allclose(model.embedding.weight.double(), expect, atol=1e-7)


def test_corrupt_or_missing_layer_file_is_named(harness, tmp_path):
    src = harness / "full"
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    layer = bad / "global_step20" / "layer_03-model_states.pt"
    data = bytearray(layer.read_bytes())
    data[len(data) // 2] ^= 0xFF
    layer.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="layer_03-model_states.pt: checksum mismatch"):
        load_pipeline_checkpoint(bad)
    layer.unlink()
    proc = subprocess.run(
        [sys.executable, CONVERT, "--checkpoint", str(bad), "--output", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "layer_03-model_states.pt: missing" in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "x").exists()


def test_repartitioned_checkpoint_exports_identically(harness, tmp_path):
    one = tmp_path / "one_stage"
    run = [sys.executable, CONVERT, "--checkpoint", str(harness / "full")]
    assert (
        subprocess.run(
            [*run, "--repartition", "1", "--output", str(one)], capture_output=True, timeout=300
        ).returncode
        == 0
    )
    info = json.loads((one / "global_step20" / "train_config.json").read_text())
    assert info["parts"] == [0, 17] and info["repartitioned"]
    for src, out in ((harness / "full", tmp_path / "e2"), (one, tmp_path / "e1")):
        proc = subprocess.run(
            [sys.executable, CONVERT, "--checkpoint", str(src), "--output", str(out)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
    # docs/design.md §5: exports of the same weights saved as 1 and as 2 stages: identical bytes
    for name in ("model.safetensors", "config.yaml"):
        assert (tmp_path / "e1" / name).read_bytes() == (tmp_path / "e2" / name).read_bytes()


def test_resume_with_another_stage_count(harness, tmp_path):
    """A 2-stage checkpoint resumed by a single process: weights, Adam's state, step, data
    position and LR schedule continue (docs/design.md §17; exactness: test_relayout.py)."""
    run = tmp_path / "run"
    shutil.copytree(harness / "full", run)
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "megatron_branchnorm" / "train.py"),
            "--config",
            "tiny_cpu",
            "model.dropout=0.0",
            "train.max_steps=22",
            f"train.save_dir={run}",
            "train.log_interval=1",
            "train.save_interval=0",
            "train.eval_interval=0",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "in another layout" in proc.stdout and "re-laid per parameter" in proc.stdout
    assert "start fresh" not in proc.stdout
    rows = [json.loads(x) for x in open(run / "metrics.jsonl")]
    rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in rows][-3:] == [20, 21, 22]
    full = {r["step"]: r for r in rows[:20]}
    # the schedule continues: tiny_cpu warms up over 20 updates, then lr * sqrt(20 / t)
    assert rows[-2]["lr"] == pytest.approx(full[20]["lr"] * (20 / 21) ** 0.5, rel=1e-6)
    assert rows[-2]["alpha"] == pytest.approx(0.21)
    # the resumed model starts where the 2-stage one ended: loss close to its last value
    assert abs(rows[-2]["loss"] - full[20]["loss"]) < 0.5
    assert (run / "global_step22" / "checksums.json").is_file()
