"""Where the data tools write: an output directory (a DATA_DIR, a corpus) checked before any
work and staged in a hidden temporary directory that replaces it at the very end, and
preprocessing's ``--stats`` file (docs/design.md §6.6).

The rules themselves are formats/outputs.py's (:func:`outputs.prepare_output`,
:func:`outputs.check_output_file`, :func:`outputs.temp_dir_beside`, :func:`outputs.publish_dir`);
this module applies them for data/preprocess.py, data/locale_corpus.py and
data/synthetic_corpus.py and turns their errors into the data tools' DataError, naming the
output rather than the temporary directory. An interrupted tool never leaves a directory that
looks complete, nor its temporary directory.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from megatron_branchnorm.formats.data_dir import FORMAT as MANIFEST_FORMAT
from megatron_branchnorm.formats.data_dir import MANIFEST, DataError
from megatron_branchnorm.formats.files import read_small_file
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

STATS_KEYS = frozenset({"phases", "total_seconds", "peak_rss_mb"})
"""The keys of a ``--stats`` file (:meth:`PhaseStats.summary`): how one of ours is recognised."""
MAX_STATS_BYTES = 1 << 20


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
        check_output_dir(out, kind, overwrite, inputs, legacy)
        publish_dir(tmp, out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_failure(exc, out) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
