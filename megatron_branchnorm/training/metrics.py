"""``metrics.jsonl``, the run's record: one JSON object per line, written by rank 0 only,
read back by early stopping, retention, plotting, the rehearsal and the research harness.

This module owns the one writer (the file name, the row format and the one reader are
``formats/records.py``'s); it imports neither torch nor TensorBoard at import time, so tools
that only read a run stay light. :class:`MetricsLog` writes the console line, the JSON rows
and TensorBoard's scalars. The file is only appended to: a run that (re)starts at step S over
rows of an earlier one appends a resume marker (:meth:`MetricsLog.start`), from which the
reader drops the rows a kill made obsolete, so each step reads once.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any

from megatron_branchnorm.formats.files import one_line
from megatron_branchnorm.formats.outputs import describe_os_error
from megatron_branchnorm.formats.records import (
    REDONE_KEY,
    metrics_path,
    read_metrics,
    resume_marker,
    write_row,
)

TIMING_KEYS = (
    "tokens_per_sec",
    "tflops_per_gpu",
    "memory_mb",
    "memory_reserved_mb",
    "elapsed_s",
    "eta_s",
)
"""The keys that depend on the machine and its load, not on what was trained."""
UNCOMPARED_KEYS = (*TIMING_KEYS, REDONE_KEY)
"""What :func:`first_difference` leaves out: timings, and the reader's mark of a row redone
after a resume (the same update gives the same row)."""


def training_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of applied updates (no validation, skip or early-stop rows)."""
    return [r for r in rows if "loss" in r and not r.get("skipped")]


def first_difference(a: str | Path, b: str | Path) -> str | None:
    """Where two runs' ``metrics.jsonl`` differ (the rows readers see: each step once),
    leaving out :data:`UNCOMPARED_KEYS` (values compared exactly: a fixed-seed run repeats
    bit for bit); None when they are the same."""
    rows_a, rows_b = (
        [
            {k: v for k, v in r.items() if k not in UNCOMPARED_KEYS}
            for r in read_metrics(d, strict=True)
        ]
        for d in (a, b)
    )
    for i, (ra, rb) in enumerate(zip(rows_a, rows_b, strict=False), 1):
        if ra != rb:
            keys = sorted(k for k in ra.keys() | rb.keys() if ra.get(k) != rb.get(k))
            return f"row {i} (step {ra.get('step')}): {', '.join(keys)} differ"
    if len(rows_a) != len(rows_b):
        return f"{len(rows_a)} rows vs {len(rows_b)}"
    return None


