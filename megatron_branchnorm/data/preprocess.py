"""Raw parallel corpus -> DATA_DIR: cleaned, SentencePiece-encoded, indexed, with a manifest.

The corpus streams through in bounded memory: no phase holds more than a few chunks of
:data:`CHUNK_LINES` lines per worker, SentencePiece's sample (``--spm-sample-size``) and one
int32 length per written sentence, whatever the corpus size. The phases (timed, with peak
memory, by ``--stats``; commands/preprocess.py, run as tools/preprocess_data.py, is the command
line):

1. ``read_clean``: each pair and split's files are read together in chunks of lines, checked
   (equal line counts, UTF-8: the same errors, naming file and line, as reading them whole) and
   cleaned (:func:`text.clean`) by ``workers`` processes; a pair is dropped, and counted, when
   a side had invalid UTF-8 (``--on-bad-utf8 skip``) or is empty after cleaning. The cleaned
   lines go to spill files (``spill/`` in the temporary directory), the raw dev/test text to
   ``raw/<split>.<pair>.<lang>`` (every line, unfiltered: the evaluation references). A moses
   pair without dev/test files holds them out by a one-byte split label per line
   (:func:`corpora.hold_out_labels`);
2. ``spm_sample``: the temperature-sampled mix of training sentences (:func:`spm.sample_plan`)
   is read back from the spill files, only the chosen lines;
3. ``spm_train``: one joint SentencePiece model, trained in a child process (one thread);
4. ``encode_write``: ``workers`` processes encode chunks of the spill files, both sides of a
   chunk together, and drop training pairs with a side longer than ``max_len`` tokens
   (counted; dev/test keep them); each chunk is appended, in order, to the indexed datasets
   ``bin/<split>.<pair>.<lang>`` as it comes back. The output does not depend on ``workers``;
5. ``finish``: ``manifest.json`` written, the spill files deleted, the directory published.

Everything is written into a hidden temporary directory beside DATA_DIR that is renamed to
DATA_DIR at the very end, so an interrupted run never leaves a directory that looks complete.
The temporary directory carries :data:`dirs.TEMP_MARKER` naming the run that writes it (host,
pid and the pid's start time); a later run of the same DATA_DIR removes, and says so in one
line, the temporary directories of runs that no longer run (killed by SIGKILL, a lost node),
never one of a live run or one without that marker. Worker processes (the SentencePiece trainer
among them) die with the run (:func:`die_with_parent`).
DATA_DIR carries the marker :data:`megatron_branchnorm.formats.outputs.MARKER` (kind ``data``):
``overwrite`` replaces only a directory with that marker (or an older DATA_DIR with our
manifest) that holds nothing but a DATA_DIR's own entries (formats/dirs.py), never the input
corpus, a run trained into it, or anything else.
"""

from __future__ import annotations

import ctypes
import json
import math
import multiprocessing as mp
import multiprocessing.pool
import os
import shutil
import signal
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from tqdm import tqdm

from megatron_branchnorm.data import spm as spm_lib
from megatron_branchnorm.data.corpora import (
    SPLITS,
    LineReader,
    SplitFiles,
    count_lines,
    discover,
    hold_out_labels,
    line_mismatch,
    origin,
    pair_name,
    parse_langs,
)
from megatron_branchnorm.data.indexed_dataset import IndexedDatasetWriter, dtype_for_vocab
from megatron_branchnorm.data.phase_stats import PhaseStats
from megatron_branchnorm.data.text import clean_lines, decode_block, reference_block, utf8_error
from megatron_branchnorm.formats import dirs
from megatron_branchnorm.formats.data_dir import FORMAT as MANIFEST_FORMAT
from megatron_branchnorm.formats.data_dir import MANIFEST, DataError
from megatron_branchnorm.formats.data_dir import VERSION as MANIFEST_VERSION
from megatron_branchnorm.formats.files import read_small_file, sha256_file
from megatron_branchnorm.formats.outputs import (
    OutputError,
    check_output_file,
    json_has_format,
    prepare_output,
    publish_dir,
    temp_dir_beside,
    write_failure_reason,
    write_marker,
    write_text_output,
)
from megatron_branchnorm.tokens import BOS_ID, EOS_ID, PAD_ID, UNK_ID

