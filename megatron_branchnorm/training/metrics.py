"""``metrics.jsonl``, the run's record: one JSON object per line, written by rank 0 only,
read back by early stopping, retention, plotting, the rehearsal and the research harness.

This module owns the file name and the one reader; it imports neither torch nor TensorBoard
at import time, so tools that only read a run stay light. :class:`MetricsLog` writes the
console line, the JSON rows and TensorBoard's scalars.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_branchnorm.cli import describe_os_error, one_line
from megatron_branchnorm.errors import UserError

METRICS_FILE = "metrics.jsonl"
BLEU_FILE = "valid_bleu.jsonl"
"""Validation BLEU of each checkpoint, written by the companion process
(megatron_branchnorm/inference/valid_bleu.py), never by the trainer: each file has one writer."""
TIMING_KEYS = ("tokens_per_sec", "memory_mb", "elapsed_s", "eta_s")
"""The keys that depend on the machine and its load, not on what was trained."""


class MetricsFileError(UserError, ValueError):
    """A metrics file that a strict reader cannot use: one line naming the file (and line)."""


def metrics_path(save_dir: str | Path, name: str = METRICS_FILE) -> Path:
    return Path(save_dir) / name


def read_metrics(
    save_dir: str | Path, strict: bool = False, name: str = METRICS_FILE
) -> list[dict[str, Any]]:
    """The rows of ``save_dir/metrics.jsonl`` (or of ``name``, e.g. :data:`BLEU_FILE`) in
    file order (a resumed run's rows included).

    Tolerant (the default): a missing file is no rows, and a line that is not a JSON object
    with a ``step`` (the last line of a killed run, cut short) is skipped. ``strict``: those
    are :class:`MetricsFileError`, as is a file without rows."""
    path = metrics_path(save_dir, name)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if strict:
            raise MetricsFileError(f"{path}: missing (not a training run directory?)") from None
        return []
    except OSError:
        if strict:
            raise
        return []
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            if strict:
                raise MetricsFileError(f"{path}:{lineno}: not a JSON object") from None
            continue
        if not isinstance(row, dict) or "step" not in row:
            if strict:
                raise MetricsFileError(f"{path}:{lineno}: expected an object with a 'step' key")
            continue
        rows.append(row)
    if strict and not rows:
        raise MetricsFileError(f"{path}: no rows")
    return rows


def training_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of applied updates (no validation, skip or early-stop rows)."""
    return [r for r in rows if "loss" in r and not r.get("skipped")]


def first_difference(a: str | Path, b: str | Path) -> str | None:
    """Where two runs' ``metrics.jsonl`` differ, leaving out :data:`TIMING_KEYS` (values
    compared exactly: a fixed-seed run repeats bit for bit); None when they are the same."""
    rows_a, rows_b = (
        [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in read_metrics(d, strict=True)]
        for d in (a, b)
    )
    for i, (ra, rb) in enumerate(zip(rows_a, rows_b, strict=False), 1):
        if ra != rb:
            keys = sorted(k for k in ra.keys() | rb.keys() if ra.get(k) != rb.get(k))
            return f"row {i} (step {ra.get('step')}): {', '.join(keys)} differ"
    if len(rows_a) != len(rows_b):
        return f"{len(rows_a)} rows vs {len(rows_b)}"
    return None


def scores_by_step(save_dir: str | Path, key: str, name: str = METRICS_FILE) -> dict[int, float]:
    """``key`` (e.g. ``valid_loss``) by step from ``save_dir/name``: the last row of a step
    wins; non-finite values are ignored."""
    out: dict[int, float] = {}
    for row in read_metrics(save_dir, name=name):
        value = row.get(key)
        if (
            isinstance(value, (int, float))
            and isinstance(row["step"], int)
            and math.isfinite(value)
        ):
            out[row["step"]] = float(value)
    return out


def valid_losses(save_dir: str | Path) -> dict[int, float]:
    """Validation loss by step (the trainer's ``valid_loss`` rows)."""
    return scores_by_step(save_dir, "valid_loss")


def valid_bleus(save_dir: str | Path) -> dict[int, float]:
    """Validation BLEU by step (the companion's rows in :data:`BLEU_FILE`)."""
    return scores_by_step(save_dir, "valid_bleu", BLEU_FILE)


class MetricsLog:
    """The console (rank 0), ``metrics.jsonl`` and TensorBoard (``save_dir/tensorboard``,
    opened at the first row; failures there disable it with a line, never stop training).

    A write failure of ``metrics.jsonl`` (a full disk) is this rank's alone: it is kept in
    :attr:`error` for the stopping part to agree on at the end of the update, so no rank
    waits for this one in a collective."""

    def __init__(
        self, save_dir: Path, is_logger: bool, fail_hook: Callable[[Path], None] | None = None
    ) -> None:
        self.path = metrics_path(save_dir)
        self.tb_dir = Path(save_dir) / "tensorboard"
        self.is_logger = is_logger
        self.fail_hook = fail_hook  # test-only: raise an OSError before a write (faults)
        self.error: str | None = None
        self.tb: Any = None

    def log(self, msg: str) -> None:
        if self.is_logger:
            print(msg, flush=True)

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` (with a ``step``) to metrics.jsonl and TensorBoard."""
        if not self.is_logger or self.error is not None:
            return
        try:
            if self.fail_hook is not None:
                self.fail_hook(self.path)
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(record) + "\n")
        except OSError as exc:
            self.error = f"cannot write metrics: {describe_os_error(exc)}"
            return
        if self.tb is None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(self.tb_dir))
            except Exception as exc:  # noqa: BLE001 - logging must not stop training
                self.log(f"tensorboard disabled: {exc}")
                self.tb = False
        if self.tb:
            try:
                for key, value in _scalars(record):
                    self.tb.add_scalar(key, value, record["step"])
                self.tb.flush()
            except Exception as exc:  # noqa: BLE001 - TensorBoard must not stop training
                self.log(f"tensorboard disabled: {one_line(str(exc), 300)}")
                self.tb = False

    def close(self) -> None:
        if self.tb:
            self.tb.close()
        self.tb = None


def _scalars(record: dict[str, Any]) -> list[tuple[str, float]]:
    """TensorBoard's scalars of a row: its numbers but ``step``, and the numbers of a dict
    value as ``key/name`` (``valid_loss_by_direction/de-en``)."""
    out = []
    for key, value in record.items():
        items = value.items() if isinstance(value, dict) else [(None, value)]
        for name, v in items:
            if isinstance(v, (int, float)) and key != "step":
                out.append((key if name is None else f"{key}/{name}", v))
    return out


def format_eta(seconds: float) -> str:
    """``H:MM:SS``, with days in front past 24 hours (``3d 04:05:06``)."""
    s = max(0, int(round(seconds)))
    days, s = divmod(s, 86400)
    text = f"{s // 3600:d}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return f"{days}d {text}" if days else text


class Progress:
    """The training row of ``metrics.jsonl`` and the console line, every train.log_interval
    applied updates and at the last: losses, throughput since the last row, time used and
    the estimated time to the end."""

    def __init__(
        self, metrics: MetricsLog, log_interval: int, max_steps: int, max_time_minutes: float
    ) -> None:
        self.metrics = metrics
        self.log_interval, self.max_steps, self.budget_min = (
            log_interval,
            max_steps,
            max_time_minutes,
        )
        self.start(0)

    def start(self, step: int) -> None:
        """Training (re)starts at ``step``: the clocks start here."""
        self.start_time = self.last_time = time.time()
        self.first_step, self.tokens = step, 0

    def elapsed(self) -> float:
        """Seconds since training (re)started: ``elapsed_s``, and what the time budget counts."""
        return time.time() - self.start_time

    def count(self, tokens: int) -> None:
        """An applied update of ``tokens`` source + target tokens."""
        self.tokens += tokens

    def due(self, step: int) -> bool:
        return step % self.log_interval == 0 or step == self.max_steps

    def eta(self, elapsed: float, step: int) -> float:
        """Seconds to the end of training at this process's mean time per update: to
        train.max_steps, or to the end of train.max_time_minutes when that comes first."""
        left = (self.max_steps - step) * elapsed / max(step - self.first_step, 1)
        return min(left, self.budget_min * 60 - elapsed) if self.budget_min else left

    def write(self, step: int, loss: float, nll: float, lr: float, **values: Any) -> None:
        """The row of update ``step``: ``values`` are grad_norm, alpha, loss_scale, samples,
        ids_hash, skipped_steps and memory_mb."""
        now = time.time()
        elapsed = now - self.start_time
        v = values
        record = {
            "step": step,
            "loss": loss,
            "nll_loss": nll,
            "ppl": math.exp(min(nll, 50.0)),
            "lr": lr,
            "grad_norm": v["grad_norm"],
            "alpha": v["alpha"],
            "loss_scale": v["loss_scale"],
            "tokens_per_sec": self.tokens / max(now - self.last_time, 1e-9),
            "samples": v["samples"],
            "ids_hash": v["ids_hash"],
            "skipped_steps": v["skipped_steps"],
            "memory_mb": v["memory_mb"],
            "elapsed_s": elapsed,
            "eta_s": self.eta(elapsed, step),
        }
        self.metrics.write(record)
        self.metrics.log(
            f"step {step} | loss {loss:.4f} | nll {nll:.4f} | lr {lr:.3g} | "
            f"gnorm {record['grad_norm'] or 0:.3f} | alpha {v['alpha']:.4f} | "
            f"tok/s {record['tokens_per_sec']:.0f} | mem {v['memory_mb']:.0f}MB | "
            f"eta {format_eta(record['eta_s'])}"
        )
        self.last_time, self.tokens = now, 0
