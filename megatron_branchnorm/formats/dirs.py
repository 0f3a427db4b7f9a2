"""The kinds of directory this project writes, how each is recognised and what each owns.

Every directory a tool creates carries a marker file, :data:`MARKER`, ``{"tool": ..., "kind":
...}``. A kind (:data:`KINDS`) names the entries (file and folder names, glob patterns) of the
top level of such a directory that are its own: a tool that replaces a directory of its kind
(``--overwrite``) deletes all of it, so it may do so only when nothing else is inside
(:func:`check_replaceable`); anything else is refused with the paths named. Outputs written
before markers existed are recognised by a file only we write there (:func:`identify`): a
DATA_DIR by its ``manifest.json``'s ``format``, an export by its ``export.json``'s, a run by
``latest``, a complete ``global_stepN`` or the rows of its ``metrics.jsonl``, a rehearsal by
``runs.json``.

A run directory (``train.save_dir``) is never replaced by a tool; the trainer starts only in a
new or empty directory or in a run of its own (:func:`check_run_dir`), and rank 0 marks it
(:func:`mark_run_dir`) together with taking its lock.

docs/reliability.md ("Directory kinds") lists the kinds and what each ``--overwrite`` may
delete; tests/faults/test_directory_kinds.py checks that every file name the tools write into a
kind of directory is one of its entries here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

from megatron_branchnorm.errors import UserError
from megatron_branchnorm.formats.files import FileShapeError, open_regular, read_small_file

MARKER = ".megatron_branchnorm-output.json"
"""Marker file in every directory an entry point creates: {"tool": ..., "kind": ...}."""
MAX_MARKER_BYTES = 64 << 10
"""Largest marker read (ours are under 1 KB)."""
TEMP_MARKER = ".megatron_branchnorm-partial.json"
"""Marker file in a tool's hidden temporary directory while it writes there: {"tool": ...,
"output": the name of the directory it will become, "owner": the writing process
(run_lock.owner_record)}. Removed just before the directory is published."""
MAX_NAMED = 8
"""How many entries an error names before it says how many more."""


class DirectoryError(UserError, ValueError):
    """A directory of another kind, or holding entries its kind does not own: one line naming
    the path and the entries."""


@dataclass(frozen=True)
class Kind:
    """One kind of directory: its marker's ``kind``, the tool that writes it, a description
    for messages, the top-level entries (glob patterns) it owns, and whether its tool puts
    other tools' output directories inside it (a workflow's ``data``, ``export``...; any other
    tool's directory output never goes inside one of this kind)."""

    name: str
    tool: str
    described: str
    entries: tuple[str, ...]
    holds_outputs: bool = False

    def owns(self, name: str) -> bool:
        return name == MARKER or any(fnmatchcase(name, pattern) for pattern in self.entries)


