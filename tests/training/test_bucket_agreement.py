"""Every rank derives the bucket shapes and their order itself, and the pipeline then sends
tensors of those shapes without their sizes (docs/design.md §18); NCCL checks no message size,
so ranks that derived different shapes would hang or read garbage. The trainer compares every
rank's (``trainer.agree_on_shapes``, one object all-gather) before the first update and stops
every rank with one line naming the ranks that differ.

Ranks here are :class:`TrainStream` objects on the synthetic task (tiny_cpu), as each stage
and data-parallel replica builds its own; the 2-rank check runs the ranks as threads of this
process exchanging through a stand-in for the object all-gather, and the real gloo collective
at world size 1.
"""

from __future__ import annotations

import concurrent.futures
import threading

import pytest
import torch

from megatron_branchnorm.config import load_config
from megatron_branchnorm.training import collectives
from megatron_branchnorm.training.data import TrainStream, shape_disagreement


def _stream(*overrides: str, dp: int = 1, dp_id: int = 0, reads_data: bool = True):
    return TrainStream(load_config("tiny_cpu", list(overrides)), dp, dp_id, reads_data)


def _shapes(identity: dict) -> str:
    return f"{identity['shapes']} bucket shapes with digest {identity['digest']}"


def test_every_stage_and_replica_derives_the_same_shapes() -> None:
    """3 stages x 2 data-parallel replicas: the first and last stages from their epoch plans,
    the middle stage from the plan of the shapes alone; the same from a resumed position."""
    streams = [
        (stage, _stream(dp=2, dp_id=d, reads_data=stage != 1))
        for d in range(2)
        for stage in range(3)
    ]
    gathered = [(stage, s.shape_identity()) for stage, s in streams]
    assert gathered[0][1]["shapes"] > 1
    assert shape_disagreement(gathered) is None
    saved = {**streams[0][1].state_dict(), "epoch": 1, "position": 6}  # rank 0's, as saved
    for _, s in streams:
        s.load_state_dict(saved)
    resumed = [(stage, s.shape_identity()) for stage, s in streams]
    assert resumed[0][1]["epoch"] == 1 and resumed[0][1] != gathered[0][1]
    assert shape_disagreement(resumed) is None


def test_a_rank_with_other_shapes_is_named() -> None:
    ours = _stream().shape_identity()
    other = _stream("data.max_tokens=1024").shape_identity()
    assert other["digest"] != ours["digest"]
    line = shape_disagreement([(0, ours), (1, other), (1, ours)])
    assert line is not None and "\n" not in line
    assert f"rank 1 (stage 1) derived {_shapes(other)}, where " in line
    assert f"rank 0 (stage 0) derived {_shapes(ours)};" in line
    assert "rank 2" not in line and "data.bucket_shapes" in line


def test_ranks_with_another_order_of_the_same_shapes_are_named() -> None:
    """Another seed cuts the same shapes in another order: the line says the order differs."""
    ours = _stream().shape_identity()
    other = _stream("train.seed=7").shape_identity()
    assert other["digest"] == ours["digest"] and other["order"] != ours["order"]
    line = shape_disagreement([(0, ours), (0, other), (1, ours), (1, other)])
    assert f"ranks 1, 3 (stages 0, 1) derived epoch 0's order of {other['batches']} " in line
    assert f"digest {other['order']}" in line and f"digest {ours['order']}" in line


def test_without_bucket_shapes_the_ranks_agree_and_a_mix_is_named() -> None:
    off = [_stream("data.bucket_shapes=0", reads_data=r).shape_identity() for r in (True, False)]
    assert off == [{"shapes": 0}, {"shapes": 0}]
    assert shape_disagreement([(0, off[0]), (1, off[1])]) is None
    ours = _stream().shape_identity()
    line = shape_disagreement([(0, ours), (1, off[1])])
    assert "rank 1 (stage 1) derived no bucket shapes (data.bucket_shapes=0" in line
    assert f"rank 0 (stage 0) derived {_shapes(ours)};" in line


class _ThreadRanks:
    """Ranks as threads of this process: the object all-gather of training/collectives.py."""

    def __init__(self, ranks: int) -> None:
        self.barrier = threading.Barrier(ranks, timeout=60)
        self.slots: list = [None] * ranks
        self.local = threading.local()
        self.calls = 0

    def all_gather_object(self, obj, group=None):  # noqa: ANN001, ARG002
        self.calls += 1
        self.slots[self.local.rank] = obj
        self.barrier.wait()
        gathered = list(self.slots)
        self.barrier.wait()  # every rank has read the slots before they are written again
        return gathered


