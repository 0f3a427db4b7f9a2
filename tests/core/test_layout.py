"""The layout a run takes on the ranks it got (training/layout.py, docs/design.md §17)."""

from __future__ import annotations

import pytest

from megatron_branchnorm.config import ConfigError, load_config
from megatron_branchnorm.training import layout
from megatron_branchnorm.training.layout import Device, SavedBatch, choose_layout

AMPLE = Device(memory=1e15, overhead=0.0)


def _cfg(*overrides: str):
    return load_config(
        "tiny_cpu", ["model.encoder_layers=20", "model.decoder_layers=20", *overrides]
    )


def test_the_configured_layout_when_it_fits_the_world():
    got = choose_layout(_cfg("pipeline.stages=2", "train.micro_batches=3"), 4, AMPLE, None)
    assert (got.stages, got.data_parallel, got.micro_batches, got.note) == (2, 2, 3, None)


def test_a_resume_keeps_the_micro_batches_per_update():
    # 2 replicas x 6 micro-batches saved; 3 replicas now: 4 each (the example)
    saved = SavedBatch(micro_batches=6, data_parallel=2)
    got = choose_layout(_cfg("pipeline.stages=1", "train.micro_batches=6"), 3, AMPLE, saved)
    assert (got.stages, got.data_parallel, got.micro_batches) == (1, 3, 4)
    assert "train.micro_batches 6 -> 4" in got.note and "12 micro-batches per update" in got.note
    # a config that changes train.micro_batches from the checkpoint's changes the global batch
    got = choose_layout(_cfg("pipeline.stages=1", "train.micro_batches=5"), 3, AMPLE, saved)
    assert got.micro_batches == 5 and got.note is None


def test_a_requeue_onto_fewer_nodes_takes_a_fallback_that_fits(monkeypatch):
    """16 x 2 saved with 64 micro-batches per replica; requeued onto 24 ranks. Under auto the
    fewest stages whose data-parallel size divides 128 and that the planner says fit."""
    saved = SavedBatch(micro_batches=64, data_parallel=2)
    base = ["pipeline.stages=16", "train.micro_batches=64"]
    fits = []
    monkeypatch.setattr(layout, "_fits", lambda cfg, w, d, s, m: fits.append(s) or s >= 12)
    got = choose_layout(_cfg(*base, "pipeline.fallback_stages=auto"), 24, AMPLE, saved)
    assert (got.stages, got.data_parallel, got.micro_batches) == (12, 2, 64)
    assert fits == [
        3,
        6,
        12,
    ]  # 1, 2, 4 and 8 stages cannot share 128 micro-batches (dp 24, 12, 6, 3)
    assert "pipeline.stages=16 does not divide the world size 24" in got.note
    assert got.partition == "balanced"
    got = choose_layout(_cfg(*base, "pipeline.fallback_stages=24,12"), 24, AMPLE, saved)
    assert (got.stages, got.micro_batches) == (24, 128)


def test_no_layout_allowed_names_those_that_would_fit(monkeypatch):
    saved = SavedBatch(micro_batches=64, data_parallel=2)
    monkeypatch.setattr(layout, "_fits", lambda cfg, w, d, s, m: s >= 12)
    with pytest.raises(ConfigError) as exc:
        choose_layout(_cfg("pipeline.stages=16", "train.micro_batches=64"), 24, AMPLE, saved)
    line = str(exc.value)
    assert "\n" not in line
    assert "pipeline.stages=16 does not divide the world size 24" in line
    assert "12 x 2 (64 micro-batches), 24 x 1 (128 micro-batches)" in line
    assert "pipeline.fallback_stages=auto" in line


def test_the_planner_decides_what_fits():
    """Real planner figures: a device too small for any stage of the model refuses."""
    saved = SavedBatch(micro_batches=2, data_parallel=2)
    cfg = _cfg("pipeline.stages=3", "train.micro_batches=2", "pipeline.fallback_stages=auto")
    got = choose_layout(cfg, 4, AMPLE, saved)  # 3 does not divide 4: 1 stage x 4 fits
    assert (got.stages, got.data_parallel, got.micro_batches) == (1, 4, 1)
    with pytest.raises(
        ConfigError, match="that fit 4 ranks and keep 4 micro-batches per update: none"
    ):
        choose_layout(cfg, 4, Device(memory=1e3, overhead=0.0), saved)


@pytest.mark.parametrize("value", ["abc", "0", "12,", "auto,8", "-4"])
def test_fallback_stages_is_checked(value):
    with pytest.raises(ConfigError, match="pipeline.fallback_stages"):
        _cfg(f"pipeline.fallback_stages={value}")