FILTERS = ("bad_utf8", "empty", "too_long")
CHUNK_LINES = 2000
"""Input lines per cleaning task; cleaned lines (at least) per encoding task."""
IN_FLIGHT_PER_WORKER = 4
SAMPLE_BLOCK_LINES = 4096
SPILL_DIR = "spill"
PHASES = ("read_clean", "spm_sample", "spm_train", "encode_write", "finish")
"""The phases of a run, in order, as ``--stats`` names them."""
DATA_KIND = dirs.DATA.name
"""Marker kind of a DATA_DIR (outputs.MARKER): ``--overwrite`` replaces only such a directory,
holding only what formats/dirs.py lists as a DATA_DIR's entries."""
DATA_TOOL = "preprocess_data"
STATS_KEYS = frozenset({"phases", "total_seconds", "peak_rss_mb"})
"""The keys of a ``--stats`` file (:meth:`PhaseStats.summary`): how one of ours is recognised."""
MAX_STATS_BYTES = 1 << 20
PR_SET_PDEATHSIG = 1
"""prctl(2) option: the signal this process gets when its parent ends (Linux)."""


@dataclass
class PreprocessOptions:
    """Everything preprocessing depends on (the command line maps onto it)."""

    fmt: str
    input_dir: str
    langs: list[str]
    output: str
    pivot: str = "en"
    spm: spm_lib.SpmOptions = field(default_factory=spm_lib.SpmOptions)
    max_len: int = 256
    on_bad_utf8: str = "error"
    workers: int = 1
    dev_size: int = 2000
    test_size: int = 2000
    overwrite: bool = False
    progress: bool | None = None
    """tqdm progress bar on stderr: None shows it only on a terminal."""
    command: str = ""
    directions: list[str] | None = None
    """Train and evaluate only these directions (``en-de``: a bilingual task such as WMT17
    En->De); None: both directions of every pair (the multilingual setting)."""
    stats: str | None = None
    """Write each phase's seconds and peak memory to this JSON file (phase_stats.py)."""


def check_directions(directions: list[str] | None, langs: list[str], pivot: str) -> set[str]:
    """The set of directions to keep; a DataError naming ``--directions`` for one that no
    pair provides."""
    possible = {f"{a}-{b}" for lang in langs for a, b in ((lang, pivot), (pivot, lang))}
    if directions is None:
        return possible
    wanted = [d.strip() for d in directions if d.strip()]
    bad = [d for d in wanted if d not in possible]
    if bad or not wanted:
        raise DataError(
            f"--directions {','.join(directions)}: {', '.join(bad) or 'none given'} not among "
            f"the pairs' directions ({', '.join(sorted(possible))})"
        )
    return set(wanted)


def is_stats_file(path: Path) -> bool:
    """Whether ``path`` is a ``--stats`` file of ours (a small JSON object with exactly the
    summary's keys): the only existing file ``--stats`` may replace."""
    try:
        data = json.loads(read_small_file(path, MAX_STATS_BYTES))
    except (OSError, ValueError):  # FileShapeError too: a device or FIFO is not ours
        return False
    return isinstance(data, dict) and set(data) == STATS_KEYS and isinstance(data["phases"], dict)


def check_stats_path(stats: str, inputs: list[tuple[str, str | Path | None]]) -> None:
    """Refuse, before any work, a ``--stats`` file that would destroy something: inside or
    over an input or the output (``inputs``), inside a directory of a known kind (a run, a
    DATA_DIR, an export), an existing file that is not a stats file of ours, or a place that
    cannot be written now (:func:`outputs.check_output_file`); a DataError naming ``--stats``."""
    try:
        check_output_file(stats, "--stats", inputs, is_stats_file, "a --stats file of preprocess")
    except OutputError as exc:
        raise DataError(str(exc)) from None
    if not Path(stats).parent.is_dir():
        raise DataError(f"--stats {stats}: its directory does not exist")


def write_stats(stats: str, summary: dict) -> None:
    """Write the ``--stats`` summary: through a temporary file renamed when complete (to the
    link's target when ``stats`` links to a file), in place on a device or FIFO."""
    target = os.path.realpath(stats) if Path(stats).is_file() else stats
    try:
        write_text_output(target, json.dumps(summary, indent=2) + "\n")
    except OSError as exc:
        reason = write_failure_reason(exc)
        raise DataError(f"--stats {stats}: cannot write ({reason})") from None


def is_legacy_data_dir(path: str | Path) -> bool:
    """Whether ``path`` is a DATA_DIR written before output directories carried a marker
    (its manifest.json is ours): ``--overwrite`` may replace it."""
    return json_has_format(Path(path) / MANIFEST, MANIFEST_FORMAT, 64 << 20)