def test_two_ranks_stop_with_the_same_line_naming_the_one_that_differs(monkeypatch) -> None:
    """Rank 1 (stage 1) is fed other shapes: both ranks raise the same TrainError, after one
    all-gather each; with the same shapes both go on."""
    from megatron_branchnorm.training import trainer
    from megatron_branchnorm.training.stopping import TrainError

    world = _ThreadRanks(2)
    monkeypatch.setattr(collectives, "all_gather_object", world.all_gather_object)
    streams = {
        "same": [_stream(), _stream(reads_data=False)],
        "other": [_stream(), _stream("data.max_tokens=1024", reads_data=False)],
    }

    def rank_main(rank: int, case: str) -> str | None:
        world.local.rank = rank
        try:
            trainer.agree_on_shapes(streams[case][rank], stage=rank)
        except TrainError as exc:
            return str(exc)
        return None

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        same = list(pool.map(rank_main, range(2), ["same"] * 2))
        other = list(pool.map(rank_main, range(2), ["other"] * 2))
    assert same == [None, None]
    assert other[0] == other[1] and other[0] is not None
    theirs = streams["other"][1].shape_identity()
    assert f"rank 1 (stage 1) derived {_shapes(theirs)}, where rank 0 (stage 0)" in other[0]
    assert world.calls == 4  # one gather per rank and check


def test_the_check_is_one_gloo_all_gather(monkeypatch) -> None:
    """Through the real collective (gloo, a world of one): one call, and the stream agrees
    with itself."""
    from megatron_branchnorm.training import trainer

    calls = []
    gather = collectives.all_gather_object
    monkeypatch.setattr(
        collectives, "all_gather_object", lambda obj: calls.append(obj) or gather(obj)
    )
    store = torch.distributed.HashStore()
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        trainer.agree_on_shapes(_stream(), stage=0)
    finally:
        torch.distributed.destroy_process_group()
    assert len(calls) == 1 and calls[0][1]["shapes"] > 1


def test_many_differing_ranks_stay_one_short_line() -> None:
    ours = _stream().shape_identity()
    other = _stream("data.max_tokens=1024").shape_identity()
    line = shape_disagreement([(0, ours)] + [(r % 4, other) for r in range(1, 20)])
    assert "ranks 1, 2, 3, 4, 5, 6, 7, 8 and 11 more (stages 1, 2, 3, 0, 1, 2, 3, 0)" in line
    assert len(line) < 600


def test_the_trainer_checks_before_its_first_update(tmp_path, monkeypatch) -> None:
    """The real trainer (tiny_cpu, 1 stage, in this process): the check gets the stream's
    shapes, and a disagreement ends the run before any ``train_batch``."""
    import signal

    from megatron_branchnorm.training import trainer as trainer_module
    from megatron_branchnorm.training.stop_signals import STOP_SIGNALS
    from megatron_branchnorm.training.stopping import TrainError
    from tests.core.helpers import one_rank_process_group

    seen = []

    def disagree(gathered):  # noqa: ANN001
        seen.append(gathered)
        return "rank 1 (stage 1) derived other shapes"

    monkeypatch.setattr(trainer_module, "shape_disagreement", disagree)
    overrides = ["pipeline.stages=1", "model.encoder_layers=1", "model.decoder_layers=1",
                 "train.max_steps=2", "train.save_interval=0", "train.eval_interval=0",
                 f"train.save_dir={tmp_path / 'run'}"]  # fmt: skip
    handlers = {sig: signal.getsignal(sig) for sig in (*STOP_SIGNALS, signal.SIGINT)}
    try:
        with one_rank_process_group():
            trainer = trainer_module.Trainer(load_config("tiny_cpu", overrides))
            batches = []
            trainer.engine.train_batch = lambda *a, **k: batches.append(1)
            with pytest.raises(TrainError, match=r"^rank 1 \(stage 1\) derived other shapes$"):
                trainer.train()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert batches == []
    assert seen == [[(0, trainer.stream.shape_identity())]] and seen[0][0][1]["shapes"] > 1
