"""The run's records in its save_dir, their one owner: file names, the one tolerant reader of
the JSON-lines files, the validation BLEU rows, and ``best.json``.

- ``metrics.jsonl``: one JSON object per line with a ``step``, written by rank 0 of the
  trainer only (``training/metrics.py``, the one writer); read by early stopping, retention,
  plotting, the rehearsal and the research harness through :func:`read_metrics`. The file is
  only ever appended to. A run that (re)starts at step S in a save_dir whose file has rows
  first appends a resume marker ``{"step": S, "resumed_from": S}``: the rows written before
  it past S belong to updates a kill lost (redone from the checkpoint at S, or never). The
  reader gives each step once, the row of the latest run (:func:`metrics_history`);
- ``valid_bleu.jsonl``: the same form, one row per scored checkpoint, written by the companion
  process only (:func:`append_bleu_row`, ``inference/valid_bleu.py``). A score is keyed by
  what was scored (:func:`bleu_row_key`): the checkpoint's identity (``checkpoint_id``,
  :func:`megatron_branchnorm.formats.checkpoint.checkpoint_id`) and ``scoring`` (the split,
  the sentences and the options). Ranking reads them through :func:`validation_bleus`;
- ``best.json``: ``{"metric": ..., "checkpoints": [{"tag": ..., <metric>: ...,
  "checkpoint_id": ...}, ...]}``, the checkpoints retention keeps for their score, best first
  (:func:`write_best`, :func:`read_best`, :func:`read_best_ids`).

No torch import: tools that only read a run stay light.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from megatron_branchnorm.errors import UserError
from megatron_branchnorm.formats.files import (
    FileShapeError,
    open_regular,
    read_json_object,
    write_json_atomic,
)

METRICS_FILE = "metrics.jsonl"
BLEU_FILE = "valid_bleu.jsonl"
"""Validation BLEU of each checkpoint, written by the companion process
(megatron_branchnorm/inference/valid_bleu.py), never by the trainer: each file has one writer."""
BEST_FILE = "best.json"
MAX_RECORD_FILE_BYTES = 1 << 30
"""Largest record file read: a long run's ``metrics.jsonl`` holds tens of MB (a row of a few
hundred bytes per logged update); a larger file (a device, a huge file put there) is refused."""
MAX_RECORD_LINE_BYTES = 1 << 20
"""Longest line read as a row (a row is at most a few KB); a longer one is a bad line, read in
pieces and never held whole."""


RESUME_KEY = "resumed_from"
"""The key of a resume marker (:func:`resume_marker`)."""
REDONE_KEY = "redone"
"""Set (True) by the reader on a row that replaces one a kill made obsolete: the update was
redone after a resume. Never written to the file."""


class MetricsFileError(UserError, ValueError):
    """A record file that a strict reader cannot use: one line naming the file (and line)."""


def metrics_path(save_dir: str | Path, name: str = METRICS_FILE) -> Path:
    return Path(save_dir) / name


def read_rows(
    save_dir: str | Path, strict: bool = False, name: str = METRICS_FILE
) -> list[dict[str, Any]]:
    """Every row of ``save_dir/metrics.jsonl`` (or of ``name``, e.g. :data:`BLEU_FILE`) in
    file order, as written: resume markers and the rows they make obsolete included. To
    follow a file as it grows (rows written since a given count); otherwise read
    :func:`read_metrics`.

    Tolerant (the default): a missing file is no rows, and a line that is not a JSON object
    with a ``step`` (the last line of a killed run, cut short), or a resume marker whose step
    is not a whole number, is skipped. ``strict``: those are :class:`MetricsFileError`, as is
    a file without rows; but for a killed run's last line that a restart's resume marker
    follows (what a kill leaves, kept: the file is only appended to).

    Either way the file is read line by line, only when it is a regular file of at most
    :data:`MAX_RECORD_FILE_BYTES` (a FIFO, a device or a larger file is a
    :class:`MetricsFileError`, never a blocked or unbounded read); a line longer than
    :data:`MAX_RECORD_LINE_BYTES` is a bad line."""
    path = metrics_path(save_dir, name)
    try:
        fh = open_regular(path)
    except FileNotFoundError:
        if strict:
            raise MetricsFileError(f"{path}: missing (not a training run directory?)") from None
        return []
    except FileShapeError as exc:
        raise MetricsFileError(str(exc)) from None
    except OSError:
        if strict:
            raise
        return []
    with fh:
        size = os.fstat(fh.fileno()).st_size
        if size > MAX_RECORD_FILE_BYTES:
            raise MetricsFileError(
                f"{path}: {size:,} bytes, more than the {MAX_RECORD_FILE_BYTES >> 30} GiB a "
                "record file of a run ever holds; not ours"
            )
        return _parse_rows(path, _lines(fh), strict)


def _lines(fh: BinaryIO) -> Iterator[bytes | None]:
    """The lines of ``fh``, read one at a time; None for a line longer than
    :data:`MAX_RECORD_LINE_BYTES` (never held whole: not a row of ours)."""
    while line := fh.readline(MAX_RECORD_LINE_BYTES + 1):
        if len(line) > MAX_RECORD_LINE_BYTES and not line.endswith(b"\n"):
            while line and not line.endswith(b"\n"):
                line = fh.readline(MAX_RECORD_LINE_BYTES)
            yield None
        else:
            yield line


def _load_line(raw: bytes | None, strict: bool) -> Any:
    """The JSON value of one line (None: a line too long to be a row, a ValueError)."""
    if raw is None:
        raise ValueError(f"a line longer than {MAX_RECORD_LINE_BYTES >> 20} MiB")
    return json.loads(raw.decode("utf-8", errors="strict" if strict else "replace"))


def _parse_rows(path: Path, lines: Iterable[bytes | None], strict: bool) -> list[dict[str, Any]]:
    """:func:`read_rows`'s rules applied to the lines of ``path``."""
    rows = []
    cut: MetricsFileError | None = None  # strict: a bad line, an error unless a marker follows
    for lineno, raw in enumerate(lines, 1):
        if raw is not None and not raw.strip():
            continue
        try:
            row = _load_line(raw, strict)
        except UnicodeDecodeError as exc:
            raise MetricsFileError(
                f"{path}: not UTF-8 text ({exc.reason}, line {lineno})"
            ) from None
        except ValueError:
            if cut is not None:
                raise cut from None
            cut = MetricsFileError(f"{path}:{lineno}: not a JSON object") if strict else None
            continue
        if cut is not None:
            if not isinstance(row, dict) or RESUME_KEY not in row:
                raise cut
            cut = None
        if not isinstance(row, dict) or "step" not in row:
            if strict:
                raise MetricsFileError(f"{path}:{lineno}: expected an object with a 'step' key")
            continue
        if RESUME_KEY in row and _step(row.get(RESUME_KEY)) is None:
            if strict:
                raise MetricsFileError(
                    f"{path}:{lineno}: {RESUME_KEY!r} must be a step (a whole number >= 0), "
                    f"got {row[RESUME_KEY]!r}"
                )
            continue
        rows.append(row)
    if cut is not None:
        raise cut
    if strict and not rows:
        raise MetricsFileError(f"{path}: no rows")
    return rows