def check_output_dir(
    output: str | Path,
    kind: str,
    overwrite: bool,
    inputs: list[tuple[str, str | Path | None]],
    legacy: Callable[[Path], bool] | None = None,
    flag: str = "--output",
) -> bool:
    """:func:`outputs.prepare_output` for a data tool's output directory, as a DataError."""
    try:
        return prepare_output(output, kind, overwrite, flag, inputs, legacy)
    except OutputError as exc:
        raise DataError(str(exc)) from None


def write_failure(exc: BaseException, out: Path, flag: str = "--output") -> DataError:
    """A DataError naming the output (not the temporary directory) for a failed write."""
    return DataError(f"{flag} {out}: cannot write ({write_failure_reason(exc)})")


@contextmanager
def staged_output(
    out: Path,
    tool: str,
    kind: str,
    overwrite: bool,
    inputs: list[tuple[str, str | Path | None]],
    legacy: Callable[[Path], bool] | None = None,
) -> Iterator[Path]:
    """A hidden temporary directory beside ``out`` for a data tool to write into
    (:func:`outputs.temp_dir_beside`; temporary directories of dead runs of ``out`` are removed
    first, with one line on stderr). When the block ends, it gets the marker of ``kind`` and
    replaces ``out`` (checked again to be ours to replace: nothing else appeared there
    meanwhile); when the block fails, it is removed, an OSError becoming a DataError that
    names ``out``. So an interrupted tool never leaves a directory that looks complete."""
    try:
        tmp = temp_dir_beside(out, tool)
    except OSError as exc:
        raise write_failure(exc, out) from None
    try:
        yield tmp
        write_marker(tmp, tool, kind)
        (tmp / dirs.TEMP_MARKER).unlink()
        check_output_dir(out, kind, overwrite, inputs, legacy)
        publish_dir(tmp, out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_failure(exc, out) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ---------------------------------------------------------------------------------------------
# Worker pools: results in input order, a bounded number of tasks in flight.


def _ignore_sigint() -> None:
    """A pool worker: Ctrl-C in a terminal signals the whole process group; the parent
    handles it (terminates the pool, removes its temporary directory), workers ignore it
    instead of each printing a traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def die_with_parent(parent: int) -> None:
    """Make this forked worker end (SIGKILL) when its parent ``parent`` ends, however it
    ends: a run killed by SIGKILL must not leave SentencePiece training, or encoding, on
    behind it. Linux (prctl ``PR_SET_PDEATHSIG``); elsewhere nothing is done."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(
        ctypes.c_int(PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGKILL), *[ctypes.c_ulong(0)] * 3
    )
    if os.getppid() != parent:  # the parent ended before the request was made
        os._exit(1)


def _start_worker(parent: int, initializer: Callable[..., None], initargs: tuple) -> None:
    """A pool worker's start: it ignores Ctrl-C at once, dies with ``parent``, then runs
    ``initializer(*initargs)``."""
    _ignore_sigint()
    die_with_parent(parent)
    initializer(*initargs)


def _init_worker(model_file: str) -> None:
    """An encoding worker: ignores Ctrl-C, loads the SentencePiece model once."""
    _ignore_sigint()
    spm_lib.init_worker(model_file)


def _pool(
    processes: int,
    stats: PhaseStats,
    initializer: Callable[..., None] = _ignore_sigint,
    initargs: tuple = (),
) -> mp.pool.Pool:
    """Worker processes, forked where the platform can (the parent is small when it forks:
    no phase keeps the corpus in memory), each ending with this process
    (:func:`die_with_parent`) and started by ``initializer(*initargs)``."""
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    start = (os.getpid(), initializer, initargs)
    with stats.paused():
        return mp.get_context(method).Pool(processes, initializer=_start_worker, initargs=start)


@contextmanager
def _workers(
    n: int, stats: PhaseStats, initializer: Callable[..., None] = _ignore_sigint, initargs=()
) -> Iterator[mp.pool.Pool | None]:
    """A pool of ``n`` workers (None for one: the work runs in this process), terminated
    without waiting for queued work when the body fails (Ctrl-C, an error)."""
    if n <= 1:
        yield None
        return
    pool = _pool(n, stats, initializer, initargs)
    try:
        yield pool
    except BaseException:
        _kill(pool)
        raise
    pool.close()
    pool.join()


