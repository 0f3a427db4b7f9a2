"""Counts that would make one update or the start-up endless are refused in one line naming
the key (config.py, training/data.TrainStream.update_too_large), and a stop signal ends a long
update's drawing: the run checkpoints its last update and exits with the requeue code, as a
stop signal after an update does (training/data.STOP_CHECK_DRAWS, training/trainer.py)."""

from __future__ import annotations

import json
import signal

import pytest

from megatron_branchnorm.config import ConfigError, load_config
from megatron_branchnorm.training import data as train_data
from megatron_branchnorm.training import stop_signals
from megatron_branchnorm.training.data import TrainStream
from megatron_branchnorm.training.exit_codes import REQUEUE_EXIT_CODE


@pytest.mark.parametrize(
    ("override", "key", "words"),
    [
        (
            "pipeline.data_parallel=2147483647",
            "pipeline.data_parallel",
            "4,294,967,294 micro-batches per update (train.micro_batches 2 x "
            "pipeline.data_parallel 2,147,483,647), more than 2,147,483,647",
        ),
        (
            "pipeline.data_parallel=3000",
            "pipeline.data_parallel",
            "an update takes 6,000 micro-batches (train.micro_batches 2 x pipeline.data_parallel"
            " 3,000), more than the 4,000 sentence pairs",
        ),
        ("train.micro_batches=4001", "train.micro_batches", "4,001 micro-batches"),
        ("model.encoder_layers=2147483647", "model.encoder_layers", "must be <= 10,000"),
        ("model.decoder_layers=10001", "model.decoder_layers", "must be <= 10,000, got 10,001"),
        ("data.synthetic_size=2147483647", "data.synthetic_size", "must be <= 1,000,000"),
        ("data.max_tokens=2147483647", "data.max_tokens", "more than the 104,000 that all"),
    ],
)
def test_an_endless_count_is_refused_in_one_line(override, key, words):
    with pytest.raises(ConfigError) as exc:
        load_config("tiny_cpu", [override])
    line = str(exc.value)
    assert "\n" not in line and line.startswith(f"config key {key}: ") and words in line


def test_the_largest_counts_that_fit_are_taken():
    load_config("tiny_cpu", ["train.micro_batches=2", "pipeline.data_parallel=2000"])
    load_config("tiny_cpu", ["model.encoder_layers=10000", "data.synthetic_size=1000000"])


def test_an_update_larger_than_the_epoch_is_refused_naming_both_numbers():
    """More micro-batches per update than one epoch holds batches (config.py cannot see the
    epoch of a DATA_DIR): one line naming the key, the update's count and the epoch's."""
    cfg = load_config("tiny_cpu", ["pipeline.data_parallel=2"])
    fits = TrainStream(cfg, 2, 0)
    batches = len(fits._current())
    assert fits.update_too_large() is None
    per_replica = batches // 2 + 1
    cfg = load_config(
        "tiny_cpu", [f"train.micro_batches={per_replica}", "pipeline.data_parallel=2"]
    )
    line = TrainStream(cfg, 2, 0).update_too_large()
    assert line == (
        f"config key pipeline.data_parallel: an update takes {2 * per_replica:,} micro-batches "
        f"({per_replica:,} on each of 2 data-parallel replicas), more than the {batches:,} "
        "batches one epoch of the training data holds; lower train.micro_batches or "
        "pipeline.data_parallel (which fix the micro-batches per update), or train on more data"
    )
    unset = load_config("tiny_cpu", [f"train.micro_batches={batches + 1}"])
    assert (
        TrainStream(unset, 1, 0)
        .update_too_large()
        .startswith("config key train.micro_batches: an update takes")
    )
    follower = TrainStream(unset, 2, 1, reads_data=False)  # follows the bucket shapes
    assert follower.update_too_large() is not None
    off = load_config("tiny_cpu", [f"train.micro_batches={batches + 1}", "data.bucket_shapes=0"])
    assert TrainStream(off, 2, 1, reads_data=False).update_too_large() is None  # builds no plan


def test_a_stream_asks_for_a_stop_at_the_same_draws_reading_or_not(monkeypatch):
    """Every rank asks at the same draws (a collective), reading data or not; an update of
    up to STOP_CHECK_DRAWS micro-batches never asks."""
    monkeypatch.setattr(train_data, "STOP_CHECK_DRAWS", 4)
    asked = {True: 0, False: 0}
    cfg = load_config("tiny_cpu", ["train.micro_batches=10", "data.bucket_shapes=0"])
    for reads in (True, False):
        stream = TrainStream(cfg, 1, 0, reads, lambda r=reads: asked.__setitem__(r, asked[r] + 1))
        assert stream.next_update() is not None
    assert asked == {True: 2, False: 2}  # at draws 4 and 8 of 10
    short = load_config("tiny_cpu", ["train.micro_batches=4"])
    stream = TrainStream(short, 1, 0, stop_requested=lambda: pytest.fail("asked"))
    assert len(stream.next_update().mine) == 4


def test_a_stop_signal_ends_a_long_drawing_with_a_checkpoint_and_exit_75(
    tmp_path, monkeypatch, capsys
):
    """A real trainer on one rank, 12 micro-batches per update, asking every 4 draws: the
    signal recorded at the 3rd draw of update 2 ends the drawing at its 4th, before any of
    update 2 runs. The run saves update 1's checkpoint (the stream at update 2's first
    batch), logs the line a stop after an update logs, releases run.lock and exits 75; the
    draws after the signal are bounded by STOP_CHECK_DRAWS, whatever the update's size."""
    from megatron_branchnorm.data.synthetic import SyntheticBatches
    from megatron_branchnorm.formats import checkpoint as ckpt
    from megatron_branchnorm.training import trainer
    from megatron_branchnorm.training.run_lock import LOCK_NAME
    from tests.core.helpers import one_rank_process_group

    check_every, micro, signal_at = 4, 12, 12 + 3
    monkeypatch.setattr(train_data, "STOP_CHECK_DRAWS", check_every)
    draws = {"n": 0, "at_signal": None}
    collate = SyntheticBatches.collate

    def counting_collate(self, group, indices):
        draws["n"] += 1
        if draws["n"] == signal_at:
            stop_signals._record(signal.SIGTERM, None)  # as the handler records SIGTERM
            draws["at_signal"] = draws["n"]
        return collate(self, group, indices)

    monkeypatch.setattr(SyntheticBatches, "collate", counting_collate)
    cfg = load_config("tiny_cpu", [f"train.save_dir={tmp_path}", "train.max_steps=4",
                                   f"train.micro_batches={micro}", "train.eval_interval=0",
                                   "train.save_interval=0", "train.log_interval=1"])  # fmt: skip
    stop_signals.clear()
    try:
        with one_rank_process_group():
            code = trainer.run(cfg)
    finally:
        stop_signals.clear()
    assert code == REQUEUE_EXIT_CODE
    assert 0 < draws["n"] - draws["at_signal"] < check_every  # stopped at the next check
    assert ckpt.read_latest(tmp_path) == "global_step1"
    record = json.loads((tmp_path / "global_step1" / "train_config.json").read_text())
    assert record["sampler"]["position"] == micro  # update 2 starts the resumed run
    assert not (tmp_path / LOCK_NAME).exists()
    out = capsys.readouterr().out
    assert f"signal received: checkpoint saved, exiting {REQUEUE_EXIT_CODE}" in out