def resume_marker(step: int) -> dict[str, int]:
    """The record the trainer appends when it (re)starts at ``step`` in a save_dir whose
    ``metrics.jsonl`` already has rows: the rows before it past ``step`` are obsolete."""
    return {"step": step, RESUME_KEY: step}


def write_row(fh: BinaryIO, row: dict[str, Any]) -> None:
    """Append ``row`` as one JSON line to ``fh`` (a record file opened ``"ab+"``) in one
    write, on a line of its own when the file ends in a line a kill cut short (which the
    reader skips): a kill at any moment loses at most the row being written."""
    cut = fh.seek(0, 2) > 0 and fh.seek(-1, 2) >= 0 and fh.read(1) != b"\n"
    fh.write(("\n" if cut else "").encode() + (json.dumps(row) + "\n").encode("utf-8"))


def _step(value: Any) -> int | None:
    """``value`` when it is a step number (an int >= 0, not a bool), else None."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return value if ok else None


def _row_key(row: dict[str, Any]) -> tuple[Any, ...] | None:
    """What a row records, for replacing an earlier record of the same: (step, kind), the
    kind a training row, a validation row, an early stop, or the n-th skipped update in a row
    at that step; None for a row of another form (kept as written, never replaced)."""
    step = _step(row.get("step"))
    if step is None:
        return None
    if row.get("skipped"):
        consecutive = row.get("consecutive_skips")
        return step, "skipped", consecutive if isinstance(consecutive, int) else None
    for kind in ("early_stop", "valid_loss", "loss"):
        if kind in row:
            return step, kind
    return None


def _past(row: dict[str, Any], step: int) -> bool:
    """Whether ``row`` records something after the checkpoint at ``step`` was saved: a row
    of a later step, or a skipped update or early stop at ``step`` (both written after its
    update, validation and save)."""
    row_step = _step(row.get("step"))
    if row_step is None:
        return False
    return row_step > step or (
        row_step == step and bool(row.get("skipped") or row.get("early_stop"))
    )


@dataclasses.dataclass(frozen=True)
class MetricsHistory:
    """A run's ``metrics.jsonl`` read through its resumes (:func:`metrics_history`)."""

    rows: list[dict[str, Any]]
    """What readers see: each step (of each kind) once, the row of the latest run, in file
    order; a row that replaced an obsolete one has ``"redone": True``."""
    replaced: list[dict[str, Any]]
    """The rows made obsolete (redone later, or lost for good), as written, in the order they
    were replaced."""
    resumes: list[int]
    """The steps of the resume markers, in file order."""


