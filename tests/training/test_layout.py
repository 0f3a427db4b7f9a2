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
    # 2 replicas x 6 micro-batches saved; 3 replicas now: 4 each (the reported example)
    saved = SavedBatch(micro_batches=6, data_parallel=2)
    got = choose_layout(_cfg("pipeline.stages=1", "train.micro_batches=6"), 3, AMPLE, saved)
    assert (got.stages, got.data_parallel, got.micro_batches) == (1, 3, 4)
    assert "train.micro_batches 6 -> 4" in got.note and "12 micro-batches per update" in got.note
    # a config that changes train.micro_batches from the checkpoint's changes the global batch
    got = choose_layout(_cfg("pipeline.stages=1", "train.micro_batches=5"), 3, AMPLE, saved)
    assert got.micro_batches == 5
    assert got.note.startswith("the global batch changes from the checkpoint's 12 to 15 ")


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


def test_a_fresh_start_keeps_the_configs_global_batch():
    """pipeline.data_parallel=2: 64 x 2 = 128 micro-batches per update on every allocation, as a
    resume keeps the checkpoint's (1 stage x 24 took 64 each, 12x the batch)."""
    cfg = _cfg(
        "pipeline.stages=16",
        "train.micro_batches=64",
        "pipeline.data_parallel=2",
        "pipeline.fallback_stages=auto",
    )
    layouts = {w: choose_layout(cfg, w, AMPLE, None) for w in (16, 24, 32, 64)}
    got = {w: (x.stages, x.data_parallel, x.micro_batches) for w, x in layouts.items()}
    # 24: 1, 2 stages (dp 24, 12) cannot share 128; 3 x 8 is the fewest stages that can
    assert got == {16: (16, 1, 128), 24: (3, 8, 16), 32: (16, 2, 64), 64: (16, 4, 32)}
    assert layouts[32].note is None
    assert "train.micro_batches 64 -> 32: the config's 128 micro-batches per update" in (
        layouts[64].note
    )
    assert "pipeline.stages=16 does not divide the world size 24" in layouts[24].note
    # a resume keeps the config's batch too (the checkpoint's was the same: no change noted)
    again = choose_layout(cfg, 24, AMPLE, SavedBatch(micro_batches=64, data_parallel=2))
    assert (again.stages, again.micro_batches) == (3, 16) and "changes" not in again.note


def test_a_global_batch_no_layout_can_share_is_one_line(monkeypatch):
    """6 micro-batches per update on 5 ranks: only 5 stages x 1 could share them, and it does
    not fit; and without pipeline.data_parallel a fresh start has no batch to keep when the
    configured stages do not divide the world size."""
    monkeypatch.setattr(layout, "_fits", lambda cfg, w, d, s, m: s < 5)
    cfg = _cfg(
        "pipeline.stages=2",
        "train.micro_batches=3",
        "pipeline.data_parallel=2",
        "pipeline.fallback_stages=auto",
    )
    with pytest.raises(ConfigError) as exc:
        choose_layout(cfg, 5, AMPLE, None)
    line = str(exc.value)
    assert "\n" not in line and "pipeline.stages=2 does not divide the world size 5" in line
    assert line.endswith("that fit 5 ranks and keep 6 micro-batches per update: none")
    unset = _cfg("pipeline.stages=2", "train.micro_batches=3", "pipeline.fallback_stages=auto")
    with pytest.raises(ConfigError) as exc:
        choose_layout(unset, 5, AMPLE, None)
    line = str(exc.value)
    assert "\n" not in line and line.startswith("config key pipeline.data_parallel: not set")
    assert choose_layout(unset, 4, AMPLE, None).micro_batches == 3  # stages divide: as configured


@pytest.mark.parametrize("value", ["abc", "0", "12,", "auto,8", "-4"])
def test_fallback_stages_is_checked(value):
    with pytest.raises(ConfigError, match="pipeline.fallback_stages"):
        _cfg(f"pipeline.fallback_stages={value}")