class MetricsLog:
    """The console (rank 0), ``metrics.jsonl`` and TensorBoard (``save_dir/tensorboard``,
    opened at the first row; failures there disable it with a line, never stop training).

    A write failure of ``metrics.jsonl`` (a full disk) is this rank's alone: it is kept in
    :attr:`error` for the stopping part to agree on at the end of the update, so no rank
    waits for this one in a collective."""

    def __init__(self, save_dir: Path, is_logger: bool) -> None:
        self.path = metrics_path(save_dir)
        self.tb_dir = Path(save_dir) / "tensorboard"
        self.is_logger = is_logger
        self.error: str | None = None
        self.tb: Any = None
        self.purge_step: int | None = None  # TensorBoard hides the events from here on

    def start(self, step: int) -> None:
        """Training (re)starts at ``step``. Over rows an earlier run wrote (a resume, or a
        restart from scratch after a kill before the first checkpoint) append the resume
        marker (:func:`megatron_branchnorm.formats.records.resume_marker`), from which the
        reader drops the rows after ``step`` the restart makes obsolete; TensorBoard hides
        that run's events after ``step`` alike. A failure to write is kept as :meth:`write`'s."""
        if not self.is_logger or self.error is not None:
            return
        try:
            earlier_rows = self.path.stat().st_size > 0
        except FileNotFoundError:
            earlier_rows = False
        except OSError:  # unknown: the marker is harmless, and the write reports a failure
            earlier_rows = True
        if not earlier_rows:
            return
        self.purge_step = step + 1
        self._append(resume_marker(step))

    def _append(self, record: dict[str, Any]) -> bool:
        """Append one row to metrics.jsonl; False (and :attr:`error` set) when it failed."""
        try:
            with open(self.path, "ab+") as fh:
                write_row(fh, record)
        except OSError as exc:
            self.error = f"cannot write metrics: {describe_os_error(exc)}"
            return False
        return True

    def log(self, msg: str) -> None:
        if self.is_logger:
            print(msg, flush=True)

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` (with a ``step``) to metrics.jsonl and TensorBoard."""
        if not self.is_logger or self.error is not None or not self._append(record):
            return
        if self.tb is None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(self.tb_dir), purge_step=self.purge_step)
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


def _reserved(mb: float | None) -> str:
    return "" if mb is None else f" (reserved {mb:.0f}MB)"


def format_eta(seconds: float) -> str:
    """``H:MM:SS``, with days in front past 24 hours (``3d 04:05:06``)."""
    s = max(0, int(round(seconds)))
    days, s = divmod(s, 86400)
    text = f"{s // 3600:d}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return f"{days}d {text}" if days else text


@dataclasses.dataclass(frozen=True)
class UpdateFigures:
    """What the trainer measured of an applied update, for its row (:meth:`Progress.write`)."""

    step: int
    loss: float
    nll_loss: float
    lr: float
    grad_norm: float | None
    alpha: float
    loss_scale: float
    samples: int
    ids_hash: str
    skipped_steps: int
    memory_mb: float
    memory_reserved_mb: float | None = None
    """The caching allocator's peak on a GPU (what an out-of-memory error is about: allocated
    plus the blocks it keeps cut up); None on the CPU."""


@dataclasses.dataclass(frozen=True)
class TrainingRow:
    """The ``metrics.jsonl`` row of an applied update: its fields, in this order, are the
    row's keys (:data:`TIMING_KEYS` are the machine's, the rest what was trained)."""

    step: int
    loss: float
    nll_loss: float
    ppl: float
    lr: float
    grad_norm: float | None
    alpha: float
    loss_scale: float
    tokens_per_sec: float
    tflops_per_gpu: float
    samples: int
    ids_hash: str
    skipped_steps: int
    memory_mb: float
    memory_reserved_mb: float | None
    elapsed_s: float
    eta_s: float


class Progress:
    """The training row of ``metrics.jsonl`` and the console line, every train.log_interval
    applied updates and at the last: losses, throughput since the last row (tokens per second
    over all ranks, and model TFLOP/s per GPU over the ``gpus`` of the run), time used and the
    estimated time to the end."""

    def __init__(
        self,
        metrics: MetricsLog,
        log_interval: int,
        max_steps: int,
        max_time_minutes: float,
        gpus: int = 1,
    ) -> None:
        self.metrics = metrics
        self.log_interval, self.max_steps, self.budget_min = (
            log_interval,
            max_steps,
            max_time_minutes,
        )
        self.gpus = gpus
        self._clock(0)

    def _clock(self, step: int) -> None:
        self.start_time = self.last_time = time.time()
        self.first_step, self.tokens, self.flops = step, 0, 0.0

    def start(self, step: int) -> None:
        """Training (re)starts at ``step``: the clocks start here, and metrics.jsonl records
        the restart (:meth:`MetricsLog.start`)."""
        self._clock(step)
        self.metrics.start(step)

    def elapsed(self) -> float:
        """Seconds since training (re)started: ``elapsed_s``, and what the time budget counts."""
        return time.time() - self.start_time

    def count(self, tokens: int, flops: float = 0.0) -> None:
        """An applied update of ``tokens`` source + target tokens and ``flops`` model FLOPs
        (planner.training_flops: the whole model's, over all data-parallel replicas)."""
        self.tokens += tokens
        self.flops += flops

    def due(self, step: int) -> bool:
        return step % self.log_interval == 0 or step == self.max_steps

    def eta(self, elapsed: float, step: int) -> float:
        """Seconds to the end of training at this process's mean time per update: to
        train.max_steps, or to the end of train.max_time_minutes when that comes first."""
        left = (self.max_steps - step) * elapsed / max(step - self.first_step, 1)
        return min(left, self.budget_min * 60 - elapsed) if self.budget_min else left

    def write(self, update: UpdateFigures) -> TrainingRow:
        """The row of the applied update ``update`` (metrics.jsonl, TensorBoard, the console
        line), with the throughput since the last row, the time used and the ETA."""
        now = time.time()
        elapsed = now - self.start_time
        u = update
        row = TrainingRow(
            step=u.step,
            loss=u.loss,
            nll_loss=u.nll_loss,
            ppl=math.exp(min(u.nll_loss, 50.0)),
            lr=u.lr,
            grad_norm=u.grad_norm,
            alpha=u.alpha,
            loss_scale=u.loss_scale,
            tokens_per_sec=self.tokens / max(now - self.last_time, 1e-9),
            tflops_per_gpu=self.flops / max(now - self.last_time, 1e-9) / self.gpus / 1e12,
            samples=u.samples,
            ids_hash=u.ids_hash,
            skipped_steps=u.skipped_steps,
            memory_mb=u.memory_mb,
            memory_reserved_mb=u.memory_reserved_mb,
            elapsed_s=elapsed,
            eta_s=self.eta(elapsed, u.step),
        )
        self.metrics.write(dataclasses.asdict(row))
        self.metrics.log(
            f"step {row.step} | loss {row.loss:.4f} | nll {row.nll_loss:.4f} | lr {row.lr:.3g} | "
            f"gnorm {row.grad_norm or 0:.3f} | alpha {row.alpha:.4f} | "
            f"tok/s {row.tokens_per_sec:.0f} | TFLOP/s/GPU {row.tflops_per_gpu:.3g} | "
            f"mem {row.memory_mb:.0f}MB{_reserved(row.memory_reserved_mb)} | "
            f"eta {format_eta(row.eta_s)}"
        )
        self.last_time, self.tokens, self.flops = now, 0, 0.0
        return row
