"""Each rank builds only the batches it reads: the training stream's plans against
the whole-epoch plan that every rank built before, at several data-parallel sizes, through
epoch boundaries and a resume on another data-parallel size (docs/design.md §15)."""

from __future__ import annotations

import hashlib
from itertools import islice

import numpy as np
import pytest

from megatron_branchnorm.config import load_config
from megatron_branchnorm.data.dataset import BatchSampler, TranslationData, id_fingerprints
from megatron_branchnorm.training.data import TrainStream, build_batches

MAX_TOKENS = 300


def _cfg(data_dir, micro_batches: int, dataset: str | None = None, *extra: str):
    return load_config(
        "tiny_cpu",
        [
            f"data.dataset={dataset or data_dir}",
            f"data.max_tokens={MAX_TOKENS}",
            "data.max_length=64",
            f"train.micro_batches={micro_batches}",
            *extra,
        ],
    )


def _reference(cfg, n: int) -> list[dict]:
    """The first ``n`` batches of the global stream, as one whole-epoch sampler yields them."""
    return list(islice(iter(build_batches(cfg, "train", shuffle=True)), n))


def _ids(batch) -> list[int]:
    return batch["ids"].tolist()


@pytest.mark.parametrize(("dp", "gas"), [(1, 2), (2, 1), (2, 3), (3, 2)])
def test_each_rank_reads_its_share_of_the_global_stream(small_data, dp, gas) -> None:
    """Over more than two epochs, data-parallel rank d's micro-batches are slots
    [d*gas, (d+1)*gas) of each update of the one global stream; the update's totals and
    ids_hash are those of all its G = gas x dp batches; a plan holds the samples of this
    rank's batches only."""
    data_dir, _ = small_data
    cfg = _cfg(data_dir, gas)
    per_update = gas * dp
    first = build_batches(cfg, "train", shuffle=True).batches_per_epoch(0)
    updates = (2 * first) // per_update + 3  # into the third epoch
    ref = _reference(cfg, updates * per_update)
    streams = [TrainStream(cfg, dp, d) for d in range(dp)]
    for u in range(updates):
        glob = ref[u * per_update : (u + 1) * per_update]
        ids = np.concatenate([_ids(b) for b in glob]).astype(np.int64)
        for d, stream in enumerate(streams):
            update = stream.next_update()
            assert [_ids(b) for b in update.mine] == [
                _ids(b) for b in glob[d * gas : (d + 1) * gas]
            ]
            assert update.target_tokens == sum(b["ntokens"] for b in glob)
            assert update.all_tokens == sum(b["ntokens"] + b["src_ntokens"] for b in glob)
            assert update.samples == ids.size
            prints = [id_fingerprints(_ids(b)).sum(dtype=np.uint64) for b in glob]
            want = hashlib.sha256(np.asarray(prints, dtype="<u8").tobytes()).hexdigest()[:16]
            assert update.ids_hash == want
            plan = stream._plan
            slots = [((p + stream._slot0) % per_update) // gas for p in range(len(plan))]
            assert sorted(plan.mine) == [p for p, slot in enumerate(slots) if slot == d]
            assert len(plan.mine) <= -(-len(plan) // per_update) * gas
    assert streams[0].epoch == 2


def test_a_stage_without_data_builds_nothing(small_data) -> None:
    """Without bucket shapes (with them it follows the shapes: tests/data/test_buckets.py)."""
    cfg = _cfg(small_data[0], 2, None, "data.bucket_shapes=0")
    stream = TrainStream(cfg, 2, 1, reads_data=False)
    update = stream.next_update()
    assert stream.source is None and update.mine == [] and update.target_tokens == 0
    assert "reads no batches" in stream.describe()
    assert stream.direction_counts() is None


def test_resume_on_another_data_parallel_size(small_data) -> None:
    """A checkpoint is taken between updates: a stream saved at dp=2 continues at dp=3 with the
    global batch that follows, across the epoch boundary."""
    data_dir, _ = small_data
    cfg = _cfg(data_dir, 2)
    first = build_batches(cfg, "train", shuffle=True).batches_per_epoch(0)
    done = first // 4 - 1  # updates of 4 batches: the next 3-replica updates cross the epoch
    ref = _reference(cfg, done * 4 + 12 * 6)
    saved = TrainStream(cfg, 2, 0)
    for _ in range(done):
        saved.next_update()
    state = saved.state_dict()
    streams = [TrainStream(cfg, 3, d) for d in range(3)]
    for s in streams:
        s.load_state_dict(state)
    for u in range(12):
        start = done * 4 + u * 6
        for d, s in enumerate(streams):
            want = ref[start + 2 * d : start + 2 * d + 2]
            assert [_ids(b) for b in s.next_update().mine] == [_ids(b) for b in want]


def test_epoch_plan_is_the_whole_plan(small_data) -> None:
    """epoch_plan, built a direction at a time, holds exactly the batches of the plan every rank
    built before, in the same order, with their sizes."""
    data = TranslationData(str(small_data[0]), max_length=64)
    sampler = BatchSampler(data, MAX_TOKENS, 5.0, seed=7)
    for epoch in (0, 3):
        whole = sampler._plan(epoch)
        plan = sampler.epoch_plan(epoch, lambda pos: np.ones(pos.size, dtype=bool))
        assert len(plan) == len(whole) == len(plan.mine)
        for p, (g, idx) in enumerate(whole):
            assert plan.mine[p][0] == g and np.array_equal(plan.mine[p][1], idx)
            batch = data.collate(g, idx)
            assert plan.ntokens[p] == batch["ntokens"] and plan.samples[p] == idx.size
            assert plan.src_ntokens[p] == batch["src_ntokens"]


def test_direction_counts_and_synthetic_data(small_data) -> None:
    data_dir, _ = small_data
    directions, counts = TrainStream(_cfg(data_dir, 1), 1, 0).direction_counts()
    assert directions == ["de-en", "en-de", "en-fr", "fr-en"] and sum(counts) > 0
    cfg = _cfg(None, 2, dataset="synthetic")
    ref = _reference(cfg, 40)
    streams = [TrainStream(cfg, 2, d) for d in range(2)]
    for u in range(10):
        for d, s in enumerate(streams):
            mine = [_ids(b) for b in s.next_update().mine]
            assert mine == [_ids(b) for b in ref[4 * u + 2 * d : 4 * u + 2 * d + 2]]
    assert streams[0].direction_counts() is None


def test_next_epoch_is_built_ahead_on_a_thread(small_data) -> None:
    """The step never builds a plan after the first: epoch e + 1 is built on the builder
    thread while epoch e is read."""
    import threading

    cfg = _cfg(small_data[0], 1)
    stream = TrainStream(cfg, 2, 0)
    built = []
    plan_of = stream.source.epoch_plan

    def recording(epoch, keep):
        built.append((epoch, threading.current_thread() is threading.main_thread()))
        return plan_of(epoch, keep)

    stream.source.epoch_plan = recording
    while stream.epoch < 3:
        stream.next_update()
    assert built[0] == (0, True)
    assert [e for e, _ in built[1:4]] == [1, 2, 3]  # (and epoch 4's may have started)
    assert not any(on_main for _, on_main in built[1:])