def metrics_history(written: list[dict[str, Any]]) -> MetricsHistory:
    """The rows readers see of the rows ``written`` (:func:`read_rows`):

    - a resume marker at step S makes obsolete every earlier row past S (:func:`_past`): the
      updates after the checkpoint a restart resumed from were lost, and are redone;
    - a row replaces an earlier one of the same step and kind (:func:`_row_key`), so a file
      from before the markers (its resumes unmarked) still gives each step once.

    A row that takes the place of an obsolete row of the same step and kind is marked
    ``"redone": True``. Rows of another form (no whole-number step, an unknown kind) are kept
    as written."""
    view: list[tuple[dict[str, Any], dict[str, Any]] | None] = []  # (as written, as seen)
    where: dict[tuple[Any, ...], int] = {}  # key -> its row's index in view
    obsolete: set[tuple[Any, ...]] = set()
    replaced: list[dict[str, Any]] = []
    resumes: list[int] = []

    def drop(i: int) -> None:
        entry = view[i]
        assert entry is not None
        key = _row_key(entry[0])
        if key is not None:
            obsolete.add(key)
            where.pop(key, None)
        replaced.append(entry[0])
        view[i] = None

    for row in written:
        if RESUME_KEY in row:
            step = _step(row[RESUME_KEY])
            if step is not None:
                resumes.append(step)
                for i, entry in enumerate(view):
                    if entry is not None and _past(entry[0], step):
                        drop(i)
            continue
        key = _row_key(row)
        if key is not None and key in where:
            drop(where[key])
        seen = {**row, REDONE_KEY: True} if key is not None and key in obsolete else row
        if key is not None:
            where[key] = len(view)
        view.append((row, seen))
    return MetricsHistory([e[1] for e in view if e is not None], replaced, resumes)


def read_metrics_history(save_dir: str | Path, strict: bool = False) -> MetricsHistory:
    """``save_dir/metrics.jsonl`` read through its resumes (:func:`metrics_history`), with
    the rows made obsolete; errors as :func:`read_metrics`."""
    history = metrics_history(read_rows(save_dir, strict=strict))
    if strict and not history.rows:
        raise MetricsFileError(f"{metrics_path(save_dir)}: no rows (only resume markers)")
    return history


def read_metrics(
    save_dir: str | Path, strict: bool = False, name: str = METRICS_FILE
) -> list[dict[str, Any]]:
    """The rows of ``save_dir/metrics.jsonl`` as readers see them: each step (of each kind:
    training, validation, early stop, skipped update) once, the row of the latest run, in
    file order, a redone row marked ``"redone": True`` (:func:`metrics_history`; the rows a
    resume made obsolete: :func:`read_metrics_history`). ``name``: another record file read
    by the same rules (:data:`BLEU_FILE`: its rows are of another kind and it has no resume
    markers, so they read as written).

    Tolerant (the default): a missing file is no rows, and a line that is not a JSON object
    with a ``step`` (the last line of a killed run, cut short) is skipped. ``strict``: those
    are :class:`MetricsFileError`, as is a file without rows."""
    rows = metrics_history(read_rows(save_dir, strict=strict, name=name)).rows
    if strict and not rows:
        raise MetricsFileError(f"{metrics_path(save_dir, name)}: no rows (only resume markers)")
    return rows


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
    """BLEU by step of every row in :data:`BLEU_FILE`, as written (the last row of a step
    wins, whatever split, options or checkpoint it scored). To rank checkpoints, use
    :func:`validation_bleus`."""
    return scores_by_step(save_dir, "valid_bleu", BLEU_FILE)


# ---- the key of a validation BLEU row ---------------------------------------------------------

VALIDATION_SPLIT = "dev"
"""The split whose BLEU ranks checkpoints (``train.best_metric=valid_bleu``); rows of another
split (``watch_bleu.py --split test``) are kept in the file but never rank."""


def bleu_scoring_key(row: dict[str, Any]) -> str | None:
    """How a row was scored, as one comparable string: its ``scoring`` object (split, number
    of sentences, fingerprint of the sources and references, directions, beam search and BLEU
    options) in canonical JSON; None for a row without one (written before rows were keyed)."""
    scoring = row.get("scoring")
    if not isinstance(scoring, dict) or not isinstance(scoring.get("split"), str):
        return None
    return json.dumps(scoring, sort_keys=True)


def bleu_row_key(row: dict[str, Any]) -> tuple[str, str] | None:
    """(checkpoint id, :func:`bleu_scoring_key`): what a row scored. None for an unkeyed row
    (no ``checkpoint_id`` or no ``scoring``: an older companion's), which matches nothing:
    such a checkpoint is scored again and the old row never ranks it."""
    checkpoint = row.get("checkpoint_id")
    scoring = bleu_scoring_key(row)
    if not isinstance(checkpoint, str) or not checkpoint or scoring is None:
        return None
    return checkpoint, scoring


