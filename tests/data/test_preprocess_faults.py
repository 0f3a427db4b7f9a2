"""Preprocessing under faults of its own processes and of its input's shape.

- A pool worker that dies (SIGKILL, the OOM killer, a ``std::bad_alloc`` abort) in any of the
  pools (cleaning, encoding, the SentencePiece trainer) ends the run with one line naming the
  worker, its task and how it ended; exit 2, nothing published, no temporary directory. A
  ``multiprocessing`` pool replaced the worker and waited forever for its task. The worker is
  killed by a fault patched in from outside (a script run as the front door); the subprocess's
  time bound is only a safety net against a hang, the verdict is the exit and the line.
- An error (SentencePiece's) leaves no pool "running" behind: such a pool warned when it was
  collected and, at interpreter exit, printed a ``Pool.__del__`` traceback after the error line
  (intermittently; every time with ``-W error::ResourceWarning``).
- A line far over the byte cap (``preprocess.MAX_LINE_BYTES``) is never held in memory: its
  training pair is dropped as ``too_long`` (64 MB took 2.4 GB before: some 37 times the line),
  its UTF-8 is still checked, and in dev/test, whose references keep every line, it is an error
  naming the line.
"""

from __future__ import annotations

import gc
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from megatron_branchnorm.data import DataError
from megatron_branchnorm.data import preprocess as preprocess_mod
from megatron_branchnorm.data.phase_stats import PhaseStats
from megatron_branchnorm.data.workers import worker_pool

from .conftest import make_opus, run_preprocess, sentences

SAFETY_NET_S = 120
"""Bound on a subprocess that would hang without the fix; never reached when it works."""

# The real front door with a fault patched into one pool's work: argv[1] says which.
KILLER = """
import os, resource, signal, sys
from megatron_branchnorm.commands import preprocess as cmd
from megatron_branchnorm.data import clean_pass, encode_pass, preprocess as pp, spm

pp.CHUNK_LINES = 50
fault = sys.argv[1]
if fault == "clean":
    real_clean = clean_pass._clean_chunk

    def _clean_chunk(task):
        if b"KILL-THIS-WORKER" in task[0]:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_clean(task)

    clean_pass._clean_chunk = _clean_chunk
elif fault == "encode":
    real_encode = encode_pass._encode_span

    def _encode_span(task):
        with open(task[0], "rb") as f:
            f.seek(task[1])
            if b"KILL-THIS-WORKER" in f.read(task[2] - task[1]):
                os.kill(os.getpid(), signal.SIGKILL)
        return real_encode(task)

    encode_pass._encode_span = _encode_span
elif fault == "encode-start":
    real_init = spm.init_worker

    def init_worker(model_file, pool_worker=True):
        if pool_worker:
            os.kill(os.getpid(), signal.SIGKILL)
        real_init(model_file, pool_worker)

    spm.init_worker = init_worker
elif fault == "spm":

    def _train_spm(*args):
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.abort()  # as a C++ std::bad_alloc under a memory limit does

    pp._train_spm = _train_spm
sys.exit(cmd.main(sys.argv[2:]))
"""

# The front door, then its peak memory (the largest of this process and its children) in KiB.
MEASURED = """
import resource, sys
from megatron_branchnorm.commands import preprocess as cmd
code = cmd.main(sys.argv[1:])
usage = resource.getrusage
peak = max(usage(resource.RUSAGE_SELF).ru_maxrss, usage(resource.RUSAGE_CHILDREN).ru_maxrss)
print(f"peak_kib {peak}")
sys.exit(code)
"""


def _argv(raw: Path, out: Path, *extra: str) -> list[str]:
    return [
        *("--format", "opus100", "--input", str(raw), "--langs", "de", "--output", str(out)),
        *("--vocab-size", "100", "--character-coverage", "1.0", "--no-progress", *extra),
    ]  # fmt: skip


def _train_file(raw: Path, lang: str, split: str = "train") -> Path:
    return raw / "opus-100-corpus" / "v1.0" / "supervised" / "de-en" / f"opus.de-en-{split}.{lang}"


def _replace_line(path: Path, number: int, line: bytes) -> None:
    """Replace 1-based line ``number`` of ``path``."""
    lines = path.read_bytes().split(b"\n")
    lines[number - 1] = line
    path.write_bytes(b"\n".join(lines))


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name)