def _kill(pool: mp.pool.Pool) -> None:
    """Stop ``pool`` at once, after an error or Ctrl-C.

    Not ``Pool.terminate``: it first takes the task queue's read lock, which an idle worker
    holds while it waits for a task, and waits there until the pool's threads have told every
    worker to stop; stopped while they do (a Ctrl-C during encoding, about 1 run in 10 in a
    loop here), it waited forever (CPython 3.11, ``multiprocessing/pool.py``). Instead: no
    more workers are started, every worker is killed and reaped, and the pool's exit handler,
    which would wait for that lock, is dropped."""
    handler = getattr(pool, "_worker_handler", None)
    if handler is None or not hasattr(pool, "_terminate"):  # another Pool than 3.11's
        pool.terminate()
        pool.join()
        return
    handler._state = mp.pool.TERMINATE  # the thread that replaces exited workers stops
    pool._change_notifier.put(None)
    handler.join()
    for proc in pool._pool:
        if proc.exitcode is None:
            proc.kill()
    for proc in pool._pool:
        proc.join()
    pool._terminate.cancel()


def _in_order(
    fn: Callable[[Any], Any],
    tasks: Iterable[tuple[Any, Any]],
    pool: mp.pool.Pool | None,
    workers: int,
) -> Iterator[tuple[Any, Any]]:
    """``(meta, fn(arg))`` for each ``(meta, arg)`` of ``tasks``, in order; ``arg`` None is a
    marker passed through as ``(meta, None)``. With a pool at most a few tasks per worker are
    in flight, so neither the tasks (read lazily) nor the results pile up in memory."""
    if pool is None:
        for meta, arg in tasks:
            yield meta, None if arg is None else fn(arg)
        return
    window = IN_FLIGHT_PER_WORKER * workers
    pending: deque = deque()
    for meta, arg in tasks:
        pending.append((meta, None if arg is None else pool.apply_async(fn, (arg,))))
        while pending and (len(pending) > window or pending[0][1] is None):
            meta0, res = pending.popleft()
            yield meta0, None if res is None else res.get()
    while pending:
        meta0, res = pending.popleft()
        yield meta0, None if res is None else res.get()


def _show_progress(progress: bool | None) -> bool:
    return sys.stderr.isatty() if progress is None else progress


def _bar(progress: bool | None, **kw: Any) -> tqdm:
    return tqdm(file=sys.stderr, disable=not _show_progress(progress), **kw)


# ---------------------------------------------------------------------------------------------
# Pass 1: read, validate and clean every pair and split into spill files.


@dataclass
class _Split:
    """One pair and split as pass 1 leaves it: cleaned lines in two spill files (pivot and
    other side, one line each, ``\\n``-terminated), counts, and byte offsets cutting the spill
    files into encoding chunks of at least :data:`CHUNK_LINES` lines."""

    spill: tuple[Path, Path]
    origin: str
    raw: int = 0
    kept: int = 0
    bad_utf8: int = 0
    empty: int = 0
    replaced: int = 0
    cuts: list[tuple[int, int]] = field(default_factory=lambda: [(0, 0)])
    sizes: list[int] = field(default_factory=lambda: [0, 0])
    uncut: int = 0

    def cut(self) -> None:
        """Close the current encoding chunk (if it has lines)."""
        if self.uncut:
            self.cuts.append((self.sizes[0], self.sizes[1]))
            self.uncut = 0


_Cleaned = tuple[bytes, bytes, int, int, int, int, int, tuple[bytes, bytes] | None]
"""One split's share of a chunk: pivot and other spill text, lines kept, raw lines, dropped
for bad UTF-8, dropped as empty, bad UTF-8 lines kept with U+FFFD, and the raw references
(dev/test only)."""


def _joined(lines: list[str]) -> bytes:
    return "".join(x + "\n" for x in lines).encode("utf-8")


def _clean_chunk(
    task: tuple[bytes, bytes, int | np.ndarray | None, str],
) -> tuple[tuple[int, int, int] | None, tuple[int, int, int] | None, dict[int, _Cleaned] | None]:
    """Decode and clean a block of line pairs (in a worker): the first invalid UTF-8 of each
    side (line in the block, column, byte) and, per split, what goes to its files. ``labels``
    is the split of every line (an index into SPLITS, or one for the whole block); None: the
    sides are not paired (past the end of the shorter file), only check them."""
    pivot_block, other_block, labels, on_bad_utf8 = task
    p_lines, p_bad, p_err = decode_block(pivot_block)
    o_lines, o_bad, o_err = decode_block(other_block)
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
        n_bad = n_empty = 0
        for i in idx:
            if skip and i in bad:
                n_bad += 1
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
        counts = (len(keep_p), len(idx), n_bad, n_empty, replaced)
        out[s] = (_joined(keep_p), _joined(keep_o), *counts, refs)
    return p_err, o_err, out