def bleu_scored_keys(save_dir: str | Path) -> set[tuple[str, str]]:
    """The keys (:func:`bleu_row_key`) of every keyed row of ``save_dir/valid_bleu.jsonl``:
    the companion skips a checkpoint only when its key is among them."""
    keys = (bleu_row_key(row) for row in read_rows(save_dir, name=BLEU_FILE))
    return {k for k in keys if k is not None}


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def validation_bleus(save_dir: str | Path, checkpoint_ids: Mapping[int, str]) -> dict[int, float]:
    """Validation BLEU by step, to rank the checkpoints on disk (retention's
    ``best_metric=valid_bleu``). ``checkpoint_ids``: {step: checkpoint id} of the complete
    checkpoints now on disk.

    A row counts only when it is keyed (:func:`bleu_row_key`), scored the validation split
    (:data:`VALIDATION_SPLIT`) and scored the checkpoint that is at its step now (the same
    id: the score of a removed or rewritten checkpoint, e.g. the branch a rollback replaced,
    is ignored). Scores are compared only under one scoring (sentences and options): of the
    scorings found, the one that covers the most of these checkpoints (a tie: the one written
    last), so a one-off run with other options never outranks the companion's own rows."""
    groups: dict[str, dict[int, float]] = {}
    written: dict[str, int] = {}
    for i, row in enumerate(read_rows(save_dir, name=BLEU_FILE)):
        key = bleu_row_key(row)
        step, value = row["step"], row.get("valid_bleu")
        if key is None or not isinstance(step, int) or not _finite(value):
            continue
        checkpoint, scoring = key
        if row["scoring"]["split"] != VALIDATION_SPLIT or checkpoint_ids.get(step) != checkpoint:
            continue
        groups.setdefault(scoring, {})[step] = float(value)
        written[scoring] = i
    if not groups:
        return {}
    return groups[max(groups, key=lambda k: (len(groups[k]), written[k]))]


def append_bleu_row(save_dir: str | Path, row: dict[str, Any]) -> None:
    """Append one scored checkpoint's row to ``save_dir/valid_bleu.jsonl`` (the companion,
    its one writer); a row is written in one call, so a kill leaves at most a cut last line,
    which :func:`read_rows` skips (and the next row starts on a line of its own)."""
    if not isinstance(row.get("step"), int):
        raise ValueError(f"a {BLEU_FILE} row needs an int step, got {row.get('step')!r}")
    with open(metrics_path(save_dir, BLEU_FILE), "ab+") as fh:
        write_row(fh, row)


# ---- best.json -------------------------------------------------------------------------------


def write_best(
    save_dir: str | Path,
    metric: str,
    best: list[tuple[str, float]],
    checkpoint_ids: Mapping[str, str] | None = None,
) -> None:
    """``save_dir/best.json``: the checkpoints kept for their ``metric``, best first, each
    with its ``checkpoint_id`` when ``checkpoint_ids`` ({tag: id}) names it, so a reader can
    tell a tag rewritten since (written to a temporary name and renamed)."""
    ids = checkpoint_ids or {}
    entries = []
    for tag, value in best:
        entry: dict[str, Any] = {"tag": tag, metric: value}
        if tag in ids:
            entry["checkpoint_id"] = ids[tag]
        entries.append(entry)
    write_json_atomic(
        Path(save_dir) / BEST_FILE, {"metric": metric, "checkpoints": entries}, indent=1
    )


def _best_entries(save_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(save_dir) / BEST_FILE
    data = read_json_object(
        path,
        MetricsFileError,
        missing="missing (the run did not track its best checkpoints: train.keep_best)",
    )
    entries = data.get("checkpoints")
    if not isinstance(entries, list) or not all(
        isinstance(c, dict) and isinstance(c.get("tag"), str) for c in entries
    ):
        raise MetricsFileError(f"{path}: expected {{'checkpoints': [{{'tag': ...}}, ...]}}")
    return entries


def read_best(save_dir: str | Path) -> list[str]:
    """The tags ``save_dir/best.json`` names, best first; MetricsFileError naming the file
    when it is missing or not of the form :func:`write_best` writes."""
    return [c["tag"] for c in _best_entries(save_dir)]


def read_best_ids(save_dir: str | Path) -> dict[str, str]:
    """{tag: checkpoint id} of the entries of ``save_dir/best.json`` that record one (an
    older best.json records none); errors as :func:`read_best`."""
    return {
        c["tag"]: c["checkpoint_id"]
        for c in _best_entries(save_dir)
        if isinstance(c.get("checkpoint_id"), str)
    }
