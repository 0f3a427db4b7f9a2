"""Static micro-batch shapes: every training micro-batch padded to one of a few fixed
(sentences, source length, target length) buckets chosen from the corpus's lengths
(docs/design.md §18).

A bucket shape is ``(rows, src_len, tgt_len)`` with ``rows = max_tokens // max(src_len,
tgt_len)``, so a padded micro-batch never holds more than ``data.max_tokens`` slots on either
side. A sentence pair of tensor lengths (S, T) belongs to the cheapest shape that holds it
(``src_len >= S`` and ``tgt_len >= T``, least ``src_len + tgt_len``, the first of equals); the
sampler cuts each bucket's sentences of a direction into full micro-batches of ``rows``
sentences and pools what each direction leaves over in a bucket (fewer than ``rows``) with the
other directions' into the epoch's last micro-batches of that bucket, so a micro-batch never
mixes buckets (a bucket's last, mostly empty micro-batch may give its sentences to a larger
shape: :meth:`Buckets.arrange`). Kept apart, those leftovers made a third of an epoch's padding
on a corpus of many small directions.

The shapes are chosen greedily over the two-dimensional histogram of (S, T), weighted by how
often each direction's sentences are drawn per epoch: starting from the one shape that holds
every sentence, each step adds the shape that saves the most padded slots. Of these nested
sets, the fewest shapes whose epoch padding (lengths and partly filled micro-batches, computed
from the histogram) is at most :data:`TARGET_PADDING` are taken (:func:`choose_buckets`).
Lengths are multiples of :data:`MULTIPLE` when that reaches the target, any length otherwise
(short sentences: rounding 12 tokens up to 16 is a third of padding). All weights are
integers and ties go to the smallest lengths, so every rank of a job, on any machine, chooses
the same shapes.

A padding row (a micro-batch with fewer sentences than its shape's rows) is ``<EOS>`` followed
by padding on the source side and padding only on the target side: it carries no loss and no
gradient, and its attention always has one key that is not padding (an all-padding key set
gives NaN in softmax, which its zero loss weight would not stop: NaN x 0 is NaN).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from megatron_branchnorm.tokens import EOS_ID, PAD_ID

AUTO_MAX_SHAPES = 48
"""Most shapes ``data.bucket_shapes: auto`` may choose."""
MAX_SHAPES = 64
"""Most shapes any setting may ask for (a bucket id is one byte; each shape is a set of
buffers, and under CUDA graphs a graph per stage)."""
TARGET_PADDING = 0.09
"""The padding share (source + target slots that hold no token) an epoch may have: the fewest
shapes that keep it at most this are chosen (:func:`choose_buckets`)."""
MULTIPLE = 8
"""Preferred multiple of a bucket length (tensor-core friendly on GPUs)."""


def max_shapes_of(setting: int | str) -> int:
    """The shape budget of ``data.bucket_shapes`` (``auto``, 0 off, or at most N)."""
    if setting == "auto":
        return AUTO_MAX_SHAPES
    if isinstance(setting, int) and not isinstance(setting, bool) and 0 <= setting <= MAX_SHAPES:
        return setting
    raise ValueError(
        f"bucket_shapes must be auto or an integer in [0, {MAX_SHAPES}], got {setting!r}"
    )


@dataclass(frozen=True)
class Shape:
    """One bucket: micro-batches of ``rows`` sentence pairs, sources padded to ``src_len``
    tokens and targets to ``tgt_len`` (specials included)."""

    rows: int
    src_len: int
    tgt_len: int

    def __str__(self) -> str:
        return f"{self.rows}x{self.src_len}x{self.tgt_len}"


class LengthHistogram:
    """Integer weights over (source length, target length): ``weights`` summed over
    directions, and each direction's cells apart (``directions``: its batches are cut apart)."""

    def __init__(self) -> None:
        self.weights = np.zeros((1, 1), dtype=np.int64)  # [S, T]
        self.directions: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (S, T, w)

    def add(self, src_len: np.ndarray, tgt_len: np.ndarray, drawn: int, usable: int) -> None:
        """Add one direction's usable samples, of tensor lengths ``src_len`` / ``tgt_len``,
        weighted by ``drawn / usable`` (its samples per epoch over its usable samples) and
        rounded to integers (a cell that rounds to 0 keeps weight 1: it must be held)."""
        if src_len.size == 0 or drawn == 0:
            return
        s, t = np.asarray(src_len, dtype=np.int64), np.asarray(tgt_len, dtype=np.int64)
        width = int(t.max()) + 1
        counts = np.bincount(s * width + t, minlength=(int(s.max()) + 1) * width)
        counts = counts.reshape(-1, width)
        # One IEEE division and rounding per cell: the same integers on every machine.
        scaled = np.rint(counts * (drawn / usable)).astype(np.int64)
        scaled[(counts > 0) & (scaled == 0)] = 1
        cells = np.nonzero(scaled)
        self.directions.append((cells[0], cells[1], scaled[cells]))
        rows = max(self.weights.shape[0], scaled.shape[0])
        cols = max(self.weights.shape[1], scaled.shape[1])
        grown = np.zeros((rows, cols), dtype=np.int64)
        grown[: self.weights.shape[0], : self.weights.shape[1]] += self.weights
        grown[: scaled.shape[0], : scaled.shape[1]] += scaled
        self.weights = grown