def _chunk_tasks(
    files: SplitFiles, labels: int | np.ndarray, on_bad_utf8: str
) -> Iterator[tuple[tuple, tuple | None]]:
    """Tasks for :func:`_clean_chunk` over each pair of files of a split, :data:`CHUNK_LINES`
    lines at a time, then an ``end`` marker per pair of files. Once the shorter file ends, the
    rest of the longer one is still read (only checked), so that its invalid UTF-8 is reported
    before the line counts, as when files were read whole."""
    offset = 0
    for pf, of in zip(files.pivot_files, files.other_files, strict=True):
        with LineReader(pf) as rp, LineReader(of) as ro:
            paired = True
            while True:
                p_first, o_first = rp.lines, ro.lines
                pb, na = rp.take(CHUNK_LINES)
                ob, nb = ro.take(CHUNK_LINES)
                if na == nb == 0:
                    break
                meta = ("chunk", pf, of, p_first, o_first, len(pb) + len(ob))
                if paired and na == nb:
                    part = labels if isinstance(labels, int) else labels[offset : offset + na]
                    offset += na
                    yield meta, (pb, ob, part, on_bad_utf8)
                else:
                    paired = False
                    yield meta, (pb, ob, None, on_bad_utf8)
            yield ("end", pf, of, rp.lines, ro.lines, 0), None


def _write_lines(f: BinaryIO, lines: bytes) -> None:
    """Append ``\\n``-terminated lines (UTF-8) to an open file."""
    f.write(lines)


