"""A workflow's long steps, shared by the demo (``workflows/demo.py``) and the research harness
(``experiments/fairseq_side_by_side.py``, ``experiments/depth_study.py``): a status line with
the elapsed time and an estimate of the time left, a command run in its own process group with
its output in a log file (``launch.logged_group``), and the demo's data: the built-in corpus and
its preprocessed DATA_DIR, each reused when it matches.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_branchnorm.errors import UserError
from megatron_branchnorm.formats.data_dir import DataError, read_data_manifest
from megatron_branchnorm.runner.launch import logged_group

# Typical durations on a 2-core CPU (seconds), used for the ETA before a step reports progress.
EXPECTED_S = {"corpus": 10.0, "preprocess": 60.0, "launch": 25.0, "convert": 15.0}


class DemoError(UserError, RuntimeError):
    """A demo step failed: a one-line message naming the step and its log."""


# --------------------------------------------------------------------------------------------
# Status line
# --------------------------------------------------------------------------------------------


def fmt_time(seconds: float) -> str:
    """``mm:ss`` (or ``h:mm:ss``) of a non-negative duration."""
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class Status:
    """One live status line per step: elapsed, estimated time left, a detail string.

    On a terminal the line is redrawn in place; otherwise a line is printed every
    ``every_s`` seconds (logs stay short).
    """

    def __init__(self, stream: Any = None, every_s: float = 30.0) -> None:
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_s = every_s
        self.demo_start = time.time()
        self._last_print = 0.0
        self._width = 0

    def update(self, label: str, start: float, left_s: float | None, detail: str = "") -> None:
        """Show ``label``'s progress; ``left_s`` None means unknown."""
        now = time.time()
        eta = "?" if left_s is None else f"~{fmt_time(left_s)}"
        line = f"{label}: {fmt_time(now - start)} elapsed, {eta} left"
        if detail:
            line += f" | {detail}"
        if self.tty:
            pad = max(0, self._width - len(line))
            self.stream.write("\r" + line + " " * pad)
            self.stream.flush()
            self._width = len(line)
        elif now - self._last_print >= self.every_s:
            self.stream.write(line + "\n")
            self.stream.flush()
            self._last_print = now

    def done(self, label: str, start: float, detail: str = "") -> None:
        """Close ``label``'s line with its duration."""
        line = f"{label}: done in {fmt_time(time.time() - start)}"
        if detail:
            line += f" | {detail}"
        if self.tty:
            line += " " * max(0, self._width - len(line))
            self.stream.write("\r")
        self.stream.write(line + "\n")
        self.stream.flush()
        self._width = 0
        self._last_print = 0.0


def run_logged(
    cmd: list[str],
    log: Path,
    label: str,
    status: Status,
    expected_s: float | None,
    detail: Callable[[], tuple[float | None, str]] | None = None,
    env: dict[str, str] | None = None,
) -> float:
    """Run ``cmd`` with its output in ``log``, showing a status line; returns the seconds taken.

    ``detail()`` may give (seconds left, text) while the command runs; without it the time left
    is ``expected_s`` minus the elapsed time, or unknown ("?") when ``expected_s`` is None.
    """
    start = time.time()
    # Own process group: an interrupt stops the launcher *and* the ranks it started.
    with logged_group(cmd, log, env=env) as proc:
        while proc.poll() is None:
            left, text = detail() if detail else (None, "")
            if left is None and expected_s is not None:
                left = max(0.0, expected_s - (time.time() - start))
            status.update(label, start, left, text)
            time.sleep(1.0)
    if proc.returncode != 0:
        tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-15:]
        sys.stderr.write("\n" + "\n".join("  | " + line for line in tail) + "\n")
        raise DemoError(f"{label} failed (exit {proc.returncode}); full log: {log}")
    status.done(label, start)
    return time.time() - start


# --------------------------------------------------------------------------------------------
# The demo's data
# --------------------------------------------------------------------------------------------


def data_matches(data_dir: Path, langs: list[str], vocab_size: int) -> bool:
    """Whether ``data_dir`` is a complete preprocessed DATA_DIR for these settings."""
    try:
        m = read_data_manifest(data_dir)
    except (OSError, DataError):
        return False
    return list(m.languages) == sorted({*langs, m.pivot}) and m.vocab_size == vocab_size


def prepare_data(
    out: Path,
    corpus_dir: Path | None,
    langs: list[str],
    vocab_size: int,
    status: Status,
    timings: dict[str, float],
) -> Path:
    """Steps 1-2 of the demo: the locale corpus (``OUT/corpus``, unless ``corpus_dir`` is given)
    and its DATA_DIR ``OUT/data``, each reused when it matches; returns the DATA_DIR. Seconds
    taken go into ``timings``."""
    logs = out / "logs"
    py = sys.executable
    corpus = corpus_dir
    if corpus is None:
        corpus = out / "corpus"
        if (corpus / "locale_corpus.json").is_file() and data_matches(
            out / "data", langs, vocab_size
        ):
            print(f"[1/7] corpus: reusing {corpus}", file=sys.stderr)
        else:
            if corpus.exists():
                shutil.rmtree(corpus)
            timings["corpus"] = run_logged(
                [
                    py,
                    "-m",
                    "megatron_branchnorm.commands.corpus",
                    "--output",
                    str(corpus),
                    "--langs",
                    ",".join(langs),
                ],
                logs / "corpus.log",
                "[1/7] corpus",
                status,
                EXPECTED_S["corpus"],
            )
    data = out / "data"
    if data_matches(data, langs, vocab_size):
        print(f"[2/7] preprocess: reusing {data}", file=sys.stderr)
    else:
        if data.exists():
            shutil.rmtree(data)
        timings["preprocess"] = run_logged(
            [
                py,
                "-m",
                "megatron_branchnorm.commands.preprocess",
                "--format",
                "opus100",
                "--input",
                str(corpus),
                "--langs",
                ",".join(langs),
                "--output",
                str(data),
                "--vocab-size",
                str(vocab_size),
                "--workers",
                "2",
                "--no-progress",
            ],
            logs / "preprocess.log",
            "[2/7] preprocess",
            status,
            EXPECTED_S["preprocess"],
        )
    return data