RUN_LOCK = "run.lock"
"""A run's lock (run_lock.LOCK_NAME)."""
RUN_LOGS = ("*.log",)
"""Logs a launcher keeps beside a run (benchmark's ``rankN.log``, ``launcher.log``)."""
RUN_BEFORE_START = (*RUN_LOGS, ".valid_bleu.lock", ".write-probe-*", RUN_LOCK)
"""What may be in a run directory before the trainer's first start: launchers' logs, the lock
of the BLEU companion started beside it (slurm/watch_bleu.sh), another rank's write probe, a
lock left by a start killed at once. The trainer never writes over them, so a directory
holding only them is a new run."""
RUN = Kind(
    "run",
    "train",
    "a run directory (train.save_dir)",
    (
        "latest",  # formats.checkpoint.LATEST
        "global_step*",  # formats.checkpoint.TAG_PREFIX: one checkpoint each
        "config.yaml",  # the config of the latest start (training/checkpointer.py)
        "config_history.jsonl",  # resume_policy.HISTORY
        "metrics.jsonl",  # formats.records.METRICS_FILE
        "valid_bleu.jsonl",  # formats.records.BLEU_FILE (the BLEU companion)
        "best.json",  # formats.records.BEST_FILE (retention)
        "sampling.tsv",  # data.sampling.SAMPLING_FILE
        "tensorboard",  # training/metrics.py, inference/valid_bleu.py
        RUN_LOCK,
        ".valid_bleu.lock",  # commands/watch_bleu.py: the companion's lock
        "zero_to_fp32.py",  # DeepSpeed's recovery scripts (ZeRO)
        "zero_to_torch.py",
        ".removing-*",  # retention.REMOVING_PREFIX: a checkpoint being deleted
        ".write-probe-*",  # training/checkpointer.check_writable
        ".*.tmp",  # write_json_atomic, write_latest: a file being replaced
        ".*.tmp-*",
        *RUN_LOGS,
    ),
)
DATA = Kind(
    "data",
    "preprocess_data",
    "a DATA_DIR written by preprocess",
    ("manifest.json", "spm.model", "spm.vocab", "bin", "raw", "spill"),
)
EXPORT = Kind(
    "export",
    "convert_checkpoint",
    "an export written by convert",
    ("model.safetensors", "config.yaml", "spm.model", "export.json"),
)
HF_EXPORT = Kind(
    "hf_export",
    "convert_checkpoint",
    "a Hugging Face export written by convert --format hf",
    (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "model-*.safetensors",
        "model.safetensors.index.json",
        "pytorch_model*.bin",
        "source.spm",
        "target.spm",
        "vocab.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
    ),
)
CT2_EXPORT = Kind(
    "ct2_export",
    "convert_checkpoint",
    "a CTranslate2 export written by convert --format ctranslate2",
    ("model.bin", "config.json", "*vocabulary.json", "spm.model", "export.json"),
)
CORPUS = Kind(
    "corpus",
    "build_locale_corpus",
    "a corpus written by build_locale_corpus or the synthetic corpus",
    ("opus-100-corpus", "locale_corpus.json", "supervised", "synthetic_corpus.json"),
)
REHEARSAL = Kind(
    "rehearsal",
    "rehearse",
    "a rehearsal's workdir",
    ("runs.json", "logs", "uninterrupted", "interrupted", "reference", "spm", "export"),
    holds_outputs=True,
)
DEMO = Kind(
    "demo",
    "run_demo",
    "a demo's output",
    ("report.md", "corpus", "data", "train", "export", "eval", "logs", "plots"),
    holds_outputs=True,
)
SIDE_BY_SIDE = Kind(
    "side_by_side",
    "fairseq_side_by_side",
    "a fairseq side-by-side output",
    ("fairseq", "corpus", "data", "logs", "side_by_side.json", "report.md"),
    holds_outputs=True,
)
DEPTH_STUDY = Kind(
    "depth_study",
    "depth_study",
    "a depth study's output",
    ("cells", "corpus", "data", "table.md"),
    holds_outputs=True,
)
FAULT_SWEEP = Kind(
    "fault_sweep",
    "fault_sweep",
    "a fault sweep's output",
    ("reference", "kill_points", "corruption", "soak", "hang", "*.json"),
    holds_outputs=True,
)
HYPOTHESES = Kind(
    "hypotheses",
    "evaluate",
    "a hypothesis directory written by evaluate --hyp-dir",
    ("*.txt",),  # inference/evaluate.hypothesis_path: <src>-<tgt>.txt
)
KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        RUN,
        DATA,
        EXPORT,
        HF_EXPORT,
        CT2_EXPORT,
        CORPUS,
        REHEARSAL,
        DEMO,
        SIDE_BY_SIDE,
        DEPTH_STUDY,
        FAULT_SWEEP,
        HYPOTHESES,
    )
}
"""Every kind, by its marker name."""

EXPORT_META = "export.json"
EXPORT_FORMAT = "megatron_branchnorm-export"
"""``format`` of an export's export.json (inference/export.py)."""
REHEARSAL_RUNS = "runs.json"


# --------------------------------------------------------------------------------------------
# The marker
# --------------------------------------------------------------------------------------------


def read_marker(directory: str | Path) -> dict | None:
    """The marker of a directory an entry point wrote, or None (none, unreadable, not a JSON
    object). A marker that is not a small regular file (a link, a device, a FIFO, over
    :data:`MAX_MARKER_BYTES`) was not written by us: a :class:`DirectoryError` naming it."""
    path = Path(directory) / MARKER
    try:
        data = json.loads(read_small_file(path, MAX_MARKER_BYTES, follow_symlinks=False))
    except FileShapeError as exc:
        raise DirectoryError(f"{exc}: not a marker this project wrote") from None
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_marker(directory: str | Path, tool: str, kind: str) -> None:
    """Mark ``directory`` as written by ``tool`` (its contents are of ``kind``)."""
    path = Path(directory) / MARKER
    path.write_text(json.dumps({"tool": tool, "kind": kind}) + "\n", encoding="utf-8")


def write_temp_marker(directory: str | Path, tool: str, output: str, owner: dict) -> None:
    """Mark the temporary directory ``directory`` as ``tool``'s, becoming ``output`` (a name
    beside it), written by the process ``owner`` describes."""
    path = Path(directory) / TEMP_MARKER
    record = {"tool": tool, "output": output, "owner": owner}
    path.write_text(json.dumps(record) + "\n", encoding="utf-8")


