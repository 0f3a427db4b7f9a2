"""Raw parallel corpus -> DATA_DIR: cleaned, SentencePiece-encoded, indexed, with a manifest.

Steps (commands/preprocess.py, run as tools/preprocess_data.py, is the command line):

1. read and validate every input file (:mod:`corpora`) before anything is written;
2. clean each line (:func:`text.clean`); a pair is dropped, and counted, when a side had
   invalid UTF-8 (``--on-bad-utf8 skip``) or is empty after cleaning;
3. train one joint SentencePiece model on a temperature-sampled mix of the training text;
4. encode (``workers`` processes; the output does not depend on their number);
5. drop training pairs with a side longer than ``max_len`` tokens (counted; dev/test keep them);
6. write per pair, split and language an indexed dataset ``bin/<split>.<pair>.<lang>``, the
   raw dev/test text ``raw/<split>.<pair>.<lang>`` (every line, unfiltered: the evaluation
   references), ``spm.model``/``spm.vocab`` and ``manifest.json``.

Everything is written into a hidden temporary directory beside DATA_DIR that is renamed to
DATA_DIR at the very end, so an interrupted run never leaves a directory that looks complete.
DATA_DIR carries the marker :data:`megatron_branchnorm.cli.MARKER` (kind ``data``):
``overwrite`` replaces only a directory with that marker (or an older DATA_DIR with our
manifest), never the input corpus or anything else.
"""

from __future__ import annotations

import gc
import json
import math
import multiprocessing as mp
import os
import shutil
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from megatron_branchnorm.cli import (
    OutputError,
    json_has_format,
    prepare_output,
    publish_dir,
    write_failure_reason,
    write_marker,
)
from megatron_branchnorm.data import spm as spm_lib
from megatron_branchnorm.data.corpora import SPLITS, PairLines, parse_langs, read_corpus
from megatron_branchnorm.data.errors import DataError
from megatron_branchnorm.data.indexed_dataset import IndexedDatasetWriter, dtype_for_vocab
from megatron_branchnorm.data.text import clean, reference
from megatron_branchnorm.tokens import BOS_ID, EOS_ID, PAD_ID, UNK_ID

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "megatron_branchnorm-data"
MANIFEST_VERSION = 1
FILTERS = ("bad_utf8", "empty", "too_long")
CHUNK_LINES = 2000
DATA_KIND = "data"
"""Marker kind of a DATA_DIR (cli.MARKER): ``--overwrite`` replaces only such a directory."""
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


@dataclass
class _Cleaned:
    pivot: list[str]
    other: list[str]
    filters: dict[str, int]
    replaced_utf8: int


def _clean_pairs(pl: PairLines, on_bad_utf8: str) -> _Cleaned:
    filters = dict.fromkeys(FILTERS, 0)
    pivot, other = [], []
    for i, (a, b) in enumerate(zip(pl.pivot_lines, pl.other_lines, strict=True)):
        if on_bad_utf8 == "skip" and i in pl.bad_utf8:
            filters["bad_utf8"] += 1
            continue
        a, b = clean(a), clean(b)
        if not a or not b:
            filters["empty"] += 1
            continue
        pivot.append(a)
        other.append(b)
    replaced = len(pl.bad_utf8) if on_bad_utf8 == "replace" else 0
    return _Cleaned(pivot, other, filters, replaced)


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
    """:func:`cli.prepare_output` for a data tool's output directory, as a DataError."""
    try:
        return prepare_output(output, kind, overwrite, flag, inputs, legacy)
    except OutputError as exc:
        raise DataError(str(exc)) from None


def write_failure(exc: BaseException, out: Path, flag: str = "--output") -> DataError:
    """A DataError naming the output (not the temporary directory) for a failed write."""
    return DataError(f"{flag} {out}: cannot write ({write_failure_reason(exc)})")


# The texts being encoded, visible to forked workers, which then receive only line ranges.
_FORK_TEXTS: list[list[str]] = []


def _init_worker(model_file: str) -> None:
    """A pool worker: Ctrl-C in a terminal signals the whole process group; the parent
    handles it (terminates the pool, removes its temporary directory), workers ignore it
    instead of each printing a traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spm_lib.init_worker(model_file)


def _encode_span(span: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Encode lines ``start:end`` of text ``k`` of :data:`_FORK_TEXTS` (in a forked worker)."""
    k, start, end = span
    return spm_lib.encode_chunk(_FORK_TEXTS[k][start:end])