def _round_up(x: np.ndarray, multiple: int, cap: int) -> np.ndarray:
    return np.minimum(-(-x // multiple) * multiple, np.maximum(x, cap))


def _greedy(
    weights: np.ndarray, max_tokens: int, max_shapes: int, multiple: int
) -> list[tuple[int, int]]:
    """Up to ``max_shapes`` (src_len, tgt_len) pairs over the cells of ``weights``, lengths
    rounded up to ``multiple`` (capped at ``max_tokens``), in the order chosen: each first k
    are the greedy choice of k shapes."""
    s_idx, t_idx = np.nonzero(weights)
    w = weights[s_idx, t_idx]
    sb, tb = _round_up(s_idx, multiple, max_tokens), _round_up(t_idx, multiple, max_tokens)
    svals, tvals = np.unique(sb), np.unique(tb)
    grid = np.zeros((svals.size, tvals.size), dtype=np.int64)  # weight per rounded cell
    np.add.at(grid, (np.searchsorted(svals, sb), np.searchsorted(tvals, tb)), w)
    cost = svals[:, None] + tvals[None, :]  # slots per sentence of candidate (i, j)
    cur = np.full(grid.shape, int(cost[-1, -1]), dtype=np.int64)  # the shape holding all
    chosen = [(svals.size - 1, tvals.size - 1)]
    while len(chosen) < max_shapes:
        # gain(i, j): slots saved over cells (a, b) <= (i, j) by a shape of cost c(i, j),
        # summed over the few costs the cells have now: sum_C (C - c)+ x weight(cur == C)
        gain = np.zeros(grid.shape, dtype=np.int64)
        for c in np.unique(cur[grid > 0]).tolist():
            held = np.where(cur == c, grid, 0).cumsum(0).cumsum(1)
            gain += np.maximum(c - cost, 0) * held
        best = int(np.argmax(gain))  # the first of equal gains: smallest lengths
        if gain.flat[best] <= 0:
            break
        i, j = divmod(best, tvals.size)
        chosen.append((i, j))
        cur[: i + 1, : j + 1] = np.minimum(cur[: i + 1, : j + 1], cost[i, j])
    return [(int(svals[i]), int(tvals[j])) for i, j in chosen]


class Buckets:
    """The run's bucket shapes and which one each (source, target) length pair takes."""

    def __init__(self, pairs: list[tuple[int, int]], max_tokens: int, weights: np.ndarray):
        pairs = sorted(set(pairs), key=lambda p: (p[0] + p[1], p))  # cheapest first
        if not pairs or len(pairs) > MAX_SHAPES:
            raise ValueError(f"{len(pairs)} bucket shapes (1 to {MAX_SHAPES})")
        self.max_tokens = max_tokens
        self.shapes = [Shape(max_tokens // max(s, t), s, t) for s, t in pairs]
        self.src_len = np.array([s for s, _ in pairs], dtype=np.int64)
        self.tgt_len = np.array([t for _, t in pairs], dtype=np.int64)
        self.rows = np.array([x.rows for x in self.shapes], dtype=np.int64)
        if (self.rows < 1).any():
            raise ValueError(f"a bucket longer than max_tokens={max_tokens}: {pairs}")
        # lut[S, T]: the cheapest shape holding (S, T), the first of equals; lengths beyond
        # the histogram (samples data.max_length drops) are clipped, never looked up in use.
        s_max, t_max = weights.shape[0] - 1, weights.shape[1] - 1
        s = np.arange(s_max + 1)[:, None, None]
        t = np.arange(t_max + 1)[None, :, None]
        fits = (s <= self.src_len) & (t <= self.tgt_len)  # (S, T, K)
        slots = np.where(fits, self.src_len + self.tgt_len, np.iinfo(np.int64).max)
        self._lut = np.argmin(slots, axis=2).astype(np.uint8)
        held = fits.any(axis=2)
        if not held[weights > 0].all():
            raise ValueError("the bucket shapes do not hold every sentence length")
        s_i, t_i = np.nonzero(weights)
        b = self._lut[s_i, t_i]
        w = weights[s_i, t_i]
        slots_used = int((w * (self.src_len[b] + self.tgt_len[b])).sum())
        self.length_padding = 1.0 - int((w * (s_i + t_i)).sum()) / max(slots_used, 1)
        """Share of padding from lengths alone (the drawn sentences, before partial rows)."""
        # Each shape's parent: the cheapest other shape that holds it (none for the largest).
        cost = self.src_len + self.tgt_len
        self._parent = np.full(len(pairs), -1, dtype=np.int64)
        for b in range(len(pairs)):
            holds = (self.src_len >= self.src_len[b]) & (self.tgt_len >= self.tgt_len[b])
            holds[b] = False
            if holds.any():
                self._parent[b] = int(np.flatnonzero(holds)[np.argmin(cost[holds])])

    def __len__(self) -> int:
        return len(self.shapes)

    def bucket_of(self, src_len: np.ndarray, tgt_len: np.ndarray) -> np.ndarray:
        """The bucket (uint8) of each (source, target) tensor-length pair."""
        s = np.minimum(np.asarray(src_len), self._lut.shape[0] - 1)
        t = np.minimum(np.asarray(tgt_len), self._lut.shape[1] - 1)
        return self._lut[s, t]

    def full_and_rest(self, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``counts`` (sentences per bucket of one direction) split into those that fill whole
        micro-batches of each bucket's rows and those left over, which the sampler pools with
        the other directions' (module docstring)."""
        rest = counts % self.rows
        return counts - rest, rest

    def arrange(self, counts: np.ndarray) -> tuple[list[list[tuple[int, int]]], np.ndarray]:
        """Where each bucket's micro-batches take their sentences from, for sentences sorted by
        bucket with ``counts[b]`` in bucket b: per bucket, ranges of that sorted order, and
        the sentences each bucket ends with.

        A bucket's last micro-batch would hold ``n % rows`` sentences and the rest padding
        rows; those sentences move up to the bucket's parent (the cheapest other shape that
        holds its shape) when that pads fewer tokens than the half-empty micro-batch. Buckets
        are taken cheapest first, so a parent adds its children's sentences (in front of its
        own) before its own last micro-batch is decided."""
        ranges: list[list[tuple[int, int]]] = [[] for _ in self.shapes]
        final = np.zeros(len(self.shapes), dtype=np.int64)
        start = 0
        for b, n in enumerate(np.asarray(counts, dtype=np.int64).tolist()):
            if n:
                ranges[b].append((start, start + n))
            start += n
        cost = self.src_len + self.tgt_len
        for b in range(len(self.shapes)):  # shapes are sorted cheapest first
            held = ranges[b][::-1]  # carried-in ranges come first, own last: ends first here
            n = sum(stop - first for first, stop in held)
            rows, parent = int(self.rows[b]), int(self._parent[b])
            rest = n % rows
            if rest and parent >= 0 and rest * int(cost[parent]) < rows * int(cost[b]):
                moved = []
                while rest:
                    first, stop = held[0]
                    take = min(rest, stop - first)
                    moved.append((stop - take, stop))
                    held[0] = (first, stop - take)
                    if held[0][0] == held[0][1]:
                        held.pop(0)
                    rest -= take
                    n -= take
                ranges[parent] = moved[::-1] + ranges[parent]
            ranges[b] = held[::-1]
            final[b] = n
        return ranges, final

    def batch_ends(self, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Sentences in bucket order, ``counts[b]`` of bucket b (as :meth:`arrange` leaves
        them): where each micro-batch ends (exclusive) and its bucket. Each bucket's run is
        cut into ``rows`` sentences, the last micro-batch of a run holding the rest."""
        ends, buckets, start = [], [], 0
        for b, n in enumerate(np.asarray(counts, dtype=np.int64).tolist()):
            if n == 0:
                continue
            cut = np.arange(int(self.rows[b]), n, int(self.rows[b]), dtype=np.int64)
            ends += [start + cut, np.array([start + n], dtype=np.int64)]
            buckets.append(np.full(cut.size + 1, b, dtype=np.uint8))
            start += n
        if not ends:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint8)
        return np.concatenate(ends), np.concatenate(buckets)

    def digest(self) -> str:
        """A short name of the shapes, stored with the sampler's position: a resume with other
        shapes would read another stream."""
        text = ",".join(str(x) for x in self.shapes) + f"@{self.max_tokens}"
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def epoch_padding(self, hist: LengthHistogram) -> float:
        """The padding share an epoch drawn as ``hist`` would have, cut as the sampler cuts
        it: each direction's full micro-batches per bucket, then the sentences every direction
        left over pooled by bucket and moved up as :meth:`arrange` moves them, every
        micro-batch ``rows`` long (which sentences move does not change the count of slots)."""
        cost = self.src_len + self.tgt_len
        real = slots = 0
        tail = np.zeros(len(self), dtype=np.int64)
        for s, t, w in hist.directions:
            counts = np.bincount(self.bucket_of(s, t), weights=w, minlength=len(self))
            full, rest = self.full_and_rest(counts.astype(np.int64))
            slots += int((full * cost).sum())
            tail += rest
            real += int((w * (s + t)).sum())
        final = self.arrange(tail)[1]
        slots += int((-(-final // self.rows) * self.rows * cost).sum())
        return 1.0 - real / max(slots, 1)

    def padding_share(self, buckets: np.ndarray, real_tokens: int) -> float:
        """Share of padding slots (source + target) in micro-batches of ``buckets`` holding
        ``real_tokens`` tokens in all."""
        b = np.asarray(buckets, dtype=np.int64)
        slots = int((self.rows[b] * (self.src_len[b] + self.tgt_len[b])).sum())
        return 1.0 - real_tokens / max(slots, 1)

    def describe(self) -> str:
        """The shapes, one line."""
        return f"{len(self)} bucket shapes (sentences x source x target tokens): " + " ".join(
            str(x) for x in self.shapes
        )

    def pad(self, batch: dict[str, Any], bucket: int) -> dict[str, Any]:
        """``batch`` with its token tensors padded to bucket ``bucket``'s shape (the counts
        and ids stay those of the real sentences). Padding rows: source ``<EOS> PAD..``,
        previous output and target all PAD (module docstring)."""
        shape = self.shapes[bucket]
        src = batch["src_tokens"]
        rows, s_len = src.shape
        t_len = batch["target"].shape[1]
        if rows > shape.rows or s_len > shape.src_len or t_len > shape.tgt_len:
            raise RuntimeError(
                f"a micro-batch of {rows}x{s_len}x{t_len} does not fit its bucket {shape}"
            )
        out = dict(batch)
        for key, length in (
            ("src_tokens", shape.src_len),
            ("prev_output_tokens", shape.tgt_len),
            ("target", shape.tgt_len),
        ):
            t = batch[key]
            padded = torch.full((shape.rows, length), PAD_ID, dtype=t.dtype)
            padded[: t.shape[0], : t.shape[1]] = t
            out[key] = padded
        out["src_tokens"][rows:, 0] = EOS_ID
        out["bucket"] = bucket
        return out


_TRIED = (1, 2, 3, 4, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64)
"""The shape counts :func:`choose_buckets` measures (and the most it may use)."""


def choose_buckets(hist: LengthHistogram, max_tokens: int, max_shapes: int) -> Buckets | None:
    """At most ``max_shapes`` bucket shapes for the lengths of ``hist`` (None for 0).

    The greedy order (module docstring) gives a set of shapes for each count; each set's
    padding over an epoch is computed from the histogram (:meth:`Buckets.epoch_padding`:
    lengths and partly filled micro-batches, direction by direction). The fewest shapes whose
    padding is at most :data:`TARGET_PADDING` are taken, or, when no set reaches it, the fewest
    within half a point of the best. Lengths in multiples of :data:`MULTIPLE` when those reach
    the target, any lengths otherwise when those pad less."""
    if max_shapes == 0:
        return None
    weights = hist.weights
    if not (weights > 0).any():
        raise ValueError("no sentence lengths to choose bucket shapes from")
    best: tuple[float, Buckets] | None = None
    for multiple in (MULTIPLE, 1):
        order = _greedy(weights, max_tokens, max_shapes, multiple)
        counts = sorted({k for k in _TRIED if k < len(order)} | {len(order)})
        tried = [Buckets(order[:k], max_tokens, weights) for k in counts]
        padding = [b.epoch_padding(hist) for b in tried]
        good = [i for i, x in enumerate(padding) if x <= TARGET_PADDING]
        pick = (
            good[0] if good else next(i for i, x in enumerate(padding) if x <= min(padding) + 0.005)
        )
        if good or best is None or padding[pick] < best[0]:
            best = (padding[pick], tried[pick])
        if good:
            break
    return best[1]
