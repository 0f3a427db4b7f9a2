"""Static shapes (docs/design.md §18): micro-batches cut into a few bucket shapes
chosen from the lengths, the padding bound, every sentence once per epoch, the stages that
read no data following the shapes, exact resume, and padding rows that carry nothing."""

from __future__ import annotations

from itertools import islice

import numpy as np
import pytest
import torch

from megatron_branchnorm.config import ConfigError, load_config
from megatron_branchnorm.data.buckets import (
    AUTO_MAX_SHAPES,
    TARGET_PADDING,
    Buckets,
    LengthHistogram,
    choose_buckets,
)
from megatron_branchnorm.data.dataset import BatchSampler, DataError
from megatron_branchnorm.tokens import PAD_ID
from megatron_branchnorm.training.data import BucketedSyntheticBatches, TrainStream, build_batches

MAX_TOKENS = 1024


class Lengths:
    """A SampleSource of lengths only: 4 directions whose sentence pairs differ in length
    ratio (source longer, shorter, equal), spread as real sentences are (a skewed length, a
    noisy ratio); 20,000 pairs, tensor lengths at most 66."""

    def __init__(self, sizes=(8000, 6000, 4000, 2000)) -> None:
        ratios = [(1.25, 0.8, 1.0, 1.1)[g % 4] for g in range(len(sizes))]
        self.directions = ["a-en", "en-a", "b-en", "en-b"][: len(sizes)] + [
            f"x{g}-en" for g in range(4, len(sizes))
        ]
        rng = np.random.default_rng(5)
        self._lengths = []
        for n, ratio in zip(sizes, ratios, strict=True):
            tgt = np.clip(rng.lognormal(2.6, 0.5, n).astype(np.int64), 1, 64)
            src = np.clip((tgt * ratio * rng.lognormal(0, 0.2, n)).astype(np.int64), 1, 64)
            self._lengths.append((src + 2, tgt + 1))
        self._offsets = np.concatenate([[0], np.cumsum(sizes)])

    def group_indices(self, g: int) -> np.ndarray:
        return np.arange(self._lengths[g][0].size, dtype=np.int64)

    def group_lengths(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        return self._lengths[g]

    def sample_offset(self, g: int) -> int:
        return int(self._offsets[g])

    def collate(self, g, indices: np.ndarray) -> dict:
        """The lengths of samples ``indices`` of direction ``g`` (one, or each sample's)."""
        g = np.broadcast_to(g, np.shape(indices))
        src_len, tgt_len = (
            np.array([self._lengths[d][side][i] for d, i in zip(g, indices, strict=True)])
            for side in (0, 1)
        )
        return {"ids": indices + self._offsets[g], "src_len": src_len, "tgt_len": tgt_len}


def _everything(pos: np.ndarray) -> np.ndarray:
    return np.ones(pos.size, dtype=bool)


def _fits(sampler: BatchSampler, plan) -> None:
    """Every batch of ``plan`` fits its bucket's shape (rows, source, target)."""
    buckets = sampler.buckets
    for p, (g, idx) in plan.mine.items():
        batch = sampler.collate(g, idx)
        shape = buckets.shapes[plan.shapes[p]]
        assert 1 <= idx.size <= shape.rows, (p, idx.size, shape)
        assert batch["src_len"].max() <= shape.src_len
        assert batch["tgt_len"].max() <= shape.tgt_len
        assert shape.rows * max(shape.src_len, shape.tgt_len) <= MAX_TOKENS


def test_padding_bound_and_shapes():
    """auto: at most AUTO_MAX_SHAPES shapes, each within max_tokens, the lengths' padding at
    most the target and the padding measured over an epoch's batches at most 10%."""
    data = Lengths()
    sampler = BatchSampler(data, MAX_TOKENS, 5.0, seed=3, max_shapes=AUTO_MAX_SHAPES)
    buckets = sampler.buckets
    assert 1 < len(buckets) <= AUTO_MAX_SHAPES
    assert buckets.length_padding <= TARGET_PADDING
    plan = sampler.epoch_plan(0, _everything)
    _fits(sampler, plan)
    real = int(plan.ntokens.sum() + plan.src_ntokens.sum())
    share = buckets.padding_share(plan.shapes, real)
    assert share <= 0.10, (share, buckets.describe())
    # fewer shapes pad more; 0 is no buckets at all
    few = BatchSampler(data, MAX_TOKENS, 5.0, seed=3, max_shapes=4).buckets
    assert len(few) == 4 and few.length_padding > buckets.length_padding
    assert BatchSampler(data, MAX_TOKENS, 5.0, seed=3).buckets is None


def test_every_sentence_once_per_epoch_in_a_seeded_order():
    """At temperature 1 an epoch holds every sentence once, in buckets; the epoch's batches
    are those of the whole-epoch plan in the same order; the shapes alone (a stage that reads
    no data, keeping no per-sample array) are the same; another seed, another order."""
    data = Lengths()
    sampler = BatchSampler(data, MAX_TOKENS, 1.0, seed=3, max_shapes=16)
    for epoch in (0, 1):
        plan = sampler.epoch_plan(epoch, _everything)
        ids = np.concatenate([data.collate(g, idx)["ids"] for g, idx in plan.mine.values()])
        assert np.array_equal(np.sort(ids), np.arange(20000))
        whole = sampler._plan(epoch)
        assert len(whole) == len(plan)
        for p, (g, idx) in enumerate(whole):
            assert np.array_equal(plan.mine[p][0], g) and np.array_equal(plan.mine[p][1], idx)
        follower = BatchSampler(data, MAX_TOKENS, 1.0, seed=3, max_shapes=16, keep_keys=False)
        assert np.array_equal(follower.epoch_shapes(epoch).shapes, plan.shapes)
        _fits(sampler, plan)
    other = BatchSampler(data, MAX_TOKENS, 1.0, seed=4, max_shapes=16).epoch_plan(0, _everything)
    assert not np.array_equal(other.fingerprints, sampler.epoch_plan(0, _everything).fingerprints)


def test_many_small_directions_share_their_last_batches():
    """30 directions of 300-1,200 sentences: most of a direction's buckets hold less than one
    micro-batch. What each leaves over in a bucket is pooled with the other directions'
    (batches of several directions, each giving fewer sentences than the shape's rows), so
    the epoch pads at most 10% as the model predicts, where batches kept to one direction
    padded 20% (docs/design.md §18). Every sentence still trained once."""
    data = Lengths(sizes=tuple(range(300, 1201, 31)))
    sampler = BatchSampler(data, MAX_TOKENS, 1.0, seed=3, max_shapes=AUTO_MAX_SHAPES)
    plan = sampler.epoch_plan(0, _everything)
    _fits(sampler, plan)
    buckets = sampler.buckets
    real = int(plan.ntokens.sum() + plan.src_ntokens.sum())
    share = buckets.padding_share(plan.shapes, real)
    assert share <= 0.10, (share, buckets.describe())
    ids = np.concatenate([data.collate(g, idx)["ids"] for g, idx in plan.mine.values()])
    assert np.array_equal(np.sort(ids), np.arange(sum(range(300, 1201, 31))))
    pooled = [(p, g) for p, (g, _) in plan.mine.items() if np.ndim(g) == 1]
    assert pooled and all(np.unique(g).size > 1 for _, g in pooled)
    for p, g in pooled:
        rows = buckets.shapes[plan.shapes[p]].rows
        assert np.bincount(g).max() < rows  # a direction's leftover, not a full batch of it


def test_resume_from_before_pooled_last_batches_is_refused():
    """A position saved when each direction kept its leftovers apart (no bucket_tails) would
    read other batches in this cut: refused in one line."""
    sampler = BatchSampler(Lengths(), MAX_TOKENS, 5.0, seed=3, max_shapes=8)
    state = sampler.state_dict()
    assert state["bucket_tails"] == "pooled"
    BatchSampler(Lengths(), MAX_TOKENS, 5.0, seed=3, max_shapes=8).load_state_dict(state)
    old = {k: v for k, v in state.items() if k != "bucket_tails"}
    with pytest.raises(DataError, match="pooled across directions"):
        BatchSampler(Lengths(), MAX_TOKENS, 5.0, seed=3, max_shapes=8).load_state_dict(old)


def test_choice_is_integer_and_deterministic():
    """Weights are integers (the same shapes on every machine); a direction drawn more
    weighs more; a cell that rounds to 0 is still held by a shape."""
    hist = LengthHistogram()
    hist.add(np.array([5, 5, 9]), np.array([4, 4, 30]), drawn=1, usable=1000)
    assert hist.weights.dtype == np.int64 and hist.weights[5, 4] == 1 and hist.weights[9, 30] == 1
    data = Lengths()
    a = BatchSampler(data, MAX_TOKENS, 5.0, seed=3, max_shapes=12).buckets
    b = BatchSampler(data, MAX_TOKENS, 5.0, seed=9, max_shapes=12).buckets
    assert a.shapes == b.shapes and a.digest() == b.digest()  # lengths, not the seed
    buckets = choose_buckets(hist, 64, 3)
    assert buckets.bucket_of(np.array([9]), np.array([30]))[0] == len(buckets) - 1


def test_leftover_sentences_move_up_to_a_shape_that_holds_them():
    """A bucket's last micro-batch would be mostly padding rows: its sentences join its
    parent's (the cheapest shape holding it) when that pads fewer tokens."""
    weights = np.zeros((20, 20), dtype=np.int64)
    weights[8, 8] = weights[10, 10] = 1
    buckets = Buckets([(8, 8), (10, 10)], 80, weights)  # rows 10 and 8
    ranges, final = buckets.arrange(np.array([13, 6]))  # 13 = 10 + 3 left over
    assert final.tolist() == [10, 9]  # 3 moved up: one 9-row batch, not 3/10 + 6/8
    assert ranges == [[(0, 10)], [(10, 13), (13, 19)]]
    ends, of_batch = buckets.batch_ends(final)
    assert ends.tolist() == [10, 18, 19] and of_batch.tolist() == [0, 1, 1]
    _, final = buckets.arrange(np.array([19, 0]))  # 9 left over: a 9/10 batch pads less
    assert final.tolist() == [19, 0]


def _cfg(data_dir, *extra: str):
    return load_config(
        "tiny_cpu",
        [
            f"data.dataset={data_dir}",
            "data.max_tokens=300",
            "data.max_length=64",
            "train.micro_batches=2",
            *extra,
        ],
    )


def _batches(update) -> list[tuple]:
    return [
        (b["ids"].tolist(), b["src_tokens"].tolist(), b["target"].tolist()) for b in update.mine
    ]


def test_stream_pads_follows_and_resumes_exactly(small_data):
    """Every micro-batch a data rank reads has its bucket's shape; a stage without data knows
    the same bucket of each micro-batch of its replica; a stream saved mid-run continues with
    the same padded batches (across the epoch boundary, and on 3 replicas instead of 2)."""
    cfg = _cfg(small_data[0])
    per_epoch = build_batches(cfg, "train", shuffle=True).batches_per_epoch(0)
    done = per_epoch // 4 - 1  # updates of 4 batches before the save
    readers = [TrainStream(cfg, 2, d) for d in range(2)]
    follower = TrainStream(cfg, 2, 1, reads_data=False)
    assert follower.describe().startswith("data: this stage reads no batches; it follows")
    buckets = readers[0].buckets
    assert buckets is not None and "padding" in readers[0].describe_buckets()
    reference, pooled = [], 0
    for u in range(done + 12):
        updates = [s.next_update() for s in readers]
        shadow = follower.next_update()
        assert shadow.mine == [] and shadow.shapes == updates[1].shapes
        for update in updates:
            for b, key in zip(update.mine, update.shapes, strict=True):
                pooled += "," in b["direction"]  # a last batch of several directions
                shape = buckets.shapes[key]
                assert b["bucket"] == key
                assert tuple(b["src_tokens"].shape) == (shape.rows, shape.src_len)
                assert tuple(b["target"].shape) == (shape.rows, shape.tgt_len)
                assert (b["src_tokens"] != PAD_ID).any(1).all()  # no all-padding row
        if u == done - 1:
            state = readers[0].state_dict()
        if u >= done:
            reference.append(updates)
    assert readers[0].epoch >= 1 and pooled > 0
    assert state["bucket_shapes"] == buckets.digest()
    resumed = [TrainStream(cfg, 2, d) for d in range(2)]
    shadow = TrainStream(cfg, 2, 1, reads_data=False)
    for s in (*resumed, shadow):
        s.load_state_dict(state)
    for want in reference:
        got = [s.next_update() for s in resumed]
        for g, w in zip(got, want, strict=True):
            assert _batches(g) == _batches(w) and g.ids_hash == w.ids_hash
            assert g.shapes == w.shapes
        assert shadow.next_update().shapes == want[1].shapes
    # 3 replicas of 2 micro-batches: the same global batches, 6 per update from the save on
    three = [TrainStream(_cfg(small_data[0]), 3, d) for d in range(3)]
    for s in three:
        s.load_state_dict(state)
    flat = [b for update in reference for u in update for b in _batches(u)]
    got = [b for _ in range(len(flat) // 6) for s in three for b in _batches(s.next_update())]
    assert got == flat[: len(got)]


def test_resume_with_other_shapes_is_refused(small_data):
    """A position is only valid in the stream it was cut from: a checkpoint with buckets
    resumed without, one from before buckets resumed with them, or other shapes: one line
    naming data.bucket_shapes."""
    state = TrainStream(_cfg(small_data[0]), 1, 0).state_dict()
    off = TrainStream(_cfg(small_data[0], "data.bucket_shapes=0"), 1, 0)
    with pytest.raises(DataError, match="data.bucket_shapes=0: resume with the run's"):
        off.load_state_dict(state)
    old = {k: v for k, v in off.state_dict().items() if k != "bucket_shapes"}
    off.load_state_dict(old)  # a checkpoint from before buckets resumes without them
    with pytest.raises(DataError, match="resume it with data.bucket_shapes=0"):
        TrainStream(_cfg(small_data[0]), 1, 0).load_state_dict(old)
    with pytest.raises(DataError, match="other bucket shapes"):
        TrainStream(_cfg(small_data[0], "data.bucket_shapes=3"), 1, 0).load_state_dict(state)


def test_synthetic_stream_in_buckets():
    """The synthetic task (tiny_cpu): each sample once per epoch, each batch within its
    shape, the same batches as the stream's plan."""
    cfg = load_config("tiny_cpu", [])
    source = build_batches(cfg, "train", shuffle=True)
    assert isinstance(source, BucketedSyntheticBatches) and len(source.buckets) > 1
    plan = source.epoch_plan(0, _everything)
    ids = np.concatenate([idx for _, idx in plan.mine.values()])
    assert np.array_equal(np.sort(ids), np.arange(cfg.data.synthetic_size))
    for p, (_, idx) in plan.mine.items():
        shape = source.buckets.shapes[plan.shapes[p]]
        batch = source.collate(0, idx)
        assert batch["src_tokens"].shape[0] <= shape.rows
        source.buckets.pad(batch, int(plan.shapes[p]))  # raises when it does not fit
    assert np.array_equal(source.epoch_shapes(0).shapes, plan.shapes)
    first = [b["ids"].tolist() for b in islice(iter(source), 5)]
    assert first == [plan.mine[p][1].tolist() for p in range(5)]


def test_padding_rows_carry_no_loss_and_no_gradient():
    """The flat model on a batch padded to a larger shape (2 padding rows, padding columns):
    the same loss sums and gradients as on the batch itself, nothing NaN."""
    from megatron_branchnorm.data.synthetic import SyntheticData, collate
    from megatron_branchnorm.model import build_model, label_smoothed_nll_loss

    cfg = load_config("tiny_cpu", ["model.dropout=0.0", "model.encoder_layers=2"]).model
    cfg = type(cfg)(**{**cfg.__dict__, "decoder_layers": 2})
    batch = collate(SyntheticData(16, cfg.vocab_size, 20), list(range(4)))
    s, t = batch["src_tokens"].shape[1], batch["target"].shape[1]
    hist = LengthHistogram()
    hist.add(np.array([s]), np.array([t]), 1, 1)
    padded = Buckets([(s + 3, t + 2)], 6 * (s + 3), hist.weights).pad(batch, 0)
    assert padded["src_tokens"].shape[0] == 6 and padded["ntokens"] == batch["ntokens"]
    results = []
    for b in (batch, padded):
        model = build_model(cfg, 7)
        model.set_step(3)
        logits = model(b["src_tokens"], b["prev_output_tokens"])
        loss, nll, ntok = label_smoothed_nll_loss(logits, b["target"], 0.1)
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        assert all(torch.isfinite(g).all() for g in grads.values())
        results.append((loss.detach(), nll.detach(), int(ntok), grads))
    (l0, n0, t0, g0), (l1, n1, t1, g1) = results
    assert t0 == t1 == batch["ntokens"]
    assert torch.allclose(l0, l1, rtol=1e-6) and torch.allclose(n0, n1, rtol=1e-6)
    for name, g in g0.items():
        assert float((g1[name] - g).norm()) <= 1e-5 * max(float(g.norm()), 1e-12), name


@pytest.mark.parametrize("value", ["65", "-1", "sometimes", "1.5"])
def test_bucket_shapes_key_is_checked(value):
    with pytest.raises(ConfigError, match="data.bucket_shapes"):
        load_config("tiny_cpu", [f"data.bucket_shapes={value}"])