def _encode_lines(
    span_and_lines: tuple[tuple[int, int, int], list[str]],
) -> tuple[np.ndarray, np.ndarray]:
    """Encode lines sent along with their range (in-process or a spawned worker)."""
    return spm_lib.encode_chunk(span_and_lines[1])


def _encode_all(
    texts: list[list[str]], model_file: str, workers: int, progress: bool | None
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Encode each list of lines; returns (flat ids, lengths) per list, in order."""
    global _FORK_TEXTS
    spans = [
        (k, s, min(s + CHUNK_LINES, len(lines)))
        for k, lines in enumerate(texts)
        for s in range(0, len(lines), CHUNK_LINES)
    ]
    bar = tqdm(
        total=sum(len(t) for t in texts),
        unit="sent",
        desc="encode",
        file=sys.stderr,
        disable=(None if progress is None else not progress),
    )
    results: list[tuple[np.ndarray, np.ndarray]] = []
    # The encoded chunks create many small objects but no cycles; collections would rescan the
    # whole in-memory corpus again and again, so the collector pauses while encoding.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    pool = None
    with_lines = ((sp, texts[sp[0]][sp[1] : sp[2]]) for sp in spans)
    if workers <= 1:
        spm_lib.init_worker(model_file, pool_worker=False)
        it = map(_encode_lines, with_lines)
    elif "fork" in mp.get_all_start_methods():
        _FORK_TEXTS = texts
        pool = mp.get_context("fork").Pool(
            workers, initializer=_init_worker, initargs=(model_file,)
        )
        it = pool.imap(_encode_span, spans, chunksize=1)
    else:
        pool = mp.get_context("spawn").Pool(
            workers, initializer=_init_worker, initargs=(model_file,)
        )
        it = pool.imap(_encode_lines, with_lines, chunksize=1)
    failed = True
    try:
        for (_, start, end), res in zip(spans, it, strict=True):
            results.append(res)
            bar.update(end - start)
        failed = False
    finally:
        _FORK_TEXTS = []
        if gc_was_enabled:
            gc.enable()
        bar.close()
        if pool is not None:
            if failed:
                pool.terminate()  # Ctrl-C or an error: do not wait for the queued chunks
            else:
                pool.close()
            pool.join()
    by_text: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {k: [] for k in range(len(texts))}
    for (k, _, _), res in zip(spans, results, strict=True):
        by_text[k].append(res)
    out: list[tuple[np.ndarray, np.ndarray]] = []
    for k in range(len(texts)):
        parts = by_text[k]
        if parts:
            out.append(
                (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
            )
        else:
            out.append((np.zeros(0, np.int32), np.zeros(0, np.int64)))
    return out


def _select(
    flat: np.ndarray, lengths: np.ndarray, keep: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The sequences of (flat, lengths) where ``keep`` is True."""
    return flat[np.repeat(keep, lengths)], lengths[keep]


def _write_lines(path: Path, lines: list[str]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for line in lines:
            f.write(line + "\n")


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
    """Run the whole pipeline; returns the manifest written to ``opts.output/manifest.json``."""
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
    corpus, split_source = read_corpus(
        opts.fmt,
        opts.input_dir,
        langs,
        opts.pivot,
        opts.on_bad_utf8,
        opts.dev_size,
        opts.test_size,
        opts.spm.seed,
    )
    pivot = opts.pivot
    pairs = {lang: corpus[lang][SPLITS[0]].pair for lang in langs}
    cleaned = {
        (lang, split): _clean_pairs(corpus[lang][split], opts.on_bad_utf8)
        for lang in langs
        for split in SPLITS
    }
    for lang in langs:
        if not cleaned[(lang, "train")].pivot:
            raise DataError(
                f"{corpus[lang]['train'].origin}: no training pairs left after cleaning "
                f"(filters: {cleaned[(lang, 'train')].filters})"
            )

    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as exc:
        raise write_failure(exc, out) from None
    try:
        manifest = _build(opts, langs, pivot, pairs, corpus, cleaned, split_source, tmp)
        write_marker(tmp, DATA_TOOL, DATA_KIND)
        # Still ours to replace (nothing else appeared there meanwhile).
        check_output_dir(out, DATA_KIND, opts.overwrite, inputs, is_legacy_data_dir)
        publish_dir(tmp, out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_failure(exc, out) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _build(
    opts: PreprocessOptions,
    langs: list[str],
    pivot: str,
    pairs: dict[str, str],
    corpus: dict[str, dict[str, PairLines]],
    cleaned: dict[tuple[str, str], _Cleaned],
    split_source: dict[str, str],
    tmp: Path,
) -> dict:
    (tmp / "bin").mkdir()
    (tmp / "raw").mkdir()
    all_langs = sorted([pivot, *langs])
    kept = check_directions(opts.directions, langs, pivot)

    # Evaluation references: every dev/test line, unfiltered.
    references: dict[str, dict[str, dict]] = {"dev": {}, "test": {}}
    for split in ("dev", "test"):
        for lang in langs:
            pl, pair = corpus[lang][split], pairs[lang]
            for code, lines in ((pivot, pl.pivot_lines), (lang, pl.other_lines)):
                _write_lines(tmp / "raw" / f"{split}.{pair}.{code}", [reference(x) for x in lines])
            for src, tgt in ((lang, pivot), (pivot, lang)):
                if f"{src}-{tgt}" not in kept:
                    continue
                references[split][f"{src}-{tgt}"] = {
                    "src": f"raw/{split}.{pair}.{src}",
                    "tgt": f"raw/{split}.{pair}.{tgt}",
                    "sentences": len(pl.pivot_lines),
                }

    # Joint SentencePiece model on the cleaned training text.
    spm_text: dict[str, list[str]] = {code: [] for code in all_langs}
    for lang in langs:
        c = cleaned[(lang, "train")]
        spm_text[pivot] += c.pivot
        spm_text[lang] += c.other
    spm_info = spm_lib.train_spm(spm_text, tmp / "spm", all_langs, opts.spm)
    del spm_text
    vocab_size = spm_info["vocab_size"]
    dtype = dtype_for_vocab(vocab_size)

    keys = [(lang, split) for lang in langs for split in SPLITS]
    texts: list[list[str]] = []
    for key in keys:
        texts += [cleaned[key].pivot, cleaned[key].other]
    encoded = _encode_all(texts, str(tmp / "spm.model"), opts.workers, opts.progress)

    splits_info: dict[str, dict] = {}
    for split in SPLITS:
        info: dict = {"sentences": 0, "filters": dict.fromkeys(FILTERS, 0), "pairs": {}}
        info["directions"] = {}
        for lang in langs:
            k = keys.index((lang, split))
            c, pair = cleaned[(lang, split)], pairs[lang]
            (pf, pn), (of, on) = encoded[2 * k], encoded[2 * k + 1]
            keep = np.ones(pn.size, dtype=bool)
            if split == "train":
                keep = (pn <= opts.max_len) & (on <= opts.max_len)
            filters = dict(c.filters)
            filters["too_long"] = int((~keep).sum())
            files, tokens = {}, {}
            for code, flat, lengths in ((pivot, pf, pn), (lang, of, on)):
                flat, lengths = _select(flat, lengths, keep)
                rel = f"bin/{split}.{pair}.{code}"
                with IndexedDatasetWriter(tmp / rel, dtype) as w:
                    w.add_many(flat, lengths)
                files[code], tokens[code] = rel, int(lengths.sum())
            n_kept = int(keep.sum())
            raw_n = len(corpus[lang][split].pivot_lines)
            if raw_n != n_kept + sum(filters.values()):
                raise RuntimeError(f"filter counts of {pair} {split} do not add up")
            info["pairs"][pair] = {
                "raw_sentences": raw_n,
                "sentences": n_kept,
                "filters": filters,
                "bad_utf8_replaced": c.replaced_utf8,
                "tokens": tokens,
                "files": files,
                "source": split_source[pair],
            }
            info["sentences"] += n_kept
            for name, val in filters.items():
                info["filters"][name] += val
            for src, tgt in ((lang, pivot), (pivot, lang)):
                if f"{src}-{tgt}" not in kept:
                    continue
                info["directions"][f"{src}-{tgt}"] = {
                    "src": files[src],
                    "tgt": files[tgt],
                    "sentences": n_kept,
                    "src_tokens": tokens[src],
                    "tgt_tokens": tokens[tgt],
                }
        info["directions"] = dict(sorted(info["directions"].items()))
        if split in references:
            info["references"] = dict(sorted(references[split].items()))
        splits_info[split] = info

    manifest = {
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
    with open(tmp / MANIFEST, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2, ensure_ascii=False)
        f.write("\n")
    return manifest
