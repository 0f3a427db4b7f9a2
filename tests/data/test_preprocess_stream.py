"""Preprocessing in bounded memory: peak memory flat in the corpus size, --stats,
the streamed pieces equal to their in-memory definitions, and no spill files left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from megatron_branchnorm.data import DataError, encode_pass
from megatron_branchnorm.data import preprocess as preprocess_mod
from megatron_branchnorm.data.corpora import hold_out_labels, read_corpus
from megatron_branchnorm.data.preprocess import PreprocessOptions, preprocess
from megatron_branchnorm.data.spm import SpmOptions, sample_mix
from megatron_branchnorm.data.synthetic_corpus import write_opus100_like
from megatron_branchnorm.data.text import (
    clean,
    clean_lines,
    decode_block,
    read_lines,
    reference,
    reference_block,
)

from .conftest import make_opus, run_preprocess, sentences, write_lines

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "preprocess_data.py"
GROWTH_MB_PER_M_PAIRS = 150
"""Allowed growth of peak memory per million more pairs (the code before streaming: ~2000 MB
here, where forked encoding workers also count the corpus they inherited; ~40 MB after)."""


def _tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in (proc, *proc.children(recursive=True)):
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def _run_tool(argv: list[str], tmp: Path) -> float:
    """Run tools/preprocess_data.py; the peak RSS of it and its workers, summed, in MB
    (read from outside every 20 ms, so it measures any version of the tool the same way)."""
    err = tmp / f"stderr-{time.monotonic_ns()}"
    with open(err, "w") as f:
        proc = subprocess.Popen([sys.executable, str(TOOL), *argv], stdout=f, stderr=f)
    peak, ps = 0, psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            peak = max(peak, _tree_rss(ps))
        except psutil.Error:
            pass
        time.sleep(0.02)
    assert proc.returncode == 0, err.read_text()[-3000:]
    return peak / 1e6


def _argv(corpus: Path, out: Path, *extra: str) -> list[str]:
    return [
        *("--format", "opus100", "--input", str(corpus), "--langs", "de,fr,ru"),
        *("--output", str(out), "--vocab-size", "1000", "--spm-sample-size", "20000"),
        *("--workers", "2", "--no-progress", *extra),
    ]


def test_peak_memory_does_not_grow_with_the_corpus(tmp_path: Path) -> None:
    peaks = {}
    for n in (60_000, 360_000):
        corpus = write_opus100_like(
            tmp_path / f"c{n}", n, n_pairs=3, vocab_words=3000, dev_size=200, test_size=200
        )
        peaks[n] = _run_tool(_argv(corpus, tmp_path / f"o{n}"), tmp_path)
    growth = (peaks[360_000] - peaks[60_000]) / 0.3
    assert growth <= GROWTH_MB_PER_M_PAIRS, f"peaks {peaks} MB: {growth:.0f} MB per M pairs"


def test_stats_file(tmp_path: Path) -> None:
    corpus = write_opus100_like(
        tmp_path / "c", 20_000, n_pairs=3, vocab_words=2000, dev_size=100, test_size=100
    )
    stats = tmp_path / "stats.json"
    peak = _run_tool(_argv(corpus, tmp_path / "out", "--stats", str(stats)), tmp_path)
    s = json.loads(stats.read_text())
    assert set(s) == {"phases", "total_seconds", "peak_rss_mb"}
    assert list(s["phases"]) == list(preprocess_mod.PHASES)
    for v in s["phases"].values():
        assert set(v) == {"seconds", "peak_rss_mb"}
        assert isinstance(v["seconds"], float) and v["seconds"] >= 0
        assert isinstance(v["peak_rss_mb"], float) and v["peak_rss_mb"] > 10
    assert s["peak_rss_mb"] >= max(v["peak_rss_mb"] for v in s["phases"].values())
    assert s["total_seconds"] >= sum(v["seconds"] for v in s["phases"].values())
    # The tool's own reading agrees with one taken from outside (both sample every 20-50 ms).
    assert 0.5 < s["peak_rss_mb"] * 2**20 / 1e6 / peak < 2.0
    assert not (tmp_path / "out" / "stats.json").exists()


def test_stats_directory_must_exist(tmp_path: Path) -> None:
    make_opus(tmp_path / "raw", {"de": (30, 5, 5)})
    with pytest.raises(DataError, match="--stats .*: its directory does not exist"):
        run_preprocess(tmp_path / "raw", tmp_path / "out", ["de"], stats=str(tmp_path / "x/s"))
    assert not (tmp_path / "out").exists()


def test_blocks_decode_and_clean_as_whole_files(tmp_path: Path) -> None:
    lines = [
        "plain",
        "carriage\rreturn",
        "sep\u2028and\u2029nul\x00",
        "\ufeffbom",
        "form\x0cfeed \x85 nel\x1c",
        "",
        "   \t ",
        "tab\there",
    ]
    raw = [x.encode() for x in lines] + [b"caf\xe9 latin-1", b"cut \xe2\x82", b"ok"]
    f = tmp_path / "f"
    f.write_bytes(b"\n".join(raw))  # no newline at the end
    whole, bad = read_lines(f, "replace")
    got, got_bad, first = decode_block(f.read_bytes())
    assert (got, got_bad, first) == (whole, bad, (len(lines), 4, 0xE9))
    assert decode_block(f.read_bytes() + b"\n")[0] == whole
    assert decode_block(b"") == ([], [], None) and decode_block(b"\n")[0] == [""]
    assert clean_lines(whole) == [clean(x) for x in whole] and clean_lines([]) == []
    assert reference_block(whole) == "".join(reference(x) + "\n" for x in whole)


def test_hold_out_labels_follow_the_permutation() -> None:
    for n, dev, test in ((0, 5, 5), (7, 5, 5), (1000, 30, 20), (123_457, 2000, 2000)):
        perm = np.random.RandomState(3).permutation(n)
        n_dev, n_test = min(dev, n // 10), min(test, n // 10)
        labels = hold_out_labels(n, dev, test, 3)
        assert labels.dtype == np.uint8 and labels.size == n
        assert np.array_equal(np.flatnonzero(labels == 2), np.sort(perm[:n_test]))
        assert np.array_equal(np.flatnonzero(labels == 1), np.sort(perm[n_test : n_test + n_dev]))


def test_sample_read_back_equals_the_in_memory_mix(tmp_path: Path) -> None:
    pools = {
        "de": sentences("de", 50, 1),  # small: repeated
        "en": sentences("en", 700, 2) + sentences("en", 400, 3),  # two files, subsampled
        "fr": [],
    }
    files: dict[str, list[tuple[Path, int]]] = {}
    for code, lines in pools.items():
        parts = [lines[:700], lines[700:]] if code == "en" else [lines]
        files[code] = []
        for i, part in enumerate(parts):
            write_lines(tmp_path / f"{code}{i}", part)
            files[code].append((tmp_path / f"{code}{i}", len(part)))
    opts = SpmOptions(sample_size=900, temperature=3.0, seed=7)
    used = preprocess_mod._write_sample(files, opts, tmp_path / "sample")
    mix, used_mem = sample_mix(pools, opts)
    assert used == used_mem and used["de"] > 50 and 0 < used["en"] < 1100
    assert list(preprocess_mod._sample_sentences(tmp_path / "sample")) == mix


def _moses_corpus(raw: Path) -> None:
    for lang in ("de", "fr"):
        pair = "-".join(sorted(("en", lang)))
        for name, n in (("MultiUN", 900), ("Europarl", 400)):
            en, xx = sentences("en", n, n), [x.encode() for x in sentences(lang, n, n + 1)]
            for i in range(3, n, 97):
                xx[i] += b" \xff"
            for i in range(5, n, 89):
                en[i] = " \t"
            write_lines(raw / f"{name}.{pair}.en", en)
            (raw / f"{name}.{pair}.{lang}").write_bytes(b"\n".join(xx) + b"\n")


@pytest.mark.parametrize("mode", ["skip", "replace"])
def test_held_out_splits_streamed_as_in_memory(tmp_path: Path, monkeypatch, mode) -> None:
    """Held-out dev/test of two concatenated files, bad UTF-8 and empty lines, chunks that
    cut across everything: 1 and 2 workers write the same bytes, and the splits are those of
    the in-memory reader."""
    monkeypatch.setattr(preprocess_mod, "CHUNK_LINES", 41)
    _moses_corpus(tmp_path / "raw")
    kw = {"fmt": "moses", "on_bad_utf8": mode, "dev_size": 60, "test_size": 45, "max_len": 30}
    for workers in (1, 2):
        run_preprocess(
            tmp_path / "raw", tmp_path / f"w{workers}", ["de", "fr"], workers=workers, **kw
        )
    files = sorted(p.relative_to(tmp_path / "w1") for p in (tmp_path / "w1").rglob("*"))
    assert files == sorted(p.relative_to(tmp_path / "w2") for p in (tmp_path / "w2").rglob("*"))
    for rel in files:
        if (tmp_path / "w1" / rel).is_file():
            assert (tmp_path / "w1" / rel).read_bytes() == (tmp_path / "w2" / rel).read_bytes()
    assert not any("spill" in str(rel) for rel in files)
    corpus, _ = read_corpus("moses", tmp_path / "raw", ["de", "fr"], "en", mode, 60, 45, 1)
    m = json.loads((tmp_path / "w2" / "manifest.json").read_text())
    for lang, pair in (("de", "de-en"), ("fr", "en-fr")):
        for split in ("dev", "test"):
            pl = corpus[lang][split]
            for code, lines in (("en", pl.pivot_lines), (lang, pl.other_lines)):
                text = (tmp_path / "w2" / "raw" / f"{split}.{pair}.{code}").read_text()
                assert text == "".join(reference(x) + "\n" for x in lines)
        for split in ("train", "dev", "test"):
            pl, info = corpus[lang][split], m["splits"][split]["pairs"][pair]
            assert info["raw_sentences"] == len(pl.pivot_lines)
            n_bad = len(pl.bad_utf8)
            assert info["filters"]["bad_utf8"] == (n_bad if mode == "skip" else 0)
            assert info["bad_utf8_replaced"] == (n_bad if mode == "replace" else 0)
            assert info["filters"]["empty"] == sum(
                1
                for i, (a, b) in enumerate(zip(pl.pivot_lines, pl.other_lines, strict=True))
                if not (mode == "skip" and i in pl.bad_utf8) and not (clean(a) and clean(b))
            )


def _leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_failure_while_encoding_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    make_opus(tmp_path / "raw", {"de": (300, 10, 10)})
    monkeypatch.setattr(preprocess_mod, "CHUNK_LINES", 50)
    calls = []
    encode = encode_pass._encode_span

    def fail_third(task):
        calls.append(task)
        if len(calls) == 3:
            raise DataError("injected")
        return encode(task)

    monkeypatch.setattr(encode_pass, "_encode_span", fail_third)
    with pytest.raises(DataError, match="injected"):
        run_preprocess(tmp_path / "raw", tmp_path / "out", ["de"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw"]


def test_failure_in_a_later_pair_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    """The first pair's spill files are written when the second pair's files turn out bad."""
    monkeypatch.setattr(preprocess_mod, "CHUNK_LINES", 64)
    make_opus(tmp_path / "raw", {"de": (600, 10, 10), "fr": (600, 10, 10)})
    base = tmp_path / "raw" / "opus-100-corpus" / "v1.0" / "supervised" / "en-fr"
    write_lines(base / "opus.en-fr-train.fr", sentences("fr", 599, 0))
    with pytest.raises(DataError, match="has 600 lines but .*opus.en-fr-train.fr has 599"):
        run_preprocess(tmp_path / "raw", tmp_path / "out", ["de", "fr"], workers=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw"]


@pytest.mark.parametrize("phase", ["spm_train", "encode_write"])
def test_ctrl_c_leaves_no_spill_files(tmp_path: Path, phase: str) -> None:
    """SIGINT (to the process group, as a terminal sends it) while SentencePiece trains in
    its child process, or while the workers encode: exit 130, nothing left."""
    make_opus(tmp_path / "raw", {"de": (20000, 50, 50), "fr": (20000, 50, 50)})
    out = tmp_path / "out"
    argv = ["--format", "opus100", "--input", str(tmp_path / "raw"), "--langs", "de,fr"]
    argv += ["--output", str(out), "--vocab-size", "150", "--workers", "2", "--no-progress"]
    proc = subprocess.Popen(
        [sys.executable, str(TOOL), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )

    def children() -> bool:
        """Worker processes run, and each already ignores SIGINT (its SigIgn mask has bit 2):
        a worker forked a moment before the signal, not yet ignoring it, would print a
        traceback, which is not what is tested."""
        pids = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        for pid in pids:
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except FileNotFoundError:
                return False
            mask = next(x for x in status.splitlines() if x.startswith("SigIgn:")).split()[1]
            if not int(mask, 16) & (1 << (signal.SIGINT - 1)):
                return False
        return bool(pids)

    def reached() -> bool:
        """Inside the phase, past the start of its processes (a worker forked a moment
        before the signal would not ignore it yet: its traceback is not what is tested)."""
        for tmp in tmp_path.glob(".out.tmp-*"):
            if phase == "spm_train" and (tmp / "spill" / "spm_sample").exists() and children():
                return True  # SentencePiece's child runs
            written = any(p.stat().st_size for p in tmp.glob("bin/*.bin.tmp"))
            if phase == "encode_write" and written and children():
                return True  # the first encoded chunk is written
        return False

    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and not reached():
        time.sleep(0.002)
    assert proc.poll() is None, f"preprocessing ended before {phase}"
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert err.strip().splitlines() == ["interrupted (Ctrl-C): nothing half-written was kept"]
    assert not out.exists() and _leftovers(tmp_path) == []


def test_progress_of_every_phase(tmp_path: Path, capfd) -> None:
    make_opus(tmp_path / "raw", {"de": (200, 10, 10)})
    opts = PreprocessOptions(
        "opus100",
        str(tmp_path / "raw"),
        ["de"],
        str(tmp_path / "out"),
        spm=SpmOptions(vocab_size=100, character_coverage=1.0),
        progress=True,
    )
    preprocess(opts)
    err = capfd.readouterr().err
    for what in ("read/clean", "spm sample", "spm: training a unigram model of 100", "encode"):
        assert what in err, err
