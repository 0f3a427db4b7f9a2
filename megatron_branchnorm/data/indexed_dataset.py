"""Memory-mapped indexed datasets: a ``.bin`` of token ids and an ``.idx`` that locates each
sequence in it (the Megatron/fairseq idea, with our own header).

``.idx`` layout (little-endian)::

    offset  size  field
    0       8     magic  b"MBNIDX\\0\\0"
    8       4     version (uint32, currently 1)
    12      1     dtype code (1 = uint16, 2 = int32)
    13      3     reserved (zero)
    16      8     number of sequences N (uint64)
    24      8     total number of tokens (uint64); the .bin holds exactly this many ids
    32      4*N   sequence lengths (int32)
    32+4N   8*N   start of each sequence in the .bin, in tokens (int64)

``.bin``: the ids of all sequences back to back, in the dtype above, no header.

Opening checks magic, version, dtype, the .idx size, the .bin size and the offsets, and raises
:class:`DataError` naming the file. The writer writes ``*.tmp`` files and renames them at the end
(``.bin`` first, ``.idx`` last), so a present ``.idx`` means a complete pair.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from megatron_branchnorm.formats.data_dir import DataError

MAGIC = b"MBNIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<8sIB3xQQ")
HEADER_SIZE = _HEADER.size  # 32
DTYPES: dict[int, np.dtype] = {1: np.dtype(np.uint16), 2: np.dtype(np.int32)}
_CODES = {dt: code for code, dt in DTYPES.items()}
_KNOWN_MAGICS = {b"MMIDIDX\x00": "a Megatron-LM index", b"TNTIDX\x00\x00": "a fairseq index"}


def ragged_cells(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) of each element of rows of ``lengths`` (int64) laid end to end: one
    fancy-index assignment then puts their concatenation into a padded matrix, where a loop
    over rows costs a few microseconds of Python per row (a micro-batch holds hundreds)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    rows = np.repeat(np.arange(lengths.size), lengths)
    starts = np.cumsum(lengths) - lengths
    return rows, np.arange(rows.size) - starts[rows]


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else int32."""
    return DTYPES[1] if vocab_size <= 65536 else DTYPES[2]


def index_path(prefix: str | Path) -> Path:
    """The ``.idx`` file of a dataset prefix."""
    return Path(f"{prefix}.idx")


def data_path(prefix: str | Path) -> Path:
    """The ``.bin`` file of a dataset prefix."""
    return Path(f"{prefix}.bin")


class IndexedDatasetWriter:
    """Appends sequences of token ids; :meth:`finalize` publishes ``prefix.bin``/``prefix.idx``."""

    def __init__(self, prefix: str | Path, dtype: np.dtype | type = np.uint16) -> None:
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODES:
            raise DataError(f"{self.prefix}: unsupported dtype {self.dtype}")
        self._info = np.iinfo(self.dtype)
        self._bin_tmp = Path(f"{data_path(prefix)}.tmp")
        self._idx_tmp = Path(f"{index_path(prefix)}.tmp")
        self._bin = open(self._bin_tmp, "wb")  # noqa: SIM115 (closed in finalize/abort)
        self._sizes: list[np.ndarray] = []
        self._total = 0

    def add(self, ids: Iterable[int] | np.ndarray) -> None:
        """Append one sequence."""
        arr = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids)
        self.add_many(arr, np.array([arr.size], dtype=np.int64))

    def add_many(self, flat: np.ndarray, lengths: np.ndarray) -> None:
        """Append ``len(lengths)`` sequences whose ids are concatenated in ``flat``."""
        flat = np.asarray(flat)
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != flat.size:
            raise DataError(f"{self.prefix}: lengths sum to {lengths.sum()}, got {flat.size} ids")
        if flat.size and (flat.min() < self._info.min or flat.max() > self._info.max):
            raise DataError(f"{self.prefix}: token id out of range for {self.dtype}")
        self._bin.write(flat.astype(self.dtype, copy=False).tobytes())
        self._sizes.append(lengths.astype(np.int32))
        self._total += flat.size

    def finalize(self) -> None:
        """Write the index and rename both temporary files to their final names."""
        self._bin.close()
        sizes = np.concatenate(self._sizes) if self._sizes else np.zeros(0, np.int32)
        offsets = np.zeros(sizes.size, dtype=np.int64)
        if sizes.size:
            np.cumsum(sizes[:-1], out=offsets[1:])
        with open(self._idx_tmp, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, _CODES[self.dtype], sizes.size, self._total))
            f.write(sizes.astype("<i4").tobytes())
            f.write(offsets.astype("<i8").tobytes())
        os.replace(self._bin_tmp, data_path(self.prefix))
        os.replace(self._idx_tmp, index_path(self.prefix))

    def abort(self) -> None:
        """Close and delete the temporary files."""
        self._bin.close()
        for p in (self._bin_tmp, self._idx_tmp):
            p.unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexedDataset:
    """Read-only view of ``prefix.bin``/``prefix.idx``; ``ds[i]`` is a numpy array of ids."""

    def __init__(self, prefix: str | Path) -> None:
        self.prefix = Path(prefix)
        idx, binf = index_path(prefix), data_path(prefix)
        if not idx.is_file():
            raise DataError(f"{idx}: index file missing")
        if not binf.is_file():
            raise DataError(f"{binf}: data file missing")
        idx_size = idx.stat().st_size
        with open(idx, "rb") as f:
            head = f.read(HEADER_SIZE)
        if len(head) < HEADER_SIZE:
            raise DataError(
                f"{idx}: truncated index ({idx_size} bytes, header needs {HEADER_SIZE})"
            )
        magic, version, code, count, total = _HEADER.unpack(head)
        if magic != MAGIC:
            what = _KNOWN_MAGICS.get(magic, "unknown magic")
            raise DataError(
                f"{idx}: not a megatron_branchnorm index ({what} {magic!r}); re-run preprocessing"
            )
        if version != VERSION:
            raise DataError(
                f"{idx}: index version {version}, this code reads version {VERSION}; "
                "re-run preprocessing"
            )
        if code not in DTYPES:
            raise DataError(f"{idx}: unknown dtype code {code}")
        self.dtype = DTYPES[code]
        expect = HEADER_SIZE + 12 * count
        if idx_size != expect:
            raise DataError(
                f"{idx}: {idx_size} bytes, expected {expect} for {count} sequences (truncated?)"
            )
        bin_size = binf.stat().st_size
        if bin_size != total * self.dtype.itemsize:
            raise DataError(
                f"{binf}: {bin_size} bytes, expected {total * self.dtype.itemsize} "
                f"({total} ids of {self.dtype}); truncated or not written by this index"
            )
        buf = np.memmap(idx, dtype=np.uint8, mode="r")
        self.sizes = np.frombuffer(buf, dtype="<i4", count=count, offset=HEADER_SIZE)
        self.offsets = np.frombuffer(buf, dtype="<i8", count=count, offset=HEADER_SIZE + 4 * count)
        if count and (
            self.offsets[0] != 0
            or (self.sizes < 0).any()
            or int(self.offsets[-1]) + int(self.sizes[-1]) != total
            or (count > 1 and not np.array_equal(np.diff(self.offsets), self.sizes[:-1]))
        ):
            raise DataError(f"{idx}: inconsistent sequence offsets (corrupt index)")
        self.num_tokens = int(total)
        if total:
            self._data = np.memmap(binf, dtype=self.dtype, mode="r")
        else:
            self._data = np.zeros(0, dtype=self.dtype)

    def __len__(self) -> int:
        return int(self.sizes.size)

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(self.offsets[i])
        return self._data[start : start + int(self.sizes[i])]

    def take(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Sequences ``indices`` end to end (one gather from the memory map, not one slice
        per sequence), with the (row, column) of each id (:func:`ragged_cells`)."""
        idx = np.asarray(indices, dtype=np.int64)
        rows, cols = ragged_cells(self.sizes[idx])
        return np.asarray(self._data[self.offsets[idx][rows] + cols]), rows, cols
