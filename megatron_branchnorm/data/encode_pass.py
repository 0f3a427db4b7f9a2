"""Preprocessing's encoding pass, ``encode_write``: the spill files of the first pass
(data/clean_pass.py) encoded with the joint SentencePiece model and appended to the indexed
datasets ``bin/<split>.<pair>.<lang>`` (data/indexed_dataset.py), chunk by chunk.

The pool's workers (data/workers.py) encode chunks of the spill files, both sides of a chunk
together, and drop training pairs with a side longer than ``max_len`` tokens (counted; dev/test
keep them); each chunk is appended, in order, as it comes back, so the output does not depend
on the number of workers and memory holds a few chunks per worker, whatever the corpus size.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_branchnorm.data import spm as spm_lib
from megatron_branchnorm.data.clean_pass import CleanedSplit
from megatron_branchnorm.data.corpora import pair_name
from megatron_branchnorm.data.indexed_dataset import IndexedDatasetWriter
from megatron_branchnorm.data.phase_stats import PhaseStats
from megatron_branchnorm.data.progress import progress_bar
from megatron_branchnorm.data.workers import in_order, worker_pool


def _encode_span(task: tuple[Path, int, int, Path, int, int, int | None]) -> tuple:
    """Encode one chunk of both sides (in a worker): read the two byte ranges of the spill
    files, encode, drop the pairs with a side over ``max_len`` tokens (None: keep all).
    Returns (pivot ids, pivot lengths, other ids, other lengths, pairs dropped)."""
    p_path, p0, p1, o_path, o0, o1, max_len = task
    sides = []
    for path, start, end in ((p_path, p0, p1), (o_path, o0, o1)):
        with open(path, "rb") as f:
            f.seek(start)
            text = f.read(end - start).decode("utf-8")
        sides.append(spm_lib.encode_chunk(text[:-1].split("\n")))
    (pf, pn), (of, on) = sides
    if max_len is None:
        return pf, pn, of, on, 0
    keep = (pn <= max_len) & (on <= max_len)
    if keep.all():
        return pf, pn, of, on, 0
    pf, pn = _select(pf, pn, keep)
    of, on = _select(of, on, keep)
    return pf, pn, of, on, int((~keep).sum())


def _select(
    flat: np.ndarray, lengths: np.ndarray, keep: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The sequences of (flat, lengths) where ``keep`` is True."""
    return flat[np.repeat(keep, lengths)], lengths[keep]


@dataclass
class Encoded:
    """One pair and split after encoding: dataset prefixes, tokens and pairs kept."""

    files: dict[str, str]
    tokens: dict[str, int]
    sentences: int
    too_long: int


def encode_all(
    split_states: dict[tuple[str, str], CleanedSplit],
    model_file: str,
    dtype: np.dtype,
    stats: PhaseStats,
    tmp: Path,
    *,
    pivot: str,
    max_len: int,
    workers: int,
    progress: bool | None,
) -> dict[tuple[str, str], Encoded]:
    """Encode every pair and split in ``workers`` processes, writing each chunk to the indexed
    datasets under ``tmp`` as it comes back (in order); the output does not depend on
    ``workers``. ``stats`` is paused while the workers start (data/workers.py)."""

    def tasks() -> Iterator[tuple[tuple, tuple | None]]:
        for key, st in split_states.items():
            yield ("start", key, 0), None
            limit = max_len if key[1] == "train" else None
            for i, ((p0, o0), (p1, o1)) in enumerate(zip(st.cuts, st.cuts[1:], strict=False)):
                yield ("chunk", key, i), (st.spill[0], p0, p1, st.spill[1], o0, o1, limit)
            yield ("end", key, 0), None

    def doing(meta: tuple) -> str:
        _, (lang, split), i = meta
        chunks = len(split_states[(lang, split)].cuts) - 1
        return f"encoding chunk {i + 1} of {chunks} of {split} {pair_name(pivot, lang)}"

    total = 2 * sum(st.kept for st in split_states.values())
    bar = progress_bar(progress, total=total, unit="sent", desc="encode")
    out: dict[tuple[str, str], Encoded] = {}
    writers: list[IndexedDatasetWriter] = []
    try:
        with worker_pool(workers, stats, spm_lib.init_worker, (model_file,)) as pool:
            if pool is None:
                spm_lib.init_worker(model_file, pool_worker=False)
            for (kind, key, _), res in in_order(_encode_span, tasks(), pool, workers, doing):
                lang, split = key
                if kind == "start":
                    pair = pair_name(pivot, lang)
                    files = {code: f"bin/{split}.{pair}.{code}" for code in (pivot, lang)}
                    enc = out[key] = Encoded(files, dict.fromkeys(files, 0), 0, 0)
                    writers = [IndexedDatasetWriter(tmp / rel, dtype) for rel in files.values()]
                elif kind == "chunk":
                    pf, pn, of, on, dropped = res
                    for w, code, flat, lengths in zip(
                        writers, (pivot, lang), (pf, of), (pn, on), strict=True
                    ):
                        w.add_many(flat, lengths)
                        enc.tokens[code] += int(lengths.sum())
                    enc.sentences += int(pn.size)
                    enc.too_long += dropped
                    bar.update(2 * (pn.size + dropped))
                else:
                    for w in writers:
                        w.finalize()
                    writers = []
    except BaseException:
        for w in writers:
            w.abort()
        raise
    finally:
        bar.close()
    return out