# --------------------------------------------------------------------------------------------
# A dead worker: one line, exit 2, nothing published


DEATHS = {
    "clean": r"cleaning \S+opus\.de-en-train\.en from line 101 and \S+opus\.de-en-train\.de "
    r"from line 101\) was killed by SIGKILL \(out of memory\?\)",
    "encode": r"encoding chunk 3 of 6 of train de-en\) was killed by SIGKILL \(out of memory\?\)",
    "encode-start": r"starting\) was killed by SIGKILL \(out of memory\?\)",
    "spm": r"training SentencePiece on 600 sentences\) aborted \(SIGABRT: out of memory under "
    r"a memory limit\?\)",
}


@pytest.mark.parametrize("fault", list(DEATHS))
def test_a_dead_worker_ends_the_run_with_one_line(tmp_path: Path, fault: str) -> None:
    make_opus(tmp_path / "raw", {"de": (300, 5, 5)})
    _replace_line(_train_file(tmp_path / "raw", "en"), 120, b"KILL-THIS-WORKER now")
    out = tmp_path / "out"
    res = subprocess.run(
        [sys.executable, "-c", KILLER, fault, *_argv(tmp_path / "raw", out, "--workers", "2")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=SAFETY_NET_S,
    )
    assert res.returncode == 2, res.stderr[-3000:]
    assert re.fullmatch(
        rf"error: preprocess worker \d+ \({DEATHS[fault]}; nothing was published\n", res.stderr
    ), res.stderr[-3000:]
    assert not out.exists() and _leftovers(tmp_path) == []


# --------------------------------------------------------------------------------------------
# No pool left "running" after an error


def test_sentencepiece_error_is_one_line_and_no_pool_traceback(tmp_path: Path) -> None:
    """SentencePiece refuses the vocabulary size; its child's pool must be left terminated,
    which ``-W error::ResourceWarning`` turns from intermittent into certain."""
    make_opus(tmp_path / "raw", {"de": (3, 1, 1)})
    res = subprocess.run(
        [sys.executable, "-W", "error::ResourceWarning", "-m", "megatron_branchnorm.commands."
         "preprocess", *_argv(tmp_path / "raw", tmp_path / "out", "--workers", "2")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=SAFETY_NET_S,
    )  # fmt: skip
    assert res.returncode == 2
    assert re.fullmatch(
        r"error: SentencePiece training on 6 sentences failed: .*Vocabulary size too high .*\n",
        res.stderr,
    ), res.stderr
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


@pytest.mark.parametrize("n, inline_one", [(1, False), (2, True)])
def test_a_pool_left_by_an_error_is_terminated(n: int, inline_one: bool) -> None:
    """Every pool (the trainer's one child, the cleaning and encoding workers) goes through
    ``worker_pool``: after an error in its body nothing is left running to warn."""
    stats = PhaseStats(sample_memory=False)
    with pytest.raises(DataError, match="the body failed"):
        with worker_pool(n, stats, inline_one=inline_one) as pool:
            raise DataError("the body failed")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del pool
        gc.collect()
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []


# --------------------------------------------------------------------------------------------
# A line over the byte cap


def test_a_huge_line_is_dropped_in_bounded_memory(tmp_path: Path) -> None:
    """A 64 MB training line among 400 normal pairs: dropped and counted as ``too_long``, the
    others kept; peak memory of the run (two workers) under 20 times the line's size: read
    whole, the line took 2,297 MiB (36 times), read in bounded pieces about 43 MiB on a quiet
    machine, and up to 642 MiB seen on a loaded one (the process's imports and its workers'
    start count too), so the bound separates the two without depending on the load."""
    raw = tmp_path / "raw"
    make_opus(raw, {"de": (400, 20, 20)})
    text = " ".join(sentences("en", 200, 7)).encode() + b" "
    huge = text * ((64 << 20) // len(text))
    _replace_line(_train_file(raw, "en"), 11, huge)
    res = subprocess.run(
        [sys.executable, "-c", MEASURED, *_argv(raw, tmp_path / "out", "--workers", "2")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=SAFETY_NET_S,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    peak = int(re.search(r"^peak_kib (\d+)$", res.stdout, re.M).group(1)) * 1024
    assert peak < 20 * len(huge), f"peak {peak / 2**20:.0f} MiB for a {len(huge) >> 20} MiB line"
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    train = m["splits"]["train"]["pairs"]["de-en"]
    assert train["raw_sentences"] == 400 and train["sentences"] == 399
    assert train["filters"] == {"bad_utf8": 0, "empty": 0, "too_long": 1}


@pytest.fixture
def small_cap(monkeypatch) -> int:
    monkeypatch.setattr(preprocess_mod, "MAX_LINE_BYTES", 300)
    monkeypatch.setattr(preprocess_mod, "CHUNK_LINES", 7)
    return 300


def _long(n: int) -> bytes:
    return (b"word " * n)[:n]


@pytest.mark.parametrize("workers", [1, 2])
def test_pairs_over_the_cap_are_dropped_like_never_there(tmp_path: Path, small_cap, workers):
    """Long sides (either side, at the cap + 1, at the end of a file without its newline) are
    dropped and counted; the rest of the output is the output of the corpus without them."""
    make_opus(tmp_path / "raw", {"de": (60, 5, 5)})
    make_opus(tmp_path / "short", {"de": (60, 5, 5)})
    en, de = _train_file(tmp_path / "raw", "en"), _train_file(tmp_path / "raw", "de")
    _replace_line(en, 3, _long(small_cap + 1))
    _replace_line(de, 20, _long(10 * small_cap))
    _replace_line(de, 21, _long(small_cap))  # at the cap: kept
    _replace_line(en, 60, _long(5 * small_cap))  # the last line, without its newline
    en.write_bytes(en.read_bytes().rstrip(b"\n"))
    for path, raw_path in ((en, _train_file(tmp_path / "short", "en")),
                           (de, _train_file(tmp_path / "short", "de"))):  # fmt: skip
        lines = path.read_bytes().split(b"\n")
        kept = [x for i, x in enumerate(lines[:60]) if i + 1 not in (3, 20, 60)]
        raw_path.write_bytes(b"\n".join(kept) + b"\n")
    m = run_preprocess(tmp_path / "raw", tmp_path / "out", ["de"], workers=workers)
    short = run_preprocess(tmp_path / "short", tmp_path / "out-short", ["de"], workers=workers)
    train = m["splits"]["train"]["pairs"]["de-en"]
    assert train["raw_sentences"] == 60 and train["sentences"] == 57
    assert train["filters"] == {"bad_utf8": 0, "empty": 0, "too_long": 3}
    assert short["splits"]["train"]["pairs"]["de-en"]["sentences"] == 57
    for rel in ("spm.model", "bin/train.de-en.en.bin", "bin/train.de-en.de.bin"):
        assert (tmp_path / "out" / rel).read_bytes() == (tmp_path / "out-short" / rel).read_bytes()


def test_invalid_utf8_past_the_cap_is_still_found(tmp_path: Path, small_cap) -> None:
    make_opus(tmp_path / "raw", {"de": (30, 5, 5)})
    _replace_line(_train_file(tmp_path / "raw", "de"), 9, _long(1000) + b"\xff" + _long(1000))
    with pytest.raises(DataError, match=r"train\.de:9: invalid UTF-8 \(byte 0xff at column 1001"):
        run_preprocess(tmp_path / "raw", tmp_path / "out", ["de"])
    m = run_preprocess(tmp_path / "raw", tmp_path / "out", ["de"], on_bad_utf8="skip")
    assert m["splits"]["train"]["pairs"]["de-en"]["filters"]["bad_utf8"] == 1


def test_a_dev_line_over_the_cap_is_an_error_naming_it(tmp_path: Path, small_cap) -> None:
    make_opus(tmp_path / "raw", {"de": (30, 5, 5)})
    _replace_line(_train_file(tmp_path / "raw", "en", "dev"), 4, _long(2000))
    with pytest.raises(
        DataError, match=r"dev\.en:4: a line of 2000 bytes, over the 300 bytes .* the dev split"
    ):
        run_preprocess(tmp_path / "raw", tmp_path / "out", ["de"])
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []
