"""Training side: a preprocessed DATA_DIR as translation batches.

* :func:`open_manifest` reads and validates ``DATA_DIR/manifest.json``.
* :class:`TranslationData` opens the indexed datasets of every direction of one split and turns
  samples into tensors: ``src_tokens = <2tgt> x_1..x_n </s>``, ``prev_output_tokens =
  <s> y_1..y_m``, ``target = y_1..y_m </s>`` (right-padded with PAD_ID).
* :class:`BatchSampler` yields token-budget micro-batches, one direction per batch (with bucket
  shapes, the epoch's last batches of each shape pool several directions' leftovers).

Sampling (``shuffle=True``): an epoch holds N = sum_i n_i samples, direction i contributing
round(N * p_i) with p_i ~ n_i^(1/T) (largest-remainder rounding, so each count is within one
sample of N * p_i). Direction i's samples are read from an endless stream of seeded
permutations of its n_i samples, so an up-sampled direction repeats only after a full pass and a
down-sampled one sees all its samples over successive epochs. Within a direction the epoch's
samples are sorted by length (random tie-break) and cut greedily into batches with
B * max(S, T) <= max_tokens; then the batches of all directions are shuffled. With bucket
shapes (``max_shapes`` > 0, data/buckets.py), the samples of a direction are grouped by bucket
instead and each bucket cut into full batches of its shape's rows; what each direction leaves
over in a bucket is pooled with the other directions' and cut into that bucket's last batches,
one row per sentence with its own direction's tag (docs/design.md §18). Everything is a function of
(seed, epoch) only: the order never depends on how many steps are run, and ``state_dict()`` is
just (epoch, batch position).

``shuffle=False`` (validation) gives one pass over every sample, direction by direction, each
sorted by length.

The sampler reads a data source through four members, so any object with per-sample lengths
(for example a synthetic task) can be batched the same way: ``directions``, ``group_indices(g)``,
``group_lengths(g)`` and ``collate(g, indices)`` (see :class:`SampleSource`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from megatron_branchnorm.data.buckets import Buckets, LengthHistogram, choose_buckets
from megatron_branchnorm.data.indexed_dataset import IndexedDataset
from megatron_branchnorm.data.sampling import allocate, temperature_probs
from megatron_branchnorm.formats.data_dir import FORMAT as MANIFEST_FORMAT
from megatron_branchnorm.formats.data_dir import MANIFEST, DataError, read_data_manifest
from megatron_branchnorm.formats.data_dir import VERSION as MANIFEST_VERSION
from megatron_branchnorm.formats.files import file_inside
from megatron_branchnorm.tokens import BOS_ID, EOS_ID, PAD_ID

__all__ = [
    "BatchSampler",
    "DataError",
    "EpochPlan",
    "SampleSource",
    "TranslationData",
    "open_manifest",
    "read_references",
]

# Tags that keep the random streams of the sampler apart (numpy SeedSequence entropy words).
_STREAM_PASS, _STREAM_TIEBREAK, _STREAM_ORDER = 1, 2, 3
POOLED_TAILS = "pooled"
"""A bucketed stream position's ``bucket_tails``: each direction's sentences left over in a
bucket (fewer than its rows) are cut together with the other directions' (docs/design.md §18);
a position saved before that (no such key) belongs to another cut."""


def _require(ok: bool, path: Path, msg: str) -> None:
    if not ok:
        raise DataError(f"{path}: {msg}")


def open_manifest(data_dir: str | Path) -> dict:
    """``DATA_DIR/manifest.json`` through its one reader (``formats/data_dir.py``), then the
    structure the training stream needs beyond it; raises :class:`DataError`."""
    manifest = read_data_manifest(data_dir)
    path, m = manifest.path, dict(manifest.raw)
    _require(m.get("format") == MANIFEST_FORMAT, path, f"format is not {MANIFEST_FORMAT!r}")
    _require(
        m.get("version") == MANIFEST_VERSION,
        path,
        f"manifest version {m.get('version')!r}, this code reads {MANIFEST_VERSION}; "
        "re-run preprocessing",
    )
    vocab = m.get("vocab_size")
    _require(isinstance(vocab, int) and vocab > 4, path, f"bad vocab_size {vocab!r}")
    langs = m.get("languages")
    _require(
        isinstance(langs, list) and all(isinstance(x, str) for x in langs) and len(langs) >= 2,
        path,
        "languages must be a list of at least two codes",
    )
    tags = m.get("tag_ids")
    _require(isinstance(tags, dict), path, "tag_ids missing")
    for lang in langs:
        t = tags.get(lang)
        _require(
            isinstance(t, int) and 3 < t < vocab, path, f"tag id of {lang} is {t!r} (vocab {vocab})"
        )
    _require(isinstance(m.get("spm_model"), str), path, "spm_model missing")
    _require(
        (Path(data_dir) / m["spm_model"]).is_file(), path, f"spm_model {m['spm_model']} not found"
    )
    dirs = m.get("directions")
    _require(isinstance(dirs, list) and dirs, path, "directions must be a non-empty list")
    splits = m.get("splits")
    _require(isinstance(splits, dict) and "train" in splits, path, "splits.train missing")
    for split, info in splits.items():
        d = info.get("directions") if isinstance(info, dict) else None
        _require(isinstance(d, dict) and d, path, f"splits.{split}.directions missing")
        for name, entry in d.items():
            src, _, tgt = name.partition("-")
            _require(src in langs and tgt in langs, path, f"direction {name!r}: unknown language")
            ok = (
                isinstance(entry, dict)
                and isinstance(entry.get("src"), str)
                and isinstance(entry.get("tgt"), str)
                and isinstance(entry.get("sentences"), int)
            )
            _require(ok, path, f"splits.{split}.directions.{name} needs src, tgt, sentences")
    return m


def read_references(
    data_dir: str | Path, split: str, direction: str
) -> tuple[list[str], list[str]]:
    """The raw (unfiltered) source lines and reference lines of a dev/test direction (files
    inside DATA_DIR, checked by the manifest's reader)."""
    open_manifest(data_dir)
    path = Path(data_dir) / MANIFEST
    refs = read_data_manifest(data_dir).references(split)
    if direction not in refs:
        raise DataError(f"{path}: no {split} references for direction {direction}")
    out = []
    for f in (refs[direction].src, refs[direction].tgt):
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise DataError(f"{f}: cannot read references: {exc}") from None
        lines = text.split("\n")
        if text.endswith("\n"):
            lines.pop()
        out.append(lines)
    if len(out[0]) != len(out[1]):
        raise DataError(f"{path}: {split} {direction} references have unequal line counts")
    return out[0], out[1]


class SampleSource(Protocol):
    """What :class:`BatchSampler` needs from a data source."""

    directions: list[str]

    def group_indices(self, group: int) -> np.ndarray:
        """Local indices of the usable samples of direction ``group``."""
        ...

    def group_lengths(self, group: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, target) tensor lengths, specials included, of every local index."""
        ...

    def collate(self, group: int | np.ndarray, indices: np.ndarray) -> dict[str, Any]:
        """The batch dict of these samples of direction ``group``; with bucket shapes, ``group``
        may also be an array: each sample's direction (a pooled last batch)."""
        ...

    def sample_offset(self, group: int) -> int:
        """What turns a local index of direction ``group`` into its global sample id."""
        ...


Side = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""One side of a batch as :meth:`IndexedDataset.take` gives it, with each sentence's length:
(ids end to end, row of each id, column of each id, lengths)."""


def pair_batch(first: int | np.ndarray, src: Side, tgt: Side, ids: torch.Tensor) -> dict[str, Any]:
    """The batch dict of sentences ``ids`` (module docstring's layout, right-padded with
    PAD_ID): ``src_tokens`` = ``first`` (a tag per batch or per row), the source ids, EOS;
    ``prev_output_tokens`` = BOS, the target ids; ``target`` = the target ids, EOS; and the
    token counts. A few array assignments, whatever the number of sentences."""
    (s_ids, s_rows, s_cols, s_lens), (t_ids, t_rows, t_cols, t_lens) = src, tgt
    every = np.arange(s_lens.size)
    source = np.full((s_lens.size, int(s_lens.max()) + 2), PAD_ID, dtype=np.int64)  # (B, S)
    prev = np.full((t_lens.size, int(t_lens.max()) + 1), PAD_ID, dtype=np.int64)  # (B, T)
    target = np.full(prev.shape, PAD_ID, dtype=np.int64)  # (B, T)
    source[:, 0] = first
    source[s_rows, s_cols + 1] = s_ids
    source[every, s_lens + 1] = EOS_ID
    prev[:, 0] = BOS_ID
    prev[t_rows, t_cols + 1] = t_ids
    target[t_rows, t_cols] = t_ids
    target[every, t_lens] = EOS_ID
    return {
        "src_tokens": torch.from_numpy(source),
        "prev_output_tokens": torch.from_numpy(prev),
        "target": torch.from_numpy(target),
        "ids": ids,
        "ntokens": int(t_lens.sum()) + every.size,
        "src_ntokens": int(s_lens.sum()) + 2 * every.size,
    }


class TranslationData:
    """All translation directions of one split of a DATA_DIR.

    ``max_length`` drops samples whose source or target sentence has more tokens (specials not
    counted); ``num_too_long`` says how many.
    """

    def __init__(self, data_dir: str, split: str = "train", max_length: int | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.manifest = open_manifest(data_dir)
        mpath = self.data_dir / MANIFEST
        splits = self.manifest["splits"]
        if split not in splits:
            raise DataError(f"{mpath}: no split {split!r} (has {', '.join(splits)})")
        self.split = split
        self.vocab_size: int = self.manifest["vocab_size"]
        entries = splits[split]["directions"]
        self.directions: list[str] = sorted(entries)
        cache: dict[str, IndexedDataset] = {}

        def open_ds(rel: str, key: str) -> IndexedDataset:
            if rel not in cache:  # both files inside DATA_DIR, never another file
                for suffix in (".idx", ".bin"):
                    file_inside(self.data_dir, f"{rel}{suffix}", mpath, key, DataError)
                cache[rel] = IndexedDataset(self.data_dir / rel)
            return cache[rel]

        self._src: list[IndexedDataset] = []
        self._tgt: list[IndexedDataset] = []
        self._tag: list[int] = []
        self._offsets: list[int] = []
        # The usable samples of each direction; None when every sample is (the usual case:
        # preprocessing filtered with the same limit). Nothing else is kept per sample: the
        # lengths are read from the memory-mapped indexes when asked for (docs/design.md §15).
        self._valid: list[np.ndarray | None] = []
        self._counts: list[int] = []
        self.num_too_long = 0
        offset = 0
        for name in self.directions:
            e = entries[name]
            key = f"splits.{split}.directions.{name}"
            src, tgt = open_ds(e["src"], f"{key}.src"), open_ds(e["tgt"], f"{key}.tgt")
            if not (len(src) == len(tgt) == e["sentences"]):
                raise DataError(
                    f"{src.prefix}.idx has {len(src)} and {tgt.prefix}.idx {len(tgt)} sequences, "
                    f"manifest {mpath} says {e['sentences']}"
                )
            valid = None
            if max_length is not None:
                ok = (src.sizes <= max_length) & (tgt.sizes <= max_length)
                if not ok.all():
                    valid = np.flatnonzero(ok).astype(np.int32 if ok.size < 2**31 else np.int64)
            count = len(src) if valid is None else valid.size
            self.num_too_long += len(src) - count
            self._src.append(src)
            self._tgt.append(tgt)
            self._tag.append(self.manifest["tag_ids"][name.split("-", 1)[1]])
            self._offsets.append(offset)
            self._valid.append(valid)
            self._counts.append(count)
            offset += len(src)
        self.num_samples = offset
        """Samples over all directions before the max_length filter (the range of ``ids``)."""

    def __len__(self) -> int:
        return sum(self._counts)

    def group_indices(self, group: int) -> np.ndarray:
        """Local indices of the samples of direction ``group`` that pass ``max_length``."""
        valid = self._valid[group]
        if valid is None:
            return np.arange(self._counts[group], dtype=np.int64)
        return valid.astype(np.int64)

    def group_lengths(self, group: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, target) tensor lengths with specials: (n + 2, m + 1) per sample."""
        return self._src[group].sizes.astype(np.int64) + 2, self._tgt[group].sizes.astype(
            np.int64
        ) + 1

    def sample_offset(self, group: int) -> int:
        """Global sample id of local index 0 of direction ``group`` (the batches' ``ids``)."""
        return self._offsets[group]

    def pair(self, group: int, index: int) -> tuple[np.ndarray, np.ndarray]:
        """The raw (source, target) token ids of one sample, without tag or specials."""
        return np.asarray(self._src[group][index]), np.asarray(self._tgt[group][index])

    def collate(self, group: int | np.ndarray, indices: np.ndarray) -> dict[str, Any]:
        """Batch dict of samples ``indices`` of direction ``group`` (see module docstring), or
        of each sample's direction when ``group`` is an array (a pooled last batch of a
        bucketed epoch, docs/design.md §18): each side read in one gather per direction
        (:meth:`IndexedDataset.take`) and laid out by :func:`pair_batch` (no loop over
        sentences)."""
        indices = np.asarray(indices, dtype=np.int64)
        if np.ndim(group) == 0:
            group = int(group)
            src, tgt = self._side(self._src, group, indices), self._side(self._tgt, group, indices)
            first, names, ids = (
                self._tag[group],
                self.directions[group],
                indices + self._offsets[group],
            )
        else:
            group = np.asarray(group, dtype=np.int64)
            parts = _by_group(group)
            src = _rows_of([(rows, self._side(self._src, g, indices[rows])) for g, rows in parts])
            tgt = _rows_of([(rows, self._side(self._tgt, g, indices[rows])) for g, rows in parts])
            first = np.asarray(self._tag)[group]
            names = ",".join(self.directions[g] for g, _ in parts)
            ids = indices + np.asarray(self._offsets, dtype=np.int64)[group]
        return {**pair_batch(first, src, tgt, torch.from_numpy(ids)), "direction": names}

    def _side(self, datasets: list[IndexedDataset], group: int, indices: np.ndarray) -> Side:
        """One side of samples ``indices`` of direction ``group``: one gather, checked against
        the vocabulary (a corrupt file names itself)."""
        ds = datasets[group]
        ids, rows, cols = ds.take(indices)
        if ids.size and int(ids.max()) >= self.vocab_size:
            raise DataError(f"{ds.prefix}: token id >= vocab_size {self.vocab_size} (corrupt data)")
        return ids, rows, cols, ds.sizes[indices].astype(np.int64)


def _by_group(groups: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(direction, positions) of each direction in ``groups``, the per-sample directions of a
    pooled batch (docs/design.md §18), in direction order."""
    return [(g, np.flatnonzero(groups == g)) for g in np.unique(groups).tolist()]


def _rows_of(parts: list[tuple[np.ndarray, Side]]) -> Side:
    """One side of a batch from parts read apart (``rows``: where each part's sentences sit in
    the batch)."""
    lens = np.zeros(sum(rows.size for rows, _ in parts), dtype=np.int64)
    for rows, (_, _, _, n) in parts:
        lens[rows] = n
    return (
        np.concatenate([ids for _, (ids, _, _, _) in parts]),
        np.concatenate([rows[r] for rows, (_, r, _, _) in parts]),
        np.concatenate([c for _, (_, _, c, _) in parts]),
        lens,
    )


def _batches_by_length(indices: np.ndarray, keys: np.ndarray, max_tokens: int) -> list[np.ndarray]:
    """Cut ``indices`` (sorted by nondecreasing ``keys``) into batches with
    len(batch) * max(keys in batch) <= max_tokens, greedily."""
    return np.split(indices, _batch_ends(keys, max_tokens)[:-1])


def _batch_ends(keys: np.ndarray, max_tokens: int) -> np.ndarray:
    """The end (exclusive) of each greedy batch over nondecreasing ``keys``: the largest end
    with (end - start) * keys[end - 1] <= max_tokens. The condition only weakens as the end
    moves left, so the longest batch the first key allows is tried first (it holds whenever
    the batch stays within one key, the common case) and a binary search runs otherwise."""
    ends = []
    n, start = keys.size, 0
    while start < n:
        hi = min(n, start + max_tokens // int(keys[start]))
        if (hi - start) * int(keys[hi - 1]) <= max_tokens:
            lo = hi
        else:
            lo = start + 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if (mid - start) * int(keys[mid - 1]) <= max_tokens:
                    lo = mid
                else:
                    hi = mid - 1
        ends.append(lo)
        start = lo
    return np.asarray(ends, dtype=np.int64)


_MIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def id_fingerprints(ids: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each sample id (splitmix64's finaliser, Steele et al. 2014), as
    uint64: a batch's fingerprint is the wrapping sum over its samples."""
    z = np.asarray(ids, dtype=np.uint64) + _MIX[0]
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * _MIX[1]
        z = (z ^ (z >> np.uint64(27))) * _MIX[2]
    return z ^ (z >> np.uint64(31))


@dataclass
class EpochPlan:
    """One epoch of the global batch stream, as one data-reading rank holds it
    (docs/design.md §15): the size of every batch, and the samples of only the batches the
    rank reads.

    ``ntokens``, ``src_ntokens``, ``samples`` and ``fingerprints`` have one entry per global
    batch, in stream order (the update's totals and ``ids_hash`` need every data-parallel
    rank's batches); ``mine`` maps the positions this rank reads to (direction, sample
    indices), what :meth:`BatchSampler.collate` turns into the batch (the direction is an
    array, each sample's, for a pooled last batch of several directions). ``shapes``: the bucket
    of every batch (None without bucket shapes). A plan of the shapes alone
    (:meth:`BatchSampler.epoch_shapes`, for a stage that reads no data) has None for the
    four sizes and nothing in ``mine``."""

    epoch: int
    ntokens: np.ndarray | None
    src_ntokens: np.ndarray | None
    samples: np.ndarray | None
    fingerprints: np.ndarray | None
    mine: dict[int, tuple[int, np.ndarray]]
    shapes: np.ndarray | None = None

    def __len__(self) -> int:
        return int((self.ntokens if self.ntokens is not None else self.shapes).size)


def _batches_of(g: int | np.ndarray, idx: np.ndarray, ends: np.ndarray) -> list[tuple]:
    """``idx`` cut at ``ends`` into (direction, indices) pairs, int32 where they fit;
    ``g`` is one direction or each sample's (a pooled batch of several directions keeps the
    array, a pooled batch of one direction the int)."""
    if ends.size == 0:
        return []
    small = idx.astype(np.int32) if idx.size and idx.max() < 2**31 else idx
    parts = np.split(small, ends[:-1])
    if np.ndim(g) == 0:
        return [(int(g), part) for part in parts]
    out = []
    for groups, part in zip(np.split(np.asarray(g), ends[:-1]), parts, strict=True):
        one = groups.size and (groups == groups[0]).all()
        out.append((int(groups[0]) if one else groups, part))
    return out


def _stats(bounds: np.ndarray, per_sample: list[np.ndarray]) -> list[np.ndarray]:
    """Sums of each array of ``per_sample`` over the batches ending at ``bounds``."""
    if bounds.size == 0:  # a direction with no batch of its own (its sentences pooled)
        return [x[:0] for x in per_sample]
    starts = np.concatenate([[0], bounds[:-1]]).astype(np.int64)
    return [np.add.reduceat(x, starts) for x in per_sample]


def bucket_identity(buckets: Buckets | None) -> str:
    """What a saved stream position records of the bucket shapes: their digest, or "off"."""
    return "off" if buckets is None else buckets.digest()


def check_bucket_state(state: dict, mine: str) -> None:
    """A DataError when a saved stream position was cut with other bucket shapes than
    ``mine`` (:func:`bucket_identity`): resuming would read other batches than the run did."""
    saved = state.get("bucket_shapes", "off")
    if saved == mine:
        return
    if saved == "off":
        raise DataError(
            "the checkpoint's stream was cut without bucket shapes (data.bucket_shapes=0, or a "
            "run started before they existed): resume it with data.bucket_shapes=0"
        )
    if mine == "off":
        raise DataError(
            f"the checkpoint's stream was cut into bucket shapes ({saved}); this config has "
            "data.bucket_shapes=0: resume with the run's data.bucket_shapes"
        )
    raise DataError(
        f"the checkpoint's stream was cut into other bucket shapes ({saved}) than this config "
        f"and data give ({mine}): resume with the run's data.bucket_shapes, data.max_tokens "
        "and data"
    )


class BatchSampler:
    """Token-budget batches over the directions of a :class:`SampleSource`.

    ``shuffle=True`` iterates forever (epochs advance; see the module docstring);
    ``shuffle=False`` makes one length-sorted pass. With ``world_size > 1`` each rank gets every
    ``world_size``-th batch of the same plan (the shuffled plan is cut to a multiple of it).

    ``max_shapes`` > 0 (shuffled only) cuts the batches to at most that many bucket shapes
    chosen from the lengths of the data (:attr:`buckets`, data/buckets.py); the batches are
    not padded here (``buckets.pad`` does it). ``keep_keys=False`` keeps no per-sample array
    and reads the lengths again for each epoch (a stage that only follows the shapes).
    """

    def __init__(
        self,
        data: SampleSource,
        max_tokens: int,
        temperature: float,
        seed: int,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
        max_shapes: int = 0,
        keep_keys: bool = True,
    ) -> None:
        if max_tokens < 1:
            raise DataError(f"max_tokens must be >= 1, got {max_tokens}")
        if temperature <= 0:
            raise DataError(f"sampling temperature must be > 0, got {temperature}")
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} outside world_size {world_size}")
        self.data = data
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self._keys: list[np.ndarray] = []
        counts = []
        for g, name in enumerate(data.directions):
            src_len, tgt_len = data.group_lengths(g)
            key = np.maximum(src_len, tgt_len)
            valid = data.group_indices(g)
            if valid.size and int(key[valid].max()) > max_tokens:
                raise DataError(
                    f"direction {name}: a sample of {int(key[valid].max())} tokens exceeds "
                    f"max_tokens={max_tokens}; lower data.max_length to at most max_tokens - 2"
                )
            # Small integer keys let numpy's stable sort use radix sort.
            self._keys.append(key.astype(np.uint16) if key.max(initial=0) < 2**16 else key)
            counts.append(valid.size)
        self.counts = np.array(counts, dtype=np.int64)
        if self.counts.sum() == 0:
            raise DataError("no samples to batch (every direction is empty)")
        self.probs = temperature_probs(self.counts, temperature)
        self.epoch_counts = allocate(int(self.counts.sum()), self.probs)
        """Samples per direction in every shuffled epoch."""
        self.buckets: Buckets | None = None
        if max_shapes and shuffle:
            self._choose_buckets(max_shapes, keep_keys)
        self._epoch = 0
        self._position = 0
        self._cached: tuple[int, list[tuple[int, np.ndarray]]] | None = None

    def _choose_buckets(self, max_shapes: int, keep_keys: bool) -> None:
        """The bucket shapes of the lengths each direction is drawn with; each sample's key
        becomes its bucket (kept, one byte a sample, or read again when needed)."""
        hist = LengthHistogram()
        for g in range(len(self.data.directions)):
            src_len, tgt_len = self.data.group_lengths(g)
            valid = self.data.group_indices(g)
            hist.add(src_len[valid], tgt_len[valid], int(self.epoch_counts[g]), valid.size)
        self.buckets = choose_buckets(hist, self.max_tokens, max_shapes)
        self._keys = [None] * len(self.data.directions)
        if keep_keys:
            self._keys = [self._sort_keys(g) for g in range(len(self.data.directions))]

    def _sort_keys(self, g: int) -> np.ndarray:
        """Direction ``g``'s sort key of every local index: max(S, T), or the bucket."""
        if self._keys[g] is not None:
            return self._keys[g]
        return self.buckets.bucket_of(*self.data.group_lengths(g))

    # --- the plan of one epoch -------------------------------------------------------------

    def _rng(self, *words: int) -> np.random.Generator:
        return np.random.default_rng([self.seed & 0xFFFFFFFF, *words])

    def _epoch_samples(self, g: int, epoch: int) -> np.ndarray:
        """Direction ``g``'s samples of ``epoch``: positions [epoch*k, (epoch+1)*k) of its
        stream of permutations."""
        valid, k = self.data.group_indices(g), int(self.epoch_counts[g])
        n = valid.size
        if k == 0 or n == 0:
            return np.zeros(0, dtype=np.int64)
        first, last = epoch * k, (epoch + 1) * k  # stream positions
        parts = []
        for p in range(first // n, (last - 1) // n + 1):
            perm = self._rng(_STREAM_PASS, g, p).permutation(n)
            lo, hi = max(first, p * n) - p * n, min(last, (p + 1) * n) - p * n
            parts.append(valid[perm[lo:hi]])
        return np.concatenate(parts)

    def _direction_batches(
        self, g: int, epoch: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Direction ``g``'s samples of ``epoch`` in batch order and where each batch ends;
        with bucket shapes, its full micro-batches only, and the sentences left over in each
        bucket (indices and buckets, bucket order), which :meth:`_tail_batches` pools with the
        other directions' (docs/design.md §18)."""
        if self.shuffle:  # shuffled first, so the stable sort breaks ties at random
            idx = self._epoch_samples(g, epoch)
            idx = idx[self._rng(_STREAM_TIEBREAK, g, epoch).permutation(idx.size)]
        else:
            idx = self.data.group_indices(g)
        keys = self._sort_keys(g)[idx]
        order = np.argsort(keys, kind="stable")
        idx, keys = idx[order], keys[order]
        if self.buckets is None:
            return idx, _batch_ends(keys, self.max_tokens), idx[:0], keys[:0]
        counts = np.bincount(keys, minlength=len(self.buckets))
        full = self.buckets.full_and_rest(counts)[0]
        starts = np.cumsum(counts) - counts
        in_full = np.arange(idx.size) - starts[keys] < full[keys]  # place in its bucket's run
        return idx[in_full], self.buckets.batch_ends(full)[0], idx[~in_full], keys[~in_full]

    def _tail_batches(
        self, rests: list[tuple[np.ndarray, np.ndarray]]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The epoch's last batches: every direction's leftover sentences (``rests[g]``:
        indices and buckets, as :meth:`_direction_batches` gives them) pooled by bucket
        (bucket, then direction, then the direction's order), cut by :meth:`Buckets.arrange`
        and :meth:`Buckets.batch_ends`. Returns the direction and index of each sentence in
        batch order, and where each batch ends."""
        groups = np.concatenate(
            [np.full(idx.size, g, dtype=np.int64) for g, (idx, _) in enumerate(rests)]
        )
        idx = np.concatenate([idx for idx, _ in rests])
        keys = np.concatenate([keys for _, keys in rests])
        order = np.argsort(keys, kind="stable")
        groups, idx, keys = groups[order], idx[order], keys[order]
        ranges, final = self.buckets.arrange(np.bincount(keys, minlength=len(self.buckets)))
        take = np.concatenate(
            [np.arange(a, b) for runs in ranges for a, b in runs] or [np.zeros(0, np.int64)]
        )
        return groups[take], idx[take], self.buckets.batch_ends(final)[0]

    def _count_batches(self, epoch: int) -> tuple[np.ndarray, np.ndarray | None]:
        """How many batches each direction cuts in ``epoch`` (with bucket shapes, one more
        entry: the pooled last batches of :meth:`_tail_batches`), and the bucket of each batch
        in that order (None without buckets). The cut depends only on the sorted keys, that
        is on their histogram: no tie-break permutation or sort here."""
        ndir = len(self.data.directions)
        counts = np.zeros(ndir + (self.buckets is not None), dtype=np.int64)
        buckets, tail = [], 0
        for g in range(ndir):
            hist = np.bincount(self._sort_keys(g)[self._epoch_samples(g, epoch)])
            if self.buckets is None:
                keys = np.repeat(np.arange(hist.size, dtype=self._keys[g].dtype), hist)
                counts[g] = _batch_ends(keys, self.max_tokens).size
                continue
            hist = np.pad(hist, (0, len(self.buckets) - hist.size))
            full, rest = self.buckets.full_and_rest(hist)
            ends, of_batch = self.buckets.batch_ends(full)
            counts[g] = ends.size
            buckets.append(of_batch)
            tail = tail + rest
        if self.buckets is None:
            return counts, None
        ends, of_batch = self.buckets.batch_ends(self.buckets.arrange(tail)[1])
        counts[ndir] = ends.size
        buckets.append(of_batch)
        return counts, np.concatenate(buckets)

    def _cut(self, epoch: int):
        """Each batch group of ``epoch`` in batch-id order: (direction, or per-sample
        directions for the pooled last batches, indices, batch ends)."""
        rests = []
        for g in range(len(self.data.directions)):
            idx, ends, rest_idx, rest_keys = self._direction_batches(g, epoch)
            rests.append((rest_idx, rest_keys))
            yield g, idx, ends
        if self.buckets is not None:
            yield self._tail_batches(rests)

    def _plan(self, epoch: int) -> list[tuple[int, np.ndarray]]:
        """Every batch of ``epoch`` for this rank (the whole plan: a validation pass, tests)."""
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        batches: list[tuple[Any, np.ndarray]] = []
        for g, idx, ends in self._cut(epoch):
            batches += _batches_of(g, idx, ends)
        if self.shuffle:
            perm = self._rng(_STREAM_ORDER, epoch).permutation(len(batches))
            batches = [batches[i] for i in perm]
            batches = batches[: len(batches) - len(batches) % self.world_size]
        batches = batches[self.rank :: self.world_size]
        if self.shuffle and not batches:
            raise DataError(
                f"no batch for rank {self.rank} of {self.world_size} in an epoch "
                f"({int(self.counts.sum())} samples, max_tokens={self.max_tokens})"
            )
        self._cached = (epoch, batches)
        return batches

    def epoch_plan(self, epoch: int, keep: Callable[[np.ndarray], np.ndarray]) -> EpochPlan:
        """Epoch ``epoch`` of the shuffled stream (``world_size`` 1), holding the samples of
        only the positions where ``keep(positions)`` is True: the same batches as
        :meth:`_plan`, built one direction at a time, so memory follows the largest
        direction and this rank's share rather than the corpus (docs/design.md §15)."""
        if not self.shuffle or self.world_size != 1:
            raise ValueError("epoch_plan is the shuffled stream of one sampler for all ranks")
        # Pass 1: how many batches each direction cuts, and the global order.
        counts, buckets, perm = self._order(epoch)
        total = perm.size
        first = np.concatenate([[0], np.cumsum(counts)])  # batch ids of each direction
        positions = np.flatnonzero(keep(np.arange(total)))
        position_of = np.full(total, -1, dtype=np.int64)  # batch -> position, where kept
        position_of[perm[positions]] = positions
        sums = [np.zeros(total, dtype=np.int64) for _ in range(3)]
        prints = np.zeros(total, dtype=np.uint64)
        mine: dict[int, tuple[Any, np.ndarray]] = {}
        # Pass 2: each direction's batches, their sizes, and a copy of the kept ones only;
        # with bucket shapes, last the batches of the sentences every direction left over.
        for part, (g, idx, ends) in enumerate(self._cut(epoch)):
            if ends.size != counts[part]:
                raise RuntimeError(
                    f"batch group {part}: {ends.size} batches, counted {counts[part]}"
                )
            src_len, tgt_len, ids = self._per_sample(g, idx)
            lo, hi = int(first[part]), int(first[part + 1])
            *per_batch, prints[lo:hi] = _stats(
                ends, [tgt_len, src_len, np.ones_like(idx), id_fingerprints(ids)]
            )
            for total_of, batch_part in zip(sums, per_batch, strict=True):
                total_of[lo:hi] = batch_part
            kept = position_of[lo:hi] >= 0
            if kept.any():
                sample_kept = np.repeat(kept, per_batch[2])  # copies: idx itself is let go
                own_g = g if np.ndim(g) == 0 else g[sample_kept]
                held = _batches_of(own_g, idx[sample_kept], np.cumsum(per_batch[2][kept]))
                for pos, batch in zip(position_of[lo:hi][kept].tolist(), held, strict=True):
                    mine[pos] = batch
        return EpochPlan(
            epoch,
            ntokens=sums[0][perm],
            src_ntokens=sums[1][perm],
            samples=sums[2][perm],
            fingerprints=prints[perm],
            mine=mine,
            shapes=None if buckets is None else buckets[perm],
        )

    def _per_sample(
        self, g: int | np.ndarray, idx: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Source length, target length and global id of samples ``idx`` of direction ``g``
        (one direction, or each sample's)."""
        if np.ndim(g) == 0:
            src_len, tgt_len = self.data.group_lengths(int(g))
            return src_len[idx], tgt_len[idx], idx + self.data.sample_offset(int(g))
        out = [np.zeros(idx.size, dtype=np.int64) for _ in range(3)]
        for d, at in _by_group(g):
            for x, y in zip(out, self._per_sample(d, idx[at]), strict=True):
                x[at] = y
        return tuple(out)

    def _order(self, epoch: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """Batches per direction, the bucket of each batch (direction order; None without
        buckets) and the permutation position -> batch of ``epoch``."""
        counts, buckets = self._count_batches(epoch)
        total = int(counts.sum())
        if total == 0:
            raise DataError(f"no batch in an epoch ({int(self.counts.sum())} samples)")
        return counts, buckets, self._rng(_STREAM_ORDER, epoch).permutation(total)

    def epoch_shapes(self, epoch: int) -> EpochPlan:
        """The bucket of every batch of epoch ``epoch`` in stream order, and nothing else:
        what a pipeline stage that reads no data needs to know the shape of each micro-batch
        it receives (pass 1 of :meth:`epoch_plan` only)."""
        if self.buckets is None or not self.shuffle or self.world_size != 1:
            raise ValueError("epoch_shapes is the bucketed shuffled stream of one sampler")
        _, buckets, perm = self._order(epoch)
        return EpochPlan(epoch, None, None, None, None, {}, shapes=buckets[perm])

    def collate(self, group: int | np.ndarray, indices: np.ndarray) -> dict[str, Any]:
        """The batch of these samples of direction ``group`` (or of each sample's)."""
        return self.data.collate(group, indices)

    def batches_per_epoch(self, epoch: int = 0) -> int:
        """Number of batches this rank gets in ``epoch`` (one pass when not shuffling)."""
        return len(self._plan(epoch))

    # --- iteration and resume --------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if not self.shuffle:
            for g, idx in self._plan(0):
                yield self.data.collate(g, idx)
            return
        while True:
            plan = self._plan(self._epoch)
            while self._position < len(plan):
                g, idx = plan[self._position]
                self._position += 1
                yield self.data.collate(g, idx)
            self._epoch += 1
            self._position = 0

    def identity(self) -> dict:
        """What a saved position is only valid with (seed, budget, sharding, data size, bucket
        shapes)."""
        return {
            "seed": self.seed,
            "max_tokens": self.max_tokens,
            "world_size": self.world_size,
            "rank": self.rank,
            "num_samples": int(self.counts.sum()),
            "bucket_shapes": bucket_identity(self.buckets),
            **({} if self.buckets is None else {"bucket_tails": POOLED_TAILS}),
        }

    def state_dict(self) -> dict:
        """Where the sampler stands: batches yielded so far in the current epoch."""
        return {"epoch": self._epoch, "position": self._position, **self.identity()}

    def check_state(self, state: dict) -> None:
        """A DataError when ``state`` was saved by a sampler with another identity."""
        mine = self.identity()
        check_bucket_state(state, mine["bucket_shapes"])
        if self.buckets is not None and state.get("bucket_tails") != POOLED_TAILS:
            raise DataError(
                "the checkpoint's stream kept each direction's last, partly filled micro-batches "
                "apart (a version before they were pooled across directions, docs/design.md "
                "§18): resume it with the version that wrote it"
            )
        for key, value in mine.items():
            if key in state and state[key] != value:
                raise DataError(
                    f"sampler state was saved with {key}={state[key]}, this sampler has {value}"
                )

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly after the last batch yielded when ``state`` was saved."""
        self.check_state(state)
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self._plan(epoch)):
            raise DataError(f"sampler state epoch={epoch} position={position} is out of range")
        self._epoch, self._position = epoch, position