def read_temp_marker(directory: str | Path) -> dict | None:
    """The :data:`TEMP_MARKER` of a temporary directory, or None (none, or not a small JSON
    object in a regular file: not one of ours)."""
    try:
        data = json.loads(
            read_small_file(Path(directory) / TEMP_MARKER, MAX_MARKER_BYTES, follow_symlinks=False)
        )
    except (OSError, ValueError):  # FileShapeError too
        return None
    return data if isinstance(data, dict) else None


def json_has_format(path: str | Path, fmt: str, max_bytes: int) -> bool:
    """Whether ``path`` is a JSON object of at most ``max_bytes`` whose ``format`` is ``fmt``:
    how an output written before markers existed is recognised as ours."""
    try:
        data = json.loads(read_small_file(path, max_bytes))
    except (OSError, ValueError):  # FileShapeError too: a device or FIFO is not ours
        return False
    return isinstance(data, dict) and data.get("format") == fmt


# --------------------------------------------------------------------------------------------
# Recognition
# --------------------------------------------------------------------------------------------

_TAG = re.compile(r"^global_step[0-9]+$")


def _legacy_run(path: Path) -> str | None:
    """The file that shows ``path`` to be a run of ours written before markers, or None:
    ``latest`` naming a ``global_stepN``, a ``global_stepN`` with our checksums or training
    config, or a ``metrics.jsonl`` whose first row is a JSON object with a ``step``."""
    try:
        if _TAG.match(read_small_file(path / "latest", 256).decode("utf-8").strip()):
            return "latest"
    except (OSError, ValueError):  # FileShapeError too: not a file of ours
        pass
    try:
        tags = [p for p in path.iterdir() if _TAG.match(p.name) and p.is_dir()]
    except OSError:
        tags = []
    for tag in tags:
        for name in ("checksums.json", "train_config.json"):
            if (tag / name).is_file():
                return f"{tag.name}/{name}"
    try:
        with open_regular(path / "metrics.jsonl") as fh:  # a FIFO would block open()
            row = json.loads(fh.readline(1 << 16).decode("utf-8", errors="replace"))
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            return "metrics.jsonl"
    except (OSError, ValueError):
        pass
    return None


def _legacy_data(path: Path) -> str | None:
    from megatron_branchnorm.formats.data_dir import FORMAT, MANIFEST

    return MANIFEST if json_has_format(path / MANIFEST, FORMAT, 64 << 20) else None


def _legacy_export(path: Path) -> str | None:
    return EXPORT_META if json_has_format(path / EXPORT_META, EXPORT_FORMAT, 1 << 20) else None


def _legacy_rehearsal(path: Path) -> str | None:
    return REHEARSAL_RUNS if (path / REHEARSAL_RUNS).is_file() else None


LEGACY: dict[str, Callable[[Path], str | None]] = {
    "data": _legacy_data,
    "export": _legacy_export,
    "rehearsal": _legacy_rehearsal,
    "run": _legacy_run,
}
"""How an output of each kind written before markers existed is recognised: the file that
shows it, or None. The other kinds always had their marker (or their tool passes its own
legacy names to cli.claim_output_dir)."""


def recognise(path: str | Path) -> tuple[str, str] | None:
    """``(kind, evidence)`` of a directory: its marker's kind (evidence :data:`MARKER`), or a
    kind recognised by a file only we write (evidence: that file), or None."""
    path = Path(path)
    marker = read_marker(path)
    if marker is not None and isinstance(marker.get("kind"), str):
        return marker["kind"], MARKER
    for kind, found in LEGACY.items():
        evidence = found(path)
        if evidence is not None:
            return kind, evidence
    return None


def enclosing_kind(path: str | Path) -> tuple[Path, str, str] | None:
    """``(directory, kind, evidence)`` of the nearest directory above ``path`` that
    :func:`recognise` knows (a file there belongs to that kind's tool), or None. Links are
    followed: it is where a write to ``path`` lands."""
    for parent in Path(path).resolve().parents:
        if parent.is_dir():
            found = recognise(parent)
            if found is not None:
                return parent, found[0], found[1]
    return None


def holds_outputs(kind: str) -> bool:
    """Whether a directory of ``kind`` may hold other tools' output directories (a workflow's
    or an experiment's own directory); False for an unknown kind."""
    known = KINDS.get(kind)
    return known is not None and known.holds_outputs


def identify(path: str | Path) -> str | None:
    """The kind of the directory ``path`` (see :func:`recognise`), or None."""
    found = recognise(path)
    return found[0] if found else None


