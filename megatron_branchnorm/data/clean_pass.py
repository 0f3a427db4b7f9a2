"""Preprocessing's first pass, ``read_clean``: every pair and split of the raw corpus read,
checked and cleaned into spill files, chunk by chunk (docs/data.md, "Streaming and memory").

Each pair and split's files are read together in chunks of ``chunk_lines`` lines, checked
(equal line counts, UTF-8: the same errors, naming file and line, as reading them whole) and
cleaned (:func:`text.clean`) by the pool's workers (data/workers.py); a pair is dropped, and
counted, when a side had invalid UTF-8 (``--on-bad-utf8 skip``) or is empty after cleaning. A
side over ``max_line_bytes`` bytes is never held in memory (:func:`text.read_past_line`: only
its length and UTF-8 validity are kept); its training pair is dropped as ``too_long`` (far
over what the encoding pass's ``max_len`` tokens hold), and in dev/test, whose references keep
every line, it is an error naming the line. So no pass holds more than the cap of one line,
however long the corpus's lines: the spill files that the later passes read hold lines of at
most the cap (cleaning never lengthens a line; ``--on-bad-utf8 replace`` at most triples it).
The cleaned lines go to the spill files, the raw dev/test text to ``raw/<split>.<pair>.<lang>``
(every line, unfiltered: the evaluation references). A moses pair without dev/test files holds
them out by a one-byte split label per line (:func:`corpora.hold_out_labels`). What the pass
leaves per pair and split (:class:`CleanedSplit`) is what SentencePiece's sample and the
encoding pass (data/encode_pass.py) read back.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from megatron_branchnorm.data.corpora import (
    SPLITS,
    LineReader,
    SplitFiles,
    count_lines,
    hold_out_labels,
    line_mismatch,
    origin,
    pair_name,
)
from megatron_branchnorm.data.progress import progress_bar
from megatron_branchnorm.data.text import (
    LongLine,
    clean_lines,
    decode_block,
    reference_block,
    utf8_error,
)
from megatron_branchnorm.data.workers import WorkerPool, in_order
from megatron_branchnorm.formats.data_dir import DataError


@dataclass
class CleanedSplit:
    """One pair and split as pass 1 leaves it: cleaned lines in two spill files (pivot and
    other side, one line each, ``\\n``-terminated), counts, and byte offsets cutting the spill
    files into encoding chunks of at least ``chunk_lines`` lines."""

    spill: tuple[Path, Path]
    origin: str
    raw: int = 0
    kept: int = 0
    bad_utf8: int = 0
    empty: int = 0
    too_long: int = 0
    """Training pairs with a side over the byte cap, dropped before cleaning."""
    replaced: int = 0
    cuts: list[tuple[int, int]] = field(default_factory=lambda: [(0, 0)])
    sizes: list[int] = field(default_factory=lambda: [0, 0])
    uncut: int = 0

    def cut(self) -> None:
        """Close the current encoding chunk (if it has lines)."""
        if self.uncut:
            self.cuts.append((self.sizes[0], self.sizes[1]))
            self.uncut = 0

    def filters(self, too_long: int = 0) -> dict[str, int]:
        """Pairs dropped, per filter (the manifest's ``filters``); ``too_long``: by the
        encoding pass, added to those over the byte cap."""
        return {
            "bad_utf8": self.bad_utf8,
            "empty": self.empty,
            "too_long": self.too_long + too_long,
        }


_Cleaned = tuple[bytes, bytes, int, int, int, int, int, int, tuple[bytes, bytes] | None]
"""One split's share of a chunk: pivot and other spill text, lines kept, raw lines, dropped
for bad UTF-8, dropped as empty, dropped as over the byte cap, bad UTF-8 lines kept with
U+FFFD, and the raw references (dev/test only)."""

_Task = tuple[bytes, bytes, int | np.ndarray | None, str, dict[int, LongLine], dict[int, LongLine]]
"""A block of line pairs to clean: pivot and other lines, their splits, ``--on-bad-utf8``, and
the lines over the byte cap on each side (empty in the block)."""


def _joined(lines: list[str]) -> bytes:
    return "".join(x + "\n" for x in lines).encode("utf-8")


def _with_long(
    bad: list[int], err: tuple[int, int, int] | None, long: dict[int, LongLine]
) -> tuple[list[int], tuple[int, int, int] | None]:
    """:func:`text.decode_block`'s invalid-UTF-8 lines and first error, counting those of the
    block's lines over the byte cap."""
    firsts = [(i, *x.bad_utf8) for i, x in long.items() if x.bad_utf8 is not None]
    if not firsts:
        return bad, err
    return sorted({*bad, *(i for i, *_ in firsts)}), min([*firsts, *([err] if err else [])])


def _clean_chunk(
    task: _Task,
) -> tuple[tuple[int, int, int] | None, tuple[int, int, int] | None, dict[int, _Cleaned] | None]:
    """Decode and clean a block of line pairs (in a worker): the first invalid UTF-8 of each
    side (line in the block, column, byte) and, per split, what goes to its files. ``labels``
    is the split of every line (an index into SPLITS, or one for the whole block); None: the
    sides are not paired (past the end of the shorter file), only check them. A pair with a
    side over the byte cap is dropped (``too_long``)."""
    pivot_block, other_block, labels, on_bad_utf8, p_long, o_long = task
    p_lines, p_bad, p_err = decode_block(pivot_block)
    o_lines, o_bad, o_err = decode_block(other_block)
    p_bad, p_err = _with_long(p_bad, p_err, p_long)
    o_bad, o_err = _with_long(o_bad, o_err, o_long)
    if labels is None or (on_bad_utf8 == "error" and (p_err or o_err)):
        return p_err, o_err, None
    bad = set(p_bad).union(o_bad)
    p_clean, o_clean = clean_lines(p_lines), clean_lines(o_lines)
    if isinstance(labels, (int, np.integer)):
        groups = {int(labels): range(len(p_lines))}
    else:
        groups = {
            s: idx.tolist() for s in range(len(SPLITS)) if (idx := np.flatnonzero(labels == s)).size
        }
    skip = on_bad_utf8 == "skip"
    out: dict[int, _Cleaned] = {}
    for s, idx in groups.items():
        keep_p, keep_o = [], []
        n_bad = n_empty = n_long = 0
        for i in idx:
            if skip and i in bad:
                n_bad += 1
                continue
            if i in p_long or i in o_long:
                n_long += 1
                continue
            a, b = p_clean[i], o_clean[i]
            if a and b:
                keep_p.append(a)
                keep_o.append(b)
            else:
                n_empty += 1
        replaced = sum(i in bad for i in idx) if bad and on_bad_utf8 == "replace" else 0
        refs = None
        if SPLITS[s] != "train":
            refs = tuple(
                reference_block([lines[i] for i in idx]).encode("utf-8")
                for lines in (p_lines, o_lines)
            )
        counts = (len(keep_p), len(idx), n_bad, n_empty, n_long, replaced)
        out[s] = (_joined(keep_p), _joined(keep_o), *counts, refs)
    return p_err, o_err, out


def _long_reference_error(
    labels: int | np.ndarray, long: dict[int, LongLine], path: Path, first: int, cap: int
) -> DataError | None:
    """The error for the first of ``long`` (lines over the byte cap ``cap``, numbered from
    line ``first`` of ``path``) that falls in dev or test, whose references keep every line."""
    for i, line in sorted(long.items()):
        split = SPLITS[int(labels if isinstance(labels, int) else labels[i])]
        if split != "train":
            held = "" if isinstance(labels, int) else "held-out "
            return DataError(
                f"{path}:{first + i + 1}: a line of {line.nbytes} bytes, over the {cap} bytes "
                f"a line may have, in the {held}{split} split, whose references keep every "
                "line: remove or shorten the pair"
            )
    return None


def _chunk_tasks(
    files: SplitFiles,
    labels: int | np.ndarray,
    on_bad_utf8: str,
    chunk_lines: int,
    max_line_bytes: int,
) -> Iterator[tuple[tuple, _Task | None]]:
    """Tasks for :func:`_clean_chunk` over each pair of files of a split, ``chunk_lines``
    lines at a time, then an ``end`` marker per pair of files. Once the shorter file ends, the
    rest of the longer one is still read (only checked), so that its invalid UTF-8 is reported
    before the line counts, as when files were read whole. A line over ``max_line_bytes`` is
    never held (:class:`corpora.LineReader`); a chunk's meta carries the error for one in dev
    or test."""
    offset = 0
    for pf, of in zip(files.pivot_files, files.other_files, strict=True):
        with LineReader(pf, max_line_bytes) as rp, LineReader(of, max_line_bytes) as ro:
            paired = True
            while True:
                p_first, o_first = rp.lines, ro.lines
                pb, na, p_long = rp.take(chunk_lines)
                ob, nb, o_long = ro.take(chunk_lines)
                if na == nb == 0:
                    break
                nbytes = (
                    len(pb) + len(ob) + sum(x.nbytes for x in (*p_long.values(), *o_long.values()))
                )
                if paired and na == nb:
                    part = labels if isinstance(labels, int) else labels[offset : offset + na]
                    offset += na
                    whole = _long_reference_error(part, p_long, pf, p_first, max_line_bytes)
                    whole = whole or _long_reference_error(
                        part, o_long, of, o_first, max_line_bytes
                    )
                    meta = ("chunk", pf, of, p_first, o_first, nbytes, whole)
                    yield meta, (pb, ob, part, on_bad_utf8, p_long, o_long)
                else:
                    paired = False
                    meta = ("chunk", pf, of, p_first, o_first, nbytes, None)
                    yield meta, (pb, ob, None, on_bad_utf8, p_long, o_long)
            yield ("end", pf, of, rp.lines, ro.lines, 0, None), None


def _doing(meta: tuple) -> str:
    """What a worker cleaning the chunk of ``meta`` (:func:`_chunk_tasks`) is doing."""
    _, pf, of, p_first, o_first, *_ = meta
    return f"cleaning {pf} from line {p_first + 1} and {of} from line {o_first + 1}"


def _write_lines(f: BinaryIO, lines: bytes) -> None:
    """Append ``\\n``-terminated lines (UTF-8) to an open file."""
    f.write(lines)


def read_clean(
    found: dict[str, dict[str, SplitFiles]],
    pool: WorkerPool | None,
    spill_dir: Path,
    raw_dir: Path,
    *,
    pivot: str,
    on_bad_utf8: str,
    seed: int,
    dev_size: int,
    test_size: int,
    workers: int,
    progress: bool | None,
    chunk_lines: int,
    max_line_bytes: int,
) -> dict[tuple[str, str], CleanedSplit]:
    """Pass 1: every pair's splits (``found``: :func:`corpora.discover`'s) cleaned into spill
    files in ``spill_dir`` (created here), the raw dev/test references written to ``raw_dir``,
    everything validated (line counts, UTF-8) with the errors of reading whole files. ``pool``
    (None: this process) runs the chunks of ``chunk_lines`` lines; ``seed`` decides held-out
    splits (and names them in errors); a training pair with a side over ``max_line_bytes`` is
    dropped as ``too_long`` without being held in memory, such a dev/test line is an error."""
    mode = on_bad_utf8
    spill_dir.mkdir()
    total = 0
    for splits in found.values():
        for sf in splits.values():
            for path in (*sf.pivot_files, *sf.other_files):
                try:
                    total += path.stat().st_size
                except OSError as exc:
                    raise DataError(f"{path}: cannot read: {exc.strerror or exc}") from None
    bar = progress_bar(progress, total=total, unit="B", unit_scale=True, desc="read/clean")
    out: dict[tuple[str, str], CleanedSplit] = {}
    try:
        for lang, splits in found.items():
            pair = pair_name(pivot, lang)
            held_out = "dev" not in splits
            states = {
                split: CleanedSplit(
                    (spill_dir / f"{split}.{pair}.{pivot}", spill_dir / f"{split}.{pair}.{lang}"),
                    origin(splits["train" if held_out else split], split, held_out, seed),
                )
                for split in SPLITS
            }
            with ExitStack() as files:
                spill = {
                    s: tuple(files.enter_context(open(p, "wb")) for p in states[split].spill)
                    for s, split in enumerate(SPLITS)
                }
                refs = {
                    s: tuple(
                        files.enter_context(open(raw_dir / f"{split}.{pair}.{code}", "wb"))
                        for code in (pivot, lang)
                    )
                    for s, split in enumerate(SPLITS)
                    if split != "train"
                }
                sources: list[tuple[SplitFiles, int | np.ndarray]]
                if held_out:
                    train = splits["train"]
                    n = sum(count_lines(p) for p in train.pivot_files)
                    labels = hold_out_labels(n, dev_size, test_size, seed)
                    sources = [(train, labels)]
                else:
                    sources = [(splits[split], s) for s, split in enumerate(SPLITS)]
                for sf, labels in sources:
                    tasks = _chunk_tasks(sf, labels, mode, chunk_lines, max_line_bytes)
                    other_error: DataError | None = None
                    for meta, res in in_order(_clean_chunk, tasks, pool, workers, _doing):
                        kind, pf, of, p_at, o_at, nbytes, long_reference = meta
                        if kind == "end":
                            if other_error is not None:
                                raise other_error
                            if p_at != o_at:
                                raise DataError(line_mismatch(pf, p_at, of, o_at))
                            continue
                        p_err, o_err, cleaned = res
                        if mode == "error" and p_err is not None:
                            raise utf8_error(pf, p_at + p_err[0] + 1, *p_err[1:])
                        if mode == "error" and o_err is not None and other_error is None:
                            other_error = utf8_error(of, o_at + o_err[0] + 1, *o_err[1:])
                        bar.update(nbytes)
                        if cleaned is None or other_error is not None:
                            continue
                        if long_reference is not None:
                            raise long_reference
                        for s, (
                            p_text,
                            o_text,
                            kept,
                            raw,
                            n_bad,
                            n_empty,
                            n_long,
                            repl,
                            ref,
                        ) in cleaned.items():
                            st = states[SPLITS[s]]
                            _write_lines(spill[s][0], p_text)
                            _write_lines(spill[s][1], o_text)
                            st.sizes[0] += len(p_text)
                            st.sizes[1] += len(o_text)
                            st.kept += kept
                            st.uncut += kept
                            st.raw += raw
                            st.bad_utf8 += n_bad
                            st.empty += n_empty
                            st.too_long += n_long
                            st.replaced += repl
                            if st.uncut >= chunk_lines:
                                st.cut()
                            if ref is not None:
                                _write_lines(refs[s][0], ref[0])
                                _write_lines(refs[s][1], ref[1])
                    if held_out:
                        del labels
            for split, st in states.items():
                st.cut()
                out[(lang, split)] = st
    finally:
        bar.close()
    return out