def _read_clean(
    opts: PreprocessOptions,
    found: dict[str, dict[str, SplitFiles]],
    pool: mp.pool.Pool | None,
    tmp: Path,
) -> dict[tuple[str, str], _Split]:
    """Pass 1: every pair's splits cleaned into spill files, the raw dev/test references
    written, everything validated (line counts, UTF-8) with the errors of reading whole files."""
    pivot, mode = opts.pivot, opts.on_bad_utf8
    spill_dir = tmp / SPILL_DIR
    spill_dir.mkdir()
    total = 0
    for splits in found.values():
        for sf in splits.values():
            for path in (*sf.pivot_files, *sf.other_files):
                try:
                    total += path.stat().st_size
                except OSError as exc:
                    raise DataError(f"{path}: cannot read: {exc.strerror or exc}") from None
    bar = _bar(opts.progress, total=total, unit="B", unit_scale=True, desc="read/clean")
    out: dict[tuple[str, str], _Split] = {}
    try:
        for lang, splits in found.items():
            pair = pair_name(pivot, lang)
            held_out = "dev" not in splits
            states = {
                split: _Split(
                    (spill_dir / f"{split}.{pair}.{pivot}", spill_dir / f"{split}.{pair}.{lang}"),
                    origin(splits["train" if held_out else split], split, held_out, opts.spm.seed),
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
                        files.enter_context(open(tmp / "raw" / f"{split}.{pair}.{code}", "wb"))
                        for code in (pivot, lang)
                    )
                    for s, split in enumerate(SPLITS)
                    if split != "train"
                }
                sources: list[tuple[SplitFiles, int | np.ndarray]]
                if held_out:
                    train = splits["train"]
                    n = sum(count_lines(p) for p in train.pivot_files)
                    labels = hold_out_labels(n, opts.dev_size, opts.test_size, opts.spm.seed)
                    sources = [(train, labels)]
                else:
                    sources = [(splits[split], s) for s, split in enumerate(SPLITS)]
                for sf, labels in sources:
                    tasks = _chunk_tasks(sf, labels, mode)
                    other_error: DataError | None = None
                    for meta, res in _in_order(_clean_chunk, tasks, pool, opts.workers):
                        kind, pf, of, p_at, o_at, nbytes = meta
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
                        for s, (
                            p_text,
                            o_text,
                            kept,
                            raw,
                            n_bad,
                            n_empty,
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
                            st.replaced += repl
                            if st.uncut >= CHUNK_LINES:
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


def _filters(st: _Split, too_long: int = 0) -> dict[str, int]:
    return {"bad_utf8": st.bad_utf8, "empty": st.empty, "too_long": too_long}


# ---------------------------------------------------------------------------------------------
# The SentencePiece sample, read back from the spill files, and training in a child process.


def _pick_lines(path: Path, wanted: np.ndarray, out: BinaryIO) -> None:
    """Append lines ``wanted`` (0-based, increasing) of ``path`` to ``out``."""
    j, pos = 0, 0
    with open(path, "rb") as f:
        while j < wanted.size:
            lines = list(islice(f, SAMPLE_BLOCK_LINES))
            if not lines:
                raise RuntimeError(f"{path}: {wanted[-1] + 1} lines expected, {pos} found")
            end = pos + len(lines)
            k = int(np.searchsorted(wanted, end))
            out.write(b"".join([lines[i - pos] for i in wanted[j:k].tolist()]))
            j, pos = k, end


def _write_sample(
    pools: dict[str, list[tuple[Path, int]]],
    opts: spm_lib.SpmOptions,
    path: Path,
    progress: bool | None = False,
) -> dict[str, int]:
    """Write SentencePiece's training mix (:func:`spm.sample_plan`) to ``path``, one sentence
    a line, reading only the chosen lines of each language's spill files (a language's text is
    the concatenation of its files). Returns how many sentences came from each language."""
    sizes = {code: sum(n for _, n in files) for code, files in pools.items()}
    plan = spm_lib.sample_plan(sizes, opts)
    total = sum(idx.size for idx in plan.values())
    with (
        open(path, "wb") as out,
        _bar(progress, total=total, unit="sent", desc="spm sample") as bar,
    ):
        for code, idx in plan.items():
            # Runs of increasing indices: whole passes over a small language, then the sample.
            for run in np.split(idx, np.flatnonzero(np.diff(idx) <= 0) + 1):
                base = 0
                for file, n in pools[code]:
                    lo, hi = np.searchsorted(run, [base, base + n])
                    if hi > lo:
                        _pick_lines(file, run[lo:hi] - base, out)
                        bar.update(int(hi - lo))
                    base += n
    return {code: int(idx.size) for code, idx in plan.items()}


def _sample_sentences(path: Path) -> Iterator[str]:
    with open(path, "rb") as f:
        for line in f:
            yield line[:-1].decode("utf-8")


def _train_spm(
    sample: Path, count: int, prefix: Path, languages: list[str], opts: spm_lib.SpmOptions
) -> dict:
    """SentencePiece training on the sample file (run in a child process)."""
    return spm_lib.train_spm(_sample_sentences(sample), count, prefix, languages, opts)


def _train_in_child(stats: PhaseStats, *args: Any) -> dict:
    """:func:`_train_spm` in a child process, so that the trainer's memory goes back to the
    system when it ends (a process keeps its heap) and no encoding worker inherits it."""
    pool = _pool(1, stats)
    try:
        info = pool.apply_async(_train_spm, args).get()
    except BaseException:
        _kill(pool)
        raise
    pool.close()
    pool.join()
    return info


# ---------------------------------------------------------------------------------------------
# Encoding: spill files -> indexed datasets, chunk by chunk, written as results arrive.


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
class _Encoded:
    """One pair and split after encoding: dataset prefixes, tokens and pairs kept."""

    files: dict[str, str]
    tokens: dict[str, int]
    sentences: int
    too_long: int


def _encode_all(
    opts: PreprocessOptions,
    split_states: dict[tuple[str, str], _Split],
    model_file: str,
    dtype: np.dtype,
    stats: PhaseStats,
    tmp: Path,
) -> dict[tuple[str, str], _Encoded]:
    """Encode every pair and split in ``workers`` processes, writing each chunk to the indexed
    datasets as it comes back (in order); the output does not depend on ``workers``."""
    pivot = opts.pivot

    def tasks() -> Iterator[tuple[tuple, tuple | None]]:
        for key, st in split_states.items():
            yield ("start", key, 0), None
            max_len = opts.max_len if key[1] == "train" else None
            for (p0, o0), (p1, o1) in zip(st.cuts, st.cuts[1:], strict=False):
                yield ("chunk", key, 0), (st.spill[0], p0, p1, st.spill[1], o0, o1, max_len)
            yield ("end", key, 0), None

    total = 2 * sum(st.kept for st in split_states.values())
    bar = _bar(opts.progress, total=total, unit="sent", desc="encode")
    out: dict[tuple[str, str], _Encoded] = {}
    writers: list[IndexedDatasetWriter] = []
    try:
        with _workers(opts.workers, stats, _init_worker, (model_file,)) as pool:
            if pool is None:
                spm_lib.init_worker(model_file, pool_worker=False)
            for (kind, key, _), res in _in_order(_encode_span, tasks(), pool, opts.workers):
                lang, split = key
                if kind == "start":
                    pair = pair_name(pivot, lang)
                    files = {code: f"bin/{split}.{pair}.{code}" for code in (pivot, lang)}
                    enc = out[key] = _Encoded(files, dict.fromkeys(files, 0), 0, 0)
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


# ---------------------------------------------------------------------------------------------
# The whole run.


def _check_spm_options(o: spm_lib.SpmOptions) -> None:
    """The SentencePiece options are finite and in range (the command line checks them too)."""

    def bad(flag: str, value: object, want: str) -> DataError:
        return DataError(f"{flag} must be {want}, got {value!r}")

    if not isinstance(o.vocab_size, int) or not 8 <= o.vocab_size <= 1 << 24:
        raise bad("--vocab-size", o.vocab_size, "an integer in [8, 16777216]")
    if not isinstance(o.sample_size, int) or o.sample_size < 1:
        raise bad("--spm-sample-size", o.sample_size, "an integer >= 1")
    if not isinstance(o.seed, int) or not 0 <= o.seed <= 2**31 - 1:
        raise bad("--seed", o.seed, "an integer in [0, 2147483647]")
    cov, temp = o.character_coverage, o.temperature
    if not isinstance(cov, (int, float)) or not (math.isfinite(cov) and 0 < cov <= 1):
        raise bad("--character-coverage", cov, "a finite number in (0, 1]")
    if not isinstance(temp, (int, float)) or not (math.isfinite(temp) and 0.01 <= temp <= 1000):
        raise bad("--spm-temperature", temp, "a finite number in [0.01, 1000]")


def preprocess(opts: PreprocessOptions) -> dict:
    """Run the whole pipeline; returns the manifest written to ``opts.output/manifest.json``
    (and writes ``opts.stats`` when set)."""
    stats = PhaseStats(sample_memory=opts.stats is not None)
    try:
        return _preprocess(opts, stats)
    finally:
        stats.stop()


def _preprocess(opts: PreprocessOptions, stats: PhaseStats) -> dict:
    langs = parse_langs(opts.langs, opts.pivot)
    check_directions(opts.directions, langs, opts.pivot)
    if opts.max_len < 1:
        raise DataError(f"--max-len must be >= 1, got {opts.max_len}")
    if opts.workers < 1:
        raise DataError(f"--workers must be >= 1, got {opts.workers}")
    _check_spm_options(opts.spm)
    for flag, value in (("--dev-size", opts.dev_size), ("--test-size", opts.test_size)):
        if not isinstance(value, int) or value < 0:
            raise DataError(f"{flag} must be an integer >= 0, got {value!r}")
    out = Path(opts.output)
    inputs = [("--input", opts.input_dir)]
    check_output_dir(out, DATA_KIND, opts.overwrite, inputs, is_legacy_data_dir)
    if opts.stats is not None:
        check_stats_path(opts.stats, [*inputs, ("--output", out)])
    found = discover(opts.fmt, opts.input_dir, langs, opts.pivot)

    with staged_output(
        out, DATA_TOOL, DATA_KIND, opts.overwrite, inputs, is_legacy_data_dir
    ) as tmp:
        manifest = _build(opts, langs, found, stats, tmp)
        with stats.phase("finish"):
            with open(tmp / MANIFEST, "w", encoding="utf-8") as f:
                json.dump(manifest, f, indent=2, ensure_ascii=False)
                f.write("\n")
            shutil.rmtree(tmp / SPILL_DIR)
        if opts.stats is not None:  # before the output is published: a failure leaves none
            write_stats(opts.stats, stats.summary())
    return manifest


def _build(
    opts: PreprocessOptions,
    langs: list[str],
    found: dict[str, dict[str, SplitFiles]],
    stats: PhaseStats,
    tmp: Path,
) -> dict:
    """The four phases before ``finish``, in ``tmp``; returns the manifest."""
    (tmp / "bin").mkdir()
    (tmp / "raw").mkdir()
    pivot = opts.pivot
    all_langs = sorted([pivot, *langs])
    kept = check_directions(opts.directions, langs, pivot)
    pairs = {lang: pair_name(pivot, lang) for lang in langs}

    with stats.phase("read_clean"), _workers(opts.workers, stats) as pool:
        split_states = _read_clean(opts, found, pool, tmp)
    for lang in langs:
        st = split_states[(lang, "train")]
        if not st.kept:
            raise DataError(
                f"{st.origin}: no training pairs left after cleaning (filters: {_filters(st)})"
            )

    # Joint SentencePiece model on a sample of the cleaned training text.
    with stats.phase("spm_sample"):
        pools: dict[str, list[tuple[Path, int]]] = {code: [] for code in all_langs}
        for lang in langs:
            st = split_states[(lang, "train")]
            pools[pivot].append((st.spill[0], st.kept))
            pools[lang].append((st.spill[1], st.kept))
        sample = tmp / SPILL_DIR / "spm_sample"
        used = _write_sample(pools, opts.spm, sample, opts.progress)
    with stats.phase("spm_train"):
        count = sum(used.values())
        if _show_progress(opts.progress):
            print(
                f"spm: training a {opts.spm.model_type} model of {opts.spm.vocab_size} pieces "
                f"on {count} sentences (one thread)",
                file=sys.stderr,
            )
        spm_info = _train_in_child(stats, sample, count, tmp / "spm", all_langs, opts.spm)
        spm_info["sample_sentences"] = used
        sample.unlink()
    vocab_size = spm_info["vocab_size"]
    dtype = dtype_for_vocab(vocab_size)

    with stats.phase("encode_write"):
        encoded = _encode_all(opts, split_states, str(tmp / "spm.model"), dtype, stats, tmp)

    splits_info: dict[str, dict] = {}
    for split in SPLITS:
        info: dict = {"sentences": 0, "filters": dict.fromkeys(FILTERS, 0), "pairs": {}}
        info["directions"] = {}
        references = {}
        for lang in langs:
            st, enc, pair = split_states[(lang, split)], encoded[(lang, split)], pairs[lang]
            filters = _filters(st, enc.too_long)
            if st.raw != enc.sentences + sum(filters.values()):
                raise RuntimeError(f"filter counts of {pair} {split} do not add up")
            info["pairs"][pair] = {
                "raw_sentences": st.raw,
                "sentences": enc.sentences,
                "filters": filters,
                "bad_utf8_replaced": st.replaced,
                "tokens": enc.tokens,
                "files": enc.files,
                "source": "held-out" if "dev" not in found[lang] else "files",
            }
            info["sentences"] += enc.sentences
            for name, val in filters.items():
                info["filters"][name] += val
            for src, tgt in ((lang, pivot), (pivot, lang)):
                if f"{src}-{tgt}" not in kept:
                    continue
                info["directions"][f"{src}-{tgt}"] = {
                    "src": enc.files[src],
                    "tgt": enc.files[tgt],
                    "sentences": enc.sentences,
                    "src_tokens": enc.tokens[src],
                    "tgt_tokens": enc.tokens[tgt],
                }
                if split == "train":
                    continue
                # Evaluation references: every dev/test line, unfiltered; their sha256 lets
                # evaluate refuse a reference edited or shifted later.
                references[f"{src}-{tgt}"] = {
                    "src": f"raw/{split}.{pair}.{src}",
                    "tgt": f"raw/{split}.{pair}.{tgt}",
                    "sentences": st.raw,
                    "sha256": {
                        "src": sha256_file(tmp / "raw" / f"{split}.{pair}.{src}"),
                        "tgt": sha256_file(tmp / "raw" / f"{split}.{pair}.{tgt}"),
                    },
                }
        info["directions"] = dict(sorted(info["directions"].items()))
        if split != "train":
            info["references"] = dict(sorted(references.items()))
        splits_info[split] = info

    return {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "pivot": pivot,
        "languages": all_langs,
        "pairs": sorted(pairs.values()),
        "directions": sorted(splits_info["train"]["directions"]),
        "vocab_size": vocab_size,
        "spm_model": "spm.model",
        "spm_vocab": "spm.vocab",
        "special_ids": {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID},
        "tag_ids": spm_info.pop("tag_ids"),
        "dtype": dtype.name,
        "spm": spm_info,
        "max_len": opts.max_len,
        "on_bad_utf8": opts.on_bad_utf8,
        "input": {"format": opts.fmt, "dir": str(opts.input_dir)},
        "splits": splits_info,
        "command": opts.command,
    }
