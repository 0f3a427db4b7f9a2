"""Raw parallel corpus -> DATA_DIR: cleaned, SentencePiece-encoded, indexed, with a manifest.

The corpus streams through in bounded memory: no phase holds more than a few chunks of
:data:`CHUNK_LINES` lines per worker, SentencePiece's sample (``--spm-sample-size``) and one
int32 length per written sentence, whatever the corpus size. The phases (timed, with peak
memory, by ``--stats``; commands/preprocess.py, run as tools/preprocess_data.py, is the command
line). This module holds the options, the run and the SentencePiece phases; the other passes,
the worker pool and the output staging live beside it, one job each:

1. ``read_clean`` (data/clean_pass.py): each pair and split's files are read together in
   chunks of lines, checked (equal line counts, UTF-8: the same errors, naming file and line,
   as reading them whole) and cleaned (:func:`text.clean`) by ``workers`` processes; a pair is
   dropped, and counted, when a side had invalid UTF-8 (``--on-bad-utf8 skip``) or is empty
   after cleaning, or (``too_long``) when a training side is over :data:`MAX_LINE_BYTES`,
   which no pass holds in memory (such a dev/test line is an error). The cleaned lines go to
   spill files (``spill/`` in the temporary directory), the raw dev/test text to
   ``raw/<split>.<pair>.<lang>`` (every line, unfiltered: the evaluation references). A moses pair without dev/test files holds them out by a
   one-byte split label per line (:func:`corpora.hold_out_labels`);
2. ``spm_sample``: the temperature-sampled mix of training sentences (:func:`spm.sample_plan`)
   is read back from the spill files, only the chosen lines;
3. ``spm_train``: one joint SentencePiece model, trained in a child process (one thread);
4. ``encode_write`` (data/encode_pass.py): ``workers`` processes encode chunks of the spill
   files, both sides of a chunk together, and drop training pairs with a side longer than
   ``max_len`` tokens (counted; dev/test keep them); each chunk is appended, in order, to the
   indexed datasets ``bin/<split>.<pair>.<lang>`` as it comes back. The output does not depend
   on ``workers`` (the pool: data/workers.py);
5. ``finish``: ``manifest.json`` written, the spill files deleted, the directory published.

Everything is written into a hidden temporary directory beside DATA_DIR (data/staging.py) that
is renamed to DATA_DIR at the very end, so an interrupted run never leaves a directory that
looks complete. The temporary directory carries :data:`dirs.TEMP_MARKER` naming the run that
writes it (host, pid and the pid's start time); a later run of the same DATA_DIR removes, and
says so in one line, the temporary directories of runs that no longer run (killed by SIGKILL, a
lost node), never one of a live run or one without that marker. Worker processes (the
SentencePiece trainer among them) die with the run (:func:`workers.die_with_parent`); a worker
that dies (SIGKILL, the OOM killer, an abort) ends the run with one line naming it, its task
and how it ended (:class:`workers.WorkerLost`), and nothing is published.
DATA_DIR carries the marker :data:`megatron_branchnorm.formats.outputs.MARKER` (kind ``data``):
``overwrite`` replaces only a directory with that marker (or an older DATA_DIR with our
manifest) that holds nothing but a DATA_DIR's own entries (formats/dirs.py), never the input
corpus, a run trained into it, or anything else.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from megatron_branchnorm.data import spm as spm_lib
from megatron_branchnorm.data.clean_pass import read_clean
from megatron_branchnorm.data.corpora import SPLITS, SplitFiles, discover, pair_name, parse_langs
from megatron_branchnorm.data.encode_pass import encode_all
from megatron_branchnorm.data.indexed_dataset import dtype_for_vocab
from megatron_branchnorm.data.phase_stats import PhaseStats
from megatron_branchnorm.data.progress import progress_bar, show_progress
from megatron_branchnorm.data.staging import (
    check_output_dir,
    check_stats_path,
    is_legacy_data_dir,
    staged_output,
    write_stats,
)
from megatron_branchnorm.data.workers import worker_pool
from megatron_branchnorm.formats import dirs
from megatron_branchnorm.formats.data_dir import FORMAT as MANIFEST_FORMAT
from megatron_branchnorm.formats.data_dir import MANIFEST, DataError
from megatron_branchnorm.formats.data_dir import VERSION as MANIFEST_VERSION
from megatron_branchnorm.formats.files import sha256_file
from megatron_branchnorm.tokens import BOS_ID, EOS_ID, PAD_ID, UNK_ID

FILTERS = ("bad_utf8", "empty", "too_long")
CHUNK_LINES = 2000
"""Input lines per cleaning task; cleaned lines (at least) per encoding task. Read when a run
starts and handed to the first pass (data/clean_pass.py), which cuts the encoding chunks."""
MAX_LINE_BYTES = 1 << 20
"""The most bytes of one corpus line any pass holds (read when a run starts, handed to the
first pass): a training pair with a longer side is dropped as ``too_long`` before cleaning
(far over what ``--max-len`` tokens hold; cleaning and encoding take some 50 times a line's
bytes), such a dev/test line is an error (its references keep every line)."""
SAMPLE_BLOCK_LINES = 4096
SPILL_DIR = "spill"
PHASES = ("read_clean", "spm_sample", "spm_train", "encode_write", "finish")
"""The phases of a run, in order, as ``--stats`` names them."""
DATA_KIND = dirs.DATA.name
"""Marker kind of a DATA_DIR (outputs.MARKER): ``--overwrite`` replaces only such a directory,
holding only what formats/dirs.py lists as a DATA_DIR's entries."""
DATA_TOOL = "preprocess_data"


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
        progress_bar(progress, total=total, unit="sent", desc="spm sample") as bar,
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


def _train_in_child(stats: PhaseStats, sample: Path, count: int, *args: Any) -> dict:
    """:func:`_train_spm` in a child process, so that the trainer's memory goes back to the
    system when it ends (a process keeps its heap) and no encoding worker inherits it."""
    with worker_pool(1, stats, inline_one=False) as pool:
        assert pool is not None
        doing = f"training SentencePiece on {count} sentences"
        return pool.result(pool.submit(_train_spm, (sample, count, *args), doing))


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

    with stats.phase("read_clean"), worker_pool(opts.workers, stats) as pool:
        split_states = read_clean(
            found,
            pool,
            tmp / SPILL_DIR,
            tmp / "raw",
            pivot=pivot,
            on_bad_utf8=opts.on_bad_utf8,
            seed=opts.spm.seed,
            dev_size=opts.dev_size,
            test_size=opts.test_size,
            workers=opts.workers,
            progress=opts.progress,
            chunk_lines=CHUNK_LINES,
            max_line_bytes=MAX_LINE_BYTES,
        )
    for lang in langs:
        st = split_states[(lang, "train")]
        if not st.kept:
            raise DataError(
                f"{st.origin}: no training pairs left after cleaning (filters: {st.filters()})"
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
        if show_progress(opts.progress):
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
        encoded = encode_all(
            split_states,
            str(tmp / "spm.model"),
            dtype,
            stats,
            tmp,
            pivot=pivot,
            max_len=opts.max_len,
            workers=opts.workers,
            progress=opts.progress,
        )

    splits_info: dict[str, dict] = {}
    for split in SPLITS:
        info: dict = {"sentences": 0, "filters": dict.fromkeys(FILTERS, 0), "pairs": {}}
        info["directions"] = {}
        references = {}
        for lang in langs:
            st, enc, pair = split_states[(lang, split)], encoded[(lang, split)], pairs[lang]
            filters = st.filters(enc.too_long)
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
