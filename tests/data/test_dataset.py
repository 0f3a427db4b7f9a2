"""Training-side dataset and sampler: batch contents, budgets, temperature, resume, errors."""

from __future__ import annotations

import json
import pickle
import shutil
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_branchnorm.data import (
    BatchSampler,
    DataError,
    TranslationData,
    open_manifest,
    temperature_probs,
)
from megatron_branchnorm.data.synthetic import SyntheticData, collate
from megatron_branchnorm.tokens import BOS_ID, EOS_ID, PAD_ID


def _same(a: dict, b: dict) -> bool:
    return all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


def test_batch_layout(small_data) -> None:
    data_dir, _ = small_data
    data = TranslationData(str(data_dir))
    m = open_manifest(data_dir)
    assert data.vocab_size == m["vocab_size"] and data.directions == m["directions"]
    for batch in islice(BatchSampler(data, 300, 5.0, seed=3), 40):
        src, prev, tgt = batch["src_tokens"], batch["prev_output_tokens"], batch["target"]
        assert src.dtype == prev.dtype == tgt.dtype == batch["ids"].dtype == torch.long
        bsz = src.shape[0]
        assert prev.shape == tgt.shape and batch["ids"].shape == (bsz,)
        assert bsz * max(src.shape[1], tgt.shape[1]) <= 300
        tag = m["tag_ids"][batch["direction"].split("-")[1]]
        assert (src[:, 0] == tag).all() and (prev[:, 0] == BOS_ID).all()
        assert not torch.isin(tgt, torch.tensor(list(m["tag_ids"].values()))).any()
        mask = tgt != PAD_ID
        assert batch["ntokens"] == int(mask.sum())
        assert batch["src_ntokens"] == int((src != PAD_ID).sum())
        for b in range(bsz):
            n = int(mask[b].sum())
            assert tgt[b, n - 1] == EOS_ID and (tgt[b, n:] == PAD_ID).all()
            assert torch.equal(prev[b, 1:n], tgt[b, : n - 1])
            s = int((src[b] != PAD_ID).sum())
            assert src[b, s - 1] == EOS_ID and (src[b, s:] == PAD_ID).all()


