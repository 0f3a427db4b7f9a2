"""tools/convert_checkpoint.py on checkpoints written by the 2-stage harness run."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from megatron_branchnorm.inference.convert import ConvertError, load_pipeline_checkpoint
from megatron_branchnorm.inference.export import load_export
from megatron_branchnorm.model import build_model, fold_to_postln
from megatron_branchnorm.synthetic import SyntheticData, collate
from tests.pipeline.conftest import ROOT

CONVERT = str(ROOT / "tools" / "convert_checkpoint.py")


def _batch(vocab: int) -> dict:
    return collate(SyntheticData(16, vocab, 20), list(range(6)))


def test_convert_round_trip_matches_checkpoint(harness, tmp_path):
    out = tmp_path / "export"
    proc = subprocess.run([sys.executable, CONVERT, "--checkpoint", str(harness / "full"),
                           "--output", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    model, meta = load_pipeline_checkpoint(harness / "full")
    assert meta["tag"] == "global_step20" and meta["pipeline_stages"] == 2
    assert model.step == 20
    exported, _, export_meta = load_export(out)
    b = _batch(model.cfg.vocab_size)
    with torch.no_grad():
        ref = model(b["src_tokens"], b["prev_output_tokens"])
        got = exported.eval()(b["src_tokens"], b["prev_output_tokens"])
    # BranchNorm at alpha = 20/100 folded into Post-LN: 1e-6 (DESIGN.md §10), relative to scale
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
    with pytest.raises(ConvertError, match="layer_03-model_states.pt: checksum mismatch"):
        load_pipeline_checkpoint(bad)
    layer.unlink()
    proc = subprocess.run([sys.executable, CONVERT, "--checkpoint", str(bad), "--output",
                           str(tmp_path / "x")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "layer_03-model_states.pt: missing" in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "x").exists()
