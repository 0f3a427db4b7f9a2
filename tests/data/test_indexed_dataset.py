"""Indexed .bin/.idx files: round trip, temp names, and damaged or foreign files."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from megatron_branchnorm.data import DataError, IndexedDataset, IndexedDatasetWriter
from megatron_branchnorm.data.indexed_dataset import HEADER_SIZE, MAGIC, dtype_for_vocab


def _write(prefix: Path, seqs: list[list[int]], dtype=np.uint16) -> None:
    with IndexedDatasetWriter(prefix, dtype) as w:
        for s in seqs:
            w.add(s)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_round_trip(tmp_path: Path, dtype) -> None:
    seqs = [[5, 6, 7], [], [65535 if dtype == np.uint16 else 100000], list(range(300))]
    _write(tmp_path / "x", seqs, dtype)
    ds = IndexedDataset(tmp_path / "x")
    assert len(ds) == 4 and ds.dtype == np.dtype(dtype)
    assert [ds[i].tolist() for i in range(4)] == seqs
    assert ds.sizes.tolist() == [3, 0, 1, 300] and ds.num_tokens == 304
    order = [3, 1, 0, 0, 2]  # any order, repeats and an empty sequence
    ids, rows, cols = ds.take(np.array(order))
    assert ids.tolist() == [t for i in order for t in seqs[i]]
    assert list(zip(rows.tolist(), cols.tolist(), strict=True)) == [
        (r, c) for r, i in enumerate(order) for c in range(len(seqs[i]))
    ]


def test_dtype_choice() -> None:
    assert dtype_for_vocab(65536) == np.uint16 and dtype_for_vocab(65537) == np.int32


def test_add_many_and_range_check(tmp_path: Path) -> None:
    with IndexedDatasetWriter(tmp_path / "y", np.uint16) as w:
        w.add_many(np.array([1, 2, 3, 4]), np.array([1, 3]))
    assert IndexedDataset(tmp_path / "y")[1].tolist() == [2, 3, 4]
    w = IndexedDatasetWriter(tmp_path / "z", np.uint16)
    with pytest.raises(DataError, match="out of range"):
        w.add([70000])
    w.abort()
    assert list(tmp_path.glob("z*")) == []


def test_writer_uses_temp_names_until_finalize(tmp_path: Path) -> None:
    w = IndexedDatasetWriter(tmp_path / "t", np.uint16)
    w.add([1, 2])
    assert not (tmp_path / "t.bin").exists() and not (tmp_path / "t.idx").exists()
    w.finalize()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.bin", "t.idx"]


def test_interrupted_writer_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(KeyboardInterrupt), IndexedDatasetWriter(tmp_path / "i") as w:
        w.add([1])
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_truncated_bin(tmp_path: Path) -> None:
    _write(tmp_path / "x", [[1, 2, 3], [4, 5]])
    binf = tmp_path / "x.bin"
    binf.write_bytes(binf.read_bytes()[:-2])
    with pytest.raises(DataError, match=r"x\.bin: 8 bytes, expected 10"):
        IndexedDataset(tmp_path / "x")


def test_truncated_idx(tmp_path: Path) -> None:
    _write(tmp_path / "x", [[1, 2, 3], [4, 5]])
    idx = tmp_path / "x.idx"
    idx.write_bytes(idx.read_bytes()[:-4])
    with pytest.raises(DataError, match=r"x\.idx: .*truncated"):
        IndexedDataset(tmp_path / "x")
    idx.write_bytes(b"MBN")
    with pytest.raises(DataError, match=r"x\.idx: truncated index"):
        IndexedDataset(tmp_path / "x")


def test_foreign_idx(tmp_path: Path) -> None:
    _write(tmp_path / "x", [[1, 2, 3]])
    idx = tmp_path / "x.idx"
    data = idx.read_bytes()
    idx.write_bytes(b"MMIDIDX\x00" + data[8:])
    with pytest.raises(DataError, match=r"x\.idx: not a megatron_branchnorm index \(a Megatron"):
        IndexedDataset(tmp_path / "x")
    idx.write_bytes(b"garbage!" + data[8:])
    with pytest.raises(DataError, match="unknown magic"):
        IndexedDataset(tmp_path / "x")


def test_old_version_and_bad_dtype(tmp_path: Path) -> None:
    _write(tmp_path / "x", [[1, 2, 3]])
    idx = tmp_path / "x.idx"
    data = bytearray(idx.read_bytes())
    assert data[:8] == MAGIC
    old = data.copy()
    old[8:12] = struct.pack("<I", 0)
    idx.write_bytes(bytes(old))
    with pytest.raises(DataError, match=r"x\.idx: index version 0, this code reads version 1"):
        IndexedDataset(tmp_path / "x")
    bad = data.copy()
    bad[12] = 9
    idx.write_bytes(bytes(bad))
    with pytest.raises(DataError, match="unknown dtype code 9"):
        IndexedDataset(tmp_path / "x")


def test_corrupt_offsets(tmp_path: Path) -> None:
    _write(tmp_path / "x", [[1, 2, 3], [4]])
    idx = tmp_path / "x.idx"
    data = bytearray(idx.read_bytes())
    data[HEADER_SIZE : HEADER_SIZE + 4] = struct.pack("<i", 2)  # sizes no longer match offsets
    idx.write_bytes(bytes(data))
    with pytest.raises(DataError, match="inconsistent sequence offsets"):
        IndexedDataset(tmp_path / "x")


def test_missing_files(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"nothing\.idx: index file missing"):
        IndexedDataset(tmp_path / "nothing")