def _padded_rows(pairs: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
    """The batch of (source, target) id lists (specials included), one row at a time: the
    reference the array-at-once collates must equal."""
    s_len, t_len = max(len(s) for s, _ in pairs), max(len(t) for _, t in pairs)
    src = torch.full((len(pairs), s_len), PAD_ID)
    prev, tgt = torch.full((len(pairs), t_len), PAD_ID), torch.full((len(pairs), t_len), PAD_ID)
    for row, (s, t) in enumerate(pairs):
        src[row, : len(s)] = torch.tensor(s)
        tgt[row, : len(t)] = torch.tensor(t)
        prev[row, : len(t)] = torch.tensor([BOS_ID, *t[:-1]])
    return {"src_tokens": src, "prev_output_tokens": prev, "target": tgt}


def _index_sets(rng: np.random.Generator, pool: np.ndarray) -> list[np.ndarray]:
    """Index sets a sampler may hand collate: one sentence, repeats, any order, many."""
    return [pool[:1], np.repeat(pool[:2], 3)] + [
        rng.choice(pool, size=int(rng.integers(2, 80))) for _ in range(12)
    ]


def test_collate_equals_row_by_row(small_data) -> None:
    data = TranslationData(str(small_data[0]))
    m, rng = open_manifest(small_data[0]), np.random.default_rng(5)
    for g, direction in enumerate(data.directions):
        tag = m["tag_ids"][direction.split("-")[1]]
        for idx in _index_sets(rng, data.group_indices(g)):
            batch = data.collate(g, idx)
            pairs = [data.pair(g, int(i)) for i in idx]
            rows = [([tag, *s.tolist(), EOS_ID], [*t.tolist(), EOS_ID]) for s, t in pairs]
            assert _same(_padded_rows(rows), batch)
            assert batch["ntokens"] == sum(len(t) for _, t in rows)
            assert batch["src_ntokens"] == sum(len(s) for s, _ in rows)
            assert batch["ids"].tolist() == (idx + data.sample_offset(g)).tolist()


def test_collate_of_several_directions_equals_row_by_row(small_data) -> None:
    """A pooled last batch of a bucketed epoch (docs/design.md §18) holds sentences of several
    directions: each row carries its own direction's tag and sentence pair, in the order
    given; ids are global; the batch names its directions."""
    data = TranslationData(str(small_data[0]))
    m, rng = open_manifest(small_data[0]), np.random.default_rng(8)
    for n in (2, 5, 40, 77):
        groups = rng.integers(0, len(data.directions), n)
        groups[:2] = [0, len(data.directions) - 1]  # at least two directions
        idx = np.array([rng.choice(data.group_indices(g)) for g in groups])
        batch = data.collate(groups, idx)
        rows = []
        for g, i in zip(groups.tolist(), idx.tolist(), strict=True):
            s, t = data.pair(g, i)
            tag = m["tag_ids"][data.directions[g].split("-")[1]]
            rows.append(([tag, *s.tolist(), EOS_ID], [*t.tolist(), EOS_ID]))
        assert _same(_padded_rows(rows), batch)
        assert batch["ntokens"] == sum(len(t) for _, t in rows)
        assert batch["src_ntokens"] == sum(len(s) for s, _ in rows)
        offsets = [data.sample_offset(g) for g in groups.tolist()]
        assert batch["ids"].tolist() == (idx + np.array(offsets)).tolist()
        assert batch["direction"].split(",") == [data.directions[g] for g in np.unique(groups)]


def test_synthetic_collate_equals_row_by_row() -> None:
    data, rng = SyntheticData(300, 40, 24), np.random.default_rng(6)
    for idx in _index_sets(rng, np.arange(len(data))):
        batch = collate(data, idx.tolist())
        rows = [tuple(x.tolist() for x in data.pair(int(i))) for i in idx]
        assert _same(_padded_rows(rows), batch)
        assert batch["ntokens"] == sum(len(t) for _, t in rows)
        assert batch["src_ntokens"] == sum(len(s) for s, _ in rows)
        assert batch["ids"].tolist() == idx.tolist()


def test_temperature_frequencies(small_data) -> None:
    """One epoch holds round(N * p_i) samples of direction i (largest remainder: |err| <= 1),
    p_i = n_i^(1/T) / sum_j n_j^(1/T); the counts are exact, not stochastic, so the tolerance
    is the rounding, one sample."""
    data_dir, _ = small_data
    data = TranslationData(str(data_dir))
    n = np.array([data.group_indices(g).size for g in range(len(data.directions))])
    for temperature in (1.0, 5.0, 100.0):
        sampler = BatchSampler(data, 400, temperature, seed=1)
        p = n ** (1 / temperature) / (n ** (1 / temperature)).sum()
        assert np.allclose(sampler.probs, p) and np.allclose(temperature_probs(n, temperature), p)
        it = iter(sampler)
        for epoch in range(2):
            seen = np.zeros(len(n), dtype=np.int64)
            for batch in islice(it, sampler.batches_per_epoch(epoch)):
                seen[data.directions.index(batch["direction"])] += batch["ids"].numel()
            assert seen.sum() == n.sum()
            assert np.abs(seen - n.sum() * p).max() <= 1.0
    # T=5 up-samples the small pair from a stream of permutations: in epoch 0 every fr sample
    # appears k // n or k // n + 1 times, never more.
    sampler = BatchSampler(data, 400, 5.0, seed=1)
    g = data.directions.index("fr-en")
    k = int(sampler.epoch_counts[g])
    assert k > n[g]
    epoch_ids = np.concatenate([idx for gg, idx in sampler._plan(0) if gg == g])
    counts = np.bincount(epoch_ids, minlength=n[g])
    assert counts.min() == k // n[g] and counts.max() <= k // n[g] + 1


def test_order_depends_on_seed_not_on_steps(small_data) -> None:
    data = TranslationData(str(small_data[0]))
    six = list(islice(BatchSampler(data, 300, 5.0, seed=7), 6))
    twelve = list(islice(BatchSampler(data, 300, 5.0, seed=7), 12))
    assert all(_same(a, b) for a, b in zip(six, twelve[:6], strict=True))
    other = list(islice(BatchSampler(data, 300, 5.0, seed=8), 6))
    assert not all(_same(a, b) for a, b in zip(six, other, strict=True))


@pytest.mark.parametrize("stop", [0, 5, 37])
def test_resume_equals_uninterrupted(small_data, stop: int) -> None:
    data = TranslationData(str(small_data[0]))
    sampler = BatchSampler(data, 600, 5.0, seed=11)
    per_epoch = sampler.batches_per_epoch(0)
    total = 2 * per_epoch + 10  # crosses two epoch boundaries
    reference = list(islice(iter(BatchSampler(data, 600, 5.0, seed=11)), total))
    it = iter(sampler)
    consumed = list(islice(it, stop))
    state = json.loads(json.dumps(sampler.state_dict()))
    state = pickle.loads(pickle.dumps(state))
    resumed = BatchSampler(TranslationData(str(small_data[0])), 600, 5.0, seed=11)
    resumed.load_state_dict(state)
    rest = list(islice(iter(resumed), total - stop))
    assert len(consumed) + len(rest) == total
    assert all(_same(a, b) for a, b in zip(consumed + rest, reference, strict=True))


def test_resume_at_epoch_end(small_data) -> None:
    data = TranslationData(str(small_data[0]))
    sampler = BatchSampler(data, 600, 5.0, seed=2)
    n = sampler.batches_per_epoch(0)
    it = iter(sampler)
    list(islice(it, n))
    state = sampler.state_dict()
    assert state["epoch"] == 0 and state["position"] == n
    nxt = next(it)
    resumed = BatchSampler(data, 600, 5.0, seed=2)
    resumed.load_state_dict(state)
    assert _same(next(iter(resumed)), nxt)
    assert resumed.state_dict()["epoch"] == 1


def test_state_mismatch_is_an_error(small_data) -> None:
    data = TranslationData(str(small_data[0]))
    state = BatchSampler(data, 600, 5.0, seed=2).state_dict()
    with pytest.raises(DataError, match="seed=2, this sampler has 3"):
        BatchSampler(data, 600, 5.0, seed=3).load_state_dict(state)
    with pytest.raises(DataError, match="out of range"):
        BatchSampler(data, 600, 5.0, seed=2).load_state_dict(state | {"position": 10**6})


def test_validation_pass_and_sharding(small_data) -> None:
    data = TranslationData(str(small_data[0]), split="dev")
    sampler = BatchSampler(data, 200, 5.0, seed=0, shuffle=False)
    ids = [b["ids"] for b in sampler]
    again = [b["ids"] for b in sampler]  # finite and repeatable
    assert all(torch.equal(a, b) for a, b in zip(ids, again, strict=True))
    flat = torch.cat(ids)
    assert flat.numel() == len(data) and flat.unique().numel() == len(data)
    shards = [
        torch.cat([b["ids"] for b in BatchSampler(data, 200, 5.0, 0, False, rank=r, world_size=2)])
        for r in range(2)
    ]
    assert sorted(torch.cat(shards).tolist()) == sorted(flat.tolist())
    train = TranslationData(str(small_data[0]))
    r0 = BatchSampler(train, 300, 5.0, 4, rank=0, world_size=2)
    r1 = BatchSampler(train, 300, 5.0, 4, rank=1, world_size=2)
    a, b = r0._plan(0), r1._plan(0)
    assert len(a) == len(b)
    whole = BatchSampler(train, 300, 5.0, 4)._plan(0)
    interleaved = [x for pair in zip(a, b, strict=True) for x in pair]
    assert len(whole) - len(interleaved) in (0, 1)
    for (g1, x1), (g2, x2) in zip(interleaved, whole, strict=False):
        assert g1 == g2 and np.array_equal(x1, x2)


def test_max_length_filter(small_data) -> None:
    data_dir, _ = small_data
    full = TranslationData(str(data_dir))
    short = TranslationData(str(data_dir), max_length=8)
    assert 0 < len(short) < len(full) and short.num_too_long == len(full) - len(short)
    for batch in islice(BatchSampler(short, 200, 5.0, seed=0), 30):
        assert batch["src_tokens"].shape[1] <= 10 and batch["target"].shape[1] <= 9
    with pytest.raises(DataError, match="exceeds max_tokens=8"):
        BatchSampler(full, 8, 5.0, seed=0)


class _Lengths:
    """A minimal SampleSource: two groups with given lengths, batches of ids only."""

    directions = ["a", "b"]

    def __init__(self) -> None:
        self.lens = [np.arange(1, 101) % 17 + 3, np.full(10, 5)]

    def group_indices(self, g: int) -> np.ndarray:
        return np.arange(self.lens[g].size)

    def group_lengths(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        return self.lens[g], self.lens[g]

    def collate(self, g: int, idx: np.ndarray) -> dict:
        return {"group": g, "ids": torch.from_numpy(idx), "max": int(self.lens[g][idx].max())}


def test_any_length_source() -> None:
    src = _Lengths()
    sampler = BatchSampler(src, 40, 1.0, seed=0)
    batches = list(islice(sampler, sampler.batches_per_epoch(0)))
    assert all(len(b["ids"]) * b["max"] <= 40 for b in batches)
    assert sum(len(b["ids"]) for b in batches if b["group"] == 1) == 10


def test_manifest_errors(small_data, tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"manifest\.json: missing"):
        open_manifest(tmp_path)
    data_dir, _ = small_data
    bad = tmp_path / "copy"
    shutil.copytree(data_dir, bad)
    (bad / "manifest.json").write_text("{not json")
    with pytest.raises(DataError, match=r"copy/manifest\.json: not valid JSON"):
        TranslationData(str(bad))
    m = json.loads((data_dir / "manifest.json").read_text())
    (bad / "manifest.json").write_text(json.dumps(m | {"version": 0}))
    with pytest.raises(DataError, match="manifest version 0"):
        open_manifest(bad)
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DataError, match="no split 'valid'"):
        TranslationData(str(bad), split="valid")


def test_damaged_files_fail_at_open(small_data, tmp_path: Path) -> None:
    data_dir, _ = small_data
    bad = tmp_path / "copy"
    shutil.copytree(data_dir, bad)
    binf = bad / "bin" / "train.en-fr.fr.bin"
    binf.write_bytes(binf.read_bytes()[:-6])
    with pytest.raises(DataError, match=r"train\.en-fr\.fr\.bin: .* bytes, expected"):
        TranslationData(str(bad))
    shutil.copy(data_dir / "bin" / "train.en-fr.fr.bin", binf)
    shutil.copy(data_dir / "bin" / "dev.de-en.de.idx", bad / "bin" / "train.de-en.de.idx")
    shutil.copy(data_dir / "bin" / "dev.de-en.de.bin", bad / "bin" / "train.de-en.de.bin")
    with pytest.raises(DataError, match=r"train\.de-en\.de\.idx has \d+ and .* manifest"):
        TranslationData(str(bad))