def describe(kind: str) -> str:
    """A kind in words (``a DATA_DIR written by preprocess``)."""
    known = KINDS.get(kind)
    return known.described if known else f"a directory of kind {kind!r}"


def entries(path: str | Path) -> list[str]:
    """The names in the directory ``path``, sorted."""
    return sorted(p.name for p in Path(path).iterdir())


def foreign_entries(path: str | Path, kind: str) -> list[str]:
    """The entries of the directory ``path`` that ``kind`` does not own (all of them for a
    kind that is not in :data:`KINDS`), sorted."""
    known = KINDS.get(kind)
    return [n for n in entries(path) if known is None or not known.owns(n)]


def name_entries(names: Iterable[str]) -> str:
    """Up to :data:`MAX_NAMED` names as ``a, b, c and N more``."""
    names = list(names)
    shown = ", ".join(names[:MAX_NAMED])
    more = f" and {len(names) - MAX_NAMED} more" if len(names) > MAX_NAMED else ""
    return f"{shown}{more}"


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------


def check_replaceable(
    path: str | Path,
    kind: str,
    flag: str,
    legacy: Callable[[Path], bool] | None = None,
) -> bool:
    """Whether ``path`` exists and will be replaced (deleted whole) by a tool writing
    ``kind``. A :class:`DirectoryError` unless it is absent, empty, or a directory of
    ``kind`` (its marker, or recognised as an older one of ours; ``legacy`` adds a caller's
    own recognition) whose every entry ``kind`` owns."""
    out = Path(path)
    if not out.exists() and not out.is_symlink():
        return False
    if out.is_symlink() or not out.is_dir():
        raise DirectoryError(f"{flag} {path}: exists and is not a directory")
    if not any(out.iterdir()):
        return True
    found = recognise(out)
    if (found is None or found[0] != kind) and legacy is not None and read_marker(out) is None:
        if legacy(out):
            found = (kind, "an older output of ours")
    if found is None:
        raise DirectoryError(
            f"{flag} {path}: exists and was not written as {kind} by this project (has no "
            f"{MARKER}); --overwrite only replaces such a directory: remove it yourself or "
            "choose another path"
        )
    if found[0] != kind:
        raise DirectoryError(
            f"{flag} {path}: exists and was not written as {kind} by this project (it is "
            f"{describe(found[0])}: {found[0]!r}, by its {found[1]}); --overwrite only "
            f"replaces {describe(kind)}: choose another path"
        )
    foreign = foreign_entries(out, kind)
    if foreign:
        raise DirectoryError(
            f"{flag} {path}: is {describe(kind)} but also holds what {kind} never writes "
            f"({name_entries(foreign)}); --overwrite would delete them: move them out "
            "or choose another path"
        )
    return True


def check_run_dir(save_dir: str | Path, key: str = "train.save_dir") -> None:
    """Refuse, before anything is written, a ``save_dir`` that is neither new, nor empty, nor
    a run of ours (its marker, or a run recognised as ours from before markers, holding only
    a run's entries); a :class:`DirectoryError` naming the directory and what it holds. The
    same on every rank: nothing but a run's own entries is written there before all ranks
    have checked."""
    path = Path(save_dir)
    if not path.is_dir():
        return  # new; a file in the way is check_writable's one line
    names = [n for n in entries(path) if not any(fnmatchcase(n, p) for p in RUN_BEFORE_START)]
    if not names:
        return
    found = recognise(path)
    advice = (
        "a run starts only in a new or empty directory or resumes its own run: choose another "
        f"{key}"
    )
    if found is not None and found[0] != RUN.name:
        raise DirectoryError(
            f"{key} {save_dir}: is {describe(found[0])} (by its {found[1]}); {advice}"
        )
    if found is not None and found[1] == MARKER:
        return  # our own run: anything a user put beside it stays untouched
    foreign = foreign_entries(path, RUN.name)
    if found is None:  # nothing shows a run of ours: even a config.yaml may be the user's
        raise DirectoryError(
            f"{key} {save_dir}: holds files this project did not write "
            f"({name_entries(names)}); {advice}"
        )
    if foreign:
        raise DirectoryError(
            f"{key} {save_dir}: is a run from before {MARKER} ({found[1]}) but also holds "
            f"files this project did not write ({name_entries(foreign)}); move them out "
            f"or {advice.split(': ', 1)[1]}"
        )


def mark_run_dir(save_dir: str | Path) -> None:
    """Give a run directory its identity (rank 0, once it holds the run's lock): the marker of
    kind ``run``, unless it has one."""
    if read_marker(save_dir) is None:
        write_marker(save_dir, RUN.tool, RUN.name)
