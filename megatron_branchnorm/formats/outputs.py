"""How every tool writes its outputs, so that an output never eats an input and nothing
half-written looks complete.

- :func:`refuse_overlap` refuses an output path that is, contains or lies inside an input.
- Output directories carry a marker file (:data:`MARKER`) naming the tool that wrote them
  and their kind; ``--overwrite`` removes a directory only when :func:`check_overwritable`
  finds it of the same kind holding only what that kind owns (:func:`prepare_output`), never a
  directory a user made or another tool wrote. ``formats/dirs.py`` owns the kinds, their
  layouts and how each is recognised.
- A side output (a file beside the main work: ``--stats``, a plot, a translation, a report;
  evaluate's ``--hyp-dir``) never goes inside a directory of a known kind and never replaces
  a file or directory it cannot recognise as its own without ``--overwrite``
  (:func:`check_output_file` with a recogniser, :func:`prepare_side_dir`); every front door
  declares such options in ``commands.OUTPUT_OPTIONS``, and
  tests/faults/test_output_placement.py runs each against a run's files and a user's file.
- A scratch directory a tool fills and reuses (a workdir of runs and logs, a cache) is new,
  empty, or holds only that tool's own entries (:func:`check_scratch_dir`); a tool's own
  earlier JSON report is recognised by its shape (:func:`read_report`).
- Writers publish by renaming a finished temporary file or directory
  (:func:`temp_dir_beside`, :func:`publish_dir`, :func:`write_text_output`); a temporary
  directory is marked with its owner (formats/owners.py), so a rerun removes only the dead
  ones (:func:`remove_dead_temp_dirs`).

The entry points (cli.py) turn the errors raised here into one line and exit 2.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable, Iterable
from fnmatch import fnmatchcase
from pathlib import Path
from typing import BinaryIO

from megatron_branchnorm.errors import UserError
from megatron_branchnorm.formats import dirs, owners
from megatron_branchnorm.formats.files import one_line, read_small_file


def describe_os_error(exc: OSError) -> str:
    """``PATH: reason`` for an OSError (full disk, missing file, permission...)."""
    reason = exc.strerror or str(exc)
    if exc.errno == errno.ENOSPC:
        reason = "no space left on device"
    name = exc.filename if exc.filename is not None else None
    if name is not None and getattr(exc, "filename2", None):
        name = f"{exc.filename} -> {exc.filename2}"
    return f"{name}: {reason}" if name is not None else one_line(str(exc))


class OutputError(UserError, ValueError):
    """An output path that would overwrite an input or a directory we did not write."""


def _resolved(path: str | Path) -> Path:
    return Path(path).expanduser().resolve()


def refuse_overlap(
    output: str | Path, inputs: Iterable[tuple[str, str | Path | None]], output_flag: str
) -> None:
    """Refuse an ``output`` that is one of ``inputs`` (``(flag, path)`` pairs), lies inside
    one, or contains one: writing or replacing it would destroy that input."""
    out = _resolved(output)
    for flag, path in inputs:
        if path is None:
            continue
        inp = _resolved(path)
        if out == inp:
            raise OutputError(f"{output_flag} {output}: is the same path as {flag} {path}")
        if inp in out.parents:
            raise OutputError(f"{output_flag} {output}: lies inside {flag} {path}")
        if out in inp.parents:
            raise OutputError(f"{output_flag} {output}: contains {flag} {path}")


read_marker = dirs.read_marker
json_has_format = dirs.json_has_format
write_marker = dirs.write_marker
MARKER = dirs.MARKER
"""Marker file in every directory an entry point creates: {"tool": ..., "kind": ...}
(formats/dirs.py owns it, with the kinds of directory and what each owns)."""


def check_overwritable(
    output: str | Path,
    kind: str,
    output_flag: str,
    legacy: Callable[[Path], bool] | None = None,
) -> bool:
    """Whether ``output`` exists and must be replaced; raises :class:`OutputError` when it
    exists, is not empty and is not a directory of ``kind`` written by us holding only what
    ``kind`` owns (:func:`megatron_branchnorm.formats.dirs.check_replaceable`)."""
    try:
        return dirs.check_replaceable(output, kind, output_flag, legacy)
    except dirs.DirectoryError as exc:
        raise OutputError(str(exc)) from None


def prepare_output(
    output: str | Path,
    kind: str,
    overwrite: bool,
    output_flag: str,
    inputs: Iterable[tuple[str, str | Path | None]] = (),
    legacy: Callable[[Path], bool] | None = None,
) -> bool:
    """Check an output directory before anything is written: not overlapping an input, not
    under a regular file, and either absent/empty or (with ``overwrite``) written by us as
    ``kind`` (its marker, or recognised by formats/dirs.py or ``legacy`` as an older output of
    ours) and holding only ``kind``'s entries (anything else is named, never deleted).
    Never inside a directory of a known kind but a workflow's that holds other tools'
    outputs (:func:`refuse_inside_kind`). Returns whether an existing directory will be
    replaced; the caller replaces it only after its new contents are complete
    (:func:`publish_dir`)."""
    inputs = list(inputs)
    refuse_overlap(output, inputs, output_flag)
    check_parent_dir(output, output_flag)
    refuse_inside_kind(output, output_flag, dirs.describe(kind), workflows_too=False)
    out = Path(output)
    if out.exists() and out.is_dir() and any(out.iterdir()) and not overwrite:
        raise OutputError(
            f"{output_flag} {output}: exists and is not empty (pass --overwrite to replace an "
            f"earlier {kind})"
        )
    return check_overwritable(out, kind, output_flag, legacy)


def claim_output_dir(
    out: str | Path,
    tool: str,
    kind: str,
    parts: Iterable[str],
    legacy: str | tuple[str, ...],
    flag: str = "--out",
) -> Path:
    """For a tool that replaces its own ``parts`` (sub-directories and files) of ``out`` on
    every run: ``out`` must be new, empty, or written by this tool before: its marker of
    ``kind``, or, for outputs older than markers, an entry of ``legacy`` that only this tool
    writes there (never a generic part such as ``data``: a user's home has one). It is then
    created and marked. An :class:`OutputError` otherwise (and inside a directory of a known
    kind, :func:`refuse_inside_kind`): a user's directory is never cleared."""
    out = Path(out)
    refuse_inside_kind(out, flag, dirs.describe(kind), workflows_too=False)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        legacy = (legacy,) if isinstance(legacy, str) else legacy
        found = dirs.recognise(out) if out.is_dir() else None
        if found is None:
            ours = any((out / f).exists() for f in legacy)
        else:
            ours = found[0] == kind
        if not out.is_dir() or not ours:
            what = f"it is {dirs.describe(found[0])} ({found[1]})" if found else f"no {MARKER}"
            raise OutputError(
                f"{flag} {out}: exists and was not written by {tool} ({what}); it "
                f"replaces {', '.join(parts)} inside it: choose a new or empty {flag}"
            )
    out.mkdir(parents=True, exist_ok=True)
    write_marker(out, tool, kind)
    return out


def _temp_prefix(out: Path) -> str:
    """The start of the name of every temporary beside ``out`` (``.NAME.tmp-``)."""
    return f".{out.name}.tmp-"


def make_temp_dir(out: Path, tool: str) -> Path:
    """A new hidden temporary directory beside ``out`` (``.NAME.tmp-PID-XXXX``) carrying
    :data:`dirs.TEMP_MARKER`: this process as its owner, ``out``'s name and ``tool``. Nothing
    already there is touched."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_temp_prefix(out)}{os.getpid()}-", dir=out.parent))
    try:
        dirs.write_temp_marker(tmp, tool, out.name, owners.owner_record())
    except BaseException:  # a full disk, Ctrl-C: nothing of ours stays behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def remove_dead_temp_dirs(out: Path) -> list[str]:
    """Remove the temporary directories beside ``out`` that runs writing ``out`` left when
    they died: only directories carrying :data:`dirs.TEMP_MARKER` for ``out`` whose owner was
    a process of this host that no longer runs (or whose pid now belongs to another process).
    A live run's, another host's and anything without the marker stay. Returns one line per
    directory removed: its name, size and why."""
    me = owners.owner_record()
    prefix = _temp_prefix(out)
    try:
        found = sorted(p for p in out.parent.iterdir() if p.name.startswith(prefix))
    except OSError:
        return []
    removed = []
    for tmp in found:
        if tmp.is_symlink() or not tmp.is_dir():
            continue
        info = dirs.read_temp_marker(tmp)
        owner = info.get("owner") if info is not None and info.get("output") == out.name else None
        if not isinstance(owner, dict) or owner.get("host") != me["host"]:
            continue
        holder = {key: owner.get(key) for key in ("host", "pid", "pid_start")}
        if (holder["pid"], holder["pid_start"]) == (me["pid"], me["pid_start"]):
            continue  # this process's own: in use
        reason = owners.stale_reason(holder, 0.0, me)
        if reason is None:
            continue
        size = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file() and not f.is_symlink())
        shutil.rmtree(tmp)
        removed.append(f"{tmp.name} ({size / 1e6:.1f} MB; {reason})")
    return removed


def temp_dir_beside(out: Path, tool: str) -> Path:
    """A fresh temporary directory next to ``out`` (same file system, so the final rename is
    atomic) for ``tool`` to write ``out`` into (:func:`make_temp_dir`: marked as this
    process's, nothing already there touched). The temporary directories that dead runs of
    ``out`` left are removed first, said in one line on stderr (:func:`remove_dead_temp_dirs`:
    never a live run's or an unmarked one). An OSError if it cannot be made; :func:`publish_dir`
    removes the mark."""
    removed = remove_dead_temp_dirs(out)
    if removed:
        print(f"removed what dead runs of {out} left: {', '.join(removed)}", file=sys.stderr)
    return make_temp_dir(out, tool)


def open_temp_file_beside(out: Path) -> tuple[Path, BinaryIO]:
    """A new file next to ``out`` (``.NAME.tmp-PID-XXXXXXXX``), open for binary writing:
    created exclusively with the usual permissions, so nothing already at a name (a user's
    file, a link) is opened, followed or replaced."""
    out.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    while True:
        tmp = out.parent / f"{_temp_prefix(out)}{os.getpid()}-{secrets.token_hex(4)}"
        try:
            fd = os.open(tmp, flags, 0o666)
        except FileExistsError:
            continue
        return tmp, os.fdopen(fd, "wb")


def publish_dir(tmp: Path, out: Path) -> None:
    """Rename the finished temporary directory ``tmp`` (its :data:`dirs.TEMP_MARKER` removed)
    to ``out``; an existing ``out`` (checked by :func:`prepare_output`) is moved aside to a
    new name first and removed only once the new one is in place."""
    (tmp / dirs.TEMP_MARKER).unlink(missing_ok=True)
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-{os.getpid()}-", dir=out.parent))
        try:
            os.replace(out, old)  # onto the new empty directory: nothing else is replaced
        except BaseException:
            old.rmdir()
            raise
    try:
        os.replace(tmp, out)
    except BaseException:
        if old is not None:
            os.replace(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_failure_reason(exc: BaseException) -> str:
    """Why writing an output failed, in a few words (a full disk said plainly, whether it came
    as an OSError or as a library's message)."""
    if isinstance(exc, OSError):
        if exc.errno == errno.ENOSPC:
            return "no space left on device"
        return exc.strerror or one_line(str(exc), 300)
    reason = one_line(str(exc), 300)
    if "No space left" in reason or "os error 28" in reason:
        return "no space left on device"
    return reason


def is_same_file(a: str | Path, b: str | Path) -> bool:
    """Whether two paths name the same existing file (links included)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_output_file(
    path: str | Path,
    flag: str,
    inputs: Iterable[tuple[str, str | Path | None]],
    ours: Callable[[Path], bool] | None = None,
    described: str = "a file this tool wrote",
    overwrite: bool | None = None,
) -> None:
    """Refuse, before any work, an output file that would destroy an input (the same path or
    file, inside an input directory, or containing one), is a directory, or lies under a
    regular file. Missing parent directories are created when the output is written.

    With ``ours`` (recognises a file this tool wrote, ``described`` in messages), the file
    is a side output such as ``--stats``, never another tool's, so also refused: a path
    inside a directory of a known kind (a run, a DATA_DIR, an export: formats/dirs.py), an
    existing regular file that ``ours`` does not recognise, and a directory where it cannot
    be written now. An existing device or FIFO is allowed (written in place). ``overwrite``
    is the tool's ``--overwrite``: True lets it replace an existing file ``ours`` does not
    recognise (never one inside a directory of a known kind); False says to pass it; None: the
    tool has none for this output, such a file is never replaced."""
    inputs = list(inputs)
    refuse_overlap(path, inputs, flag)
    for in_flag, inp in inputs:
        if inp is not None and is_same_file(path, inp):
            raise OutputError(f"{flag} {path}: is the same file as {in_flag} {inp}")
    if Path(path).is_dir():
        raise OutputError(f"{flag} {path}: is a directory (a file is expected)")
    check_parent_dir(path, flag)
    if ours is not None:
        _check_side_output(Path(path), flag, ours, described, overwrite)


def _check_side_output(
    path: Path, flag: str, ours: Callable[[Path], bool], described: str, overwrite: bool | None
) -> None:
    """:func:`check_output_file`'s rules for a side output recognised by ``ours``."""
    if path.exists() and not path.is_file():  # a device or FIFO, written in place
        if not os.access(path, os.W_OK):
            raise OutputError(f"{flag} {path}: cannot write (permission denied)")
        return
    real = Path(os.path.realpath(path))
    refuse_inside_kind(path, flag, described)
    if real.is_file() and not overwrite and not ours(real):
        advice = (
            "it is never replaced: choose a new path or remove it yourself"
            if overwrite is None
            else "choose a new path or pass --overwrite to replace it"
        )
        raise OutputError(f"{flag} {path}: exists and is not {described}; {advice}")
    parent = real.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=f".{real.name}.write-probe-") as f:
            f.write(b"x")
            f.flush()
    except OSError as exc:
        raise OutputError(f"{flag} {path}: cannot write ({write_failure_reason(exc)})") from None


def refuse_inside_kind(
    path: str | Path, flag: str, described: str, workflows_too: bool = True
) -> None:
    """Refuse an output ``path`` (``described`` in the message) that lies inside a directory
    of a known kind (a run, a checkpoint's tag in it, a DATA_DIR, an export...:
    :func:`dirs.enclosing_kind`, links followed): that directory's files are its tool's.
    Without ``workflows_too``, one inside a workflow's directory that holds other tools'
    outputs (:func:`dirs.holds_outputs`: a demo's ``data``, ``export``...) is allowed."""
    found = dirs.enclosing_kind(Path(os.path.realpath(path)))
    if found is not None and (workflows_too or not dirs.holds_outputs(found[1])):
        where, kind, evidence = found
        raise OutputError(
            f"{flag} {path}: lies inside {where}, which is {dirs.describe(kind)} (by its "
            f"{evidence}); {described} never goes there: choose another path"
        )


def prepare_side_dir(
    path: str | Path,
    kind: str,
    flag: str,
    inputs: Iterable[tuple[str, str | Path | None]],
    overwrite: bool,
    legacy: Callable[[Path], bool] | None = None,
) -> bool:
    """Check, before any work, a directory that a tool fills as a side output (evaluate's
    ``--hyp-dir``) and replaces whole once complete (:func:`publish_dir`): not over, inside
    or around an input, not under a regular file, not inside a directory of a known kind, and
    absent, empty, or of ``kind`` by its marker holding only ``kind``'s entries (ours:
    replaced without ``overwrite``). One that ``legacy`` recognises as ours from before
    markers is replaced only with ``overwrite``; any other directory is refused, never
    cleared. Returns whether an existing directory will be replaced."""
    refuse_overlap(path, inputs, flag)
    check_parent_dir(path, flag)
    out = Path(path)
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise OutputError(f"{flag} {path}: exists and is not a directory")
    described = dirs.describe(kind)
    refuse_inside_kind(path, flag, described)
    if not out.exists() or not any(out.iterdir()):
        return out.exists()
    if dirs.recognise(out) is None:
        if legacy is None or not legacy(out):
            raise OutputError(
                f"{flag} {path}: exists, is not empty and is not {described} (no {MARKER}); "
                "it is never cleared: choose a new or empty directory"
            )
        if not overwrite:
            raise OutputError(
                f"{flag} {path}: looks like {described} from before {MARKER}; pass "
                "--overwrite to replace it, or choose a new or empty directory"
            )
    return check_overwritable(out, kind, flag, legacy)


def check_parent_dir(path: str | Path, flag: str) -> None:
    """Refuse an output whose nearest existing ancestor is not a directory (a regular file
    in the way: the output could never be created)."""
    parent = Path(path).parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise OutputError(f"{flag} {path}: {parent} is not a directory")


def write_text_output(path: str | Path, text: str) -> None:
    """Write ``text`` to the file ``path`` through a temporary file renamed when complete, so
    an error or Ctrl-C never leaves a truncated output. An existing non-regular file
    (/dev/null, /dev/full, a FIFO) is written in place, never replaced. An OSError names
    ``path`` (not the temporary file)."""
    out = Path(path)
    data = text.encode("utf-8")
    if out.exists() and not out.is_file():
        try:
            with open(out, "wb") as f:
                f.write(data)
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, str(out)) from None
        return
    tmp = None
    try:
        tmp, f = open_temp_file_beside(out)
        with f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except OSError as exc:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        raise OSError(exc.errno, exc.strerror, str(out)) from None
    except BaseException:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        raise


def write_stdout(text: str) -> None:
    """Write ``text`` to stdout and flush; a failure (a full disk, a closed pipe) raises an
    OSError naming <stdout>, and stdout is pointed at /dev/null so that Python's own flush at
    exit does not print a second error."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except OSError as exc:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass
        raise OSError(exc.errno, exc.strerror, "<stdout>") from None


def stdin_is(path: str | Path) -> bool:
    """Whether stdin is redirected from the regular file ``path`` (``tool --output f < f``)."""
    try:
        st = os.fstat(sys.stdin.fileno())
        return stat.S_ISREG(st.st_mode) and os.path.samestat(st, os.stat(path))
    except (OSError, ValueError, AttributeError):
        return False


MAX_REPORT_BYTES = 64 << 20
"""Largest file :func:`read_report` reads (a tool's JSON report is far smaller)."""


def read_report(path: str | Path) -> object | None:
    """The JSON value in the regular file ``path``, or None when it holds none (unreadable,
    not JSON, larger than :data:`MAX_REPORT_BYTES`, a device or FIFO): what a tool's
    recogniser of its own earlier report looks at."""
    try:
        return json.loads(read_small_file(path, MAX_REPORT_BYTES))
    except (OSError, ValueError):  # FileShapeError too
        return None


def check_scratch_dir(
    path: str | Path,
    flag: str,
    tool: str,
    owned: Iterable[str],
    inputs: Iterable[tuple[str, str | Path | None]] = (),
) -> None:
    """Check, before any work, a directory that ``tool`` fills and reuses from run to run (a
    workdir of logs and runs, a cache): not over, inside or around an input, not a file nor
    under one, not inside a directory of a known kind, and absent, empty, or holding only the
    entries ``tool`` writes there (``owned``: glob patterns of top-level names), that is an
    earlier one of its own (no ``owned``: absent or empty only). Anything else (a user's folder, a run, a DATA_DIR) is an
    :class:`OutputError` naming what is not the tool's: it is never written into."""
    refuse_overlap(path, inputs, flag)
    check_parent_dir(path, flag)
    out = Path(path)
    if (out.is_symlink() and not out.exists()) or (out.exists() and not out.is_dir()):
        raise OutputError(f"{flag} {path}: exists and is not a directory")
    refuse_inside_kind(path, flag, f"{tool}'s {flag}")
    if not out.exists():
        return
    patterns = tuple(owned)
    found = dirs.recognise(out)
    foreign = [p.name for p in out.iterdir() if not any(fnmatchcase(p.name, g) for g in patterns)]
    if found is not None or foreign:
        if found is not None:
            what = f"it is {dirs.describe(found[0])} ({found[1]})"
        elif patterns:
            what = f"it holds {dirs.name_entries(sorted(foreign))}, which {tool} does not write"
        else:
            what = f"it is not empty ({dirs.name_entries(sorted(foreign))})"
        raise OutputError(
            f"{flag} {path}: {what}; {tool} creates its files there and never writes into "
            f"another's directory: choose a new or empty {flag}"
        )


def check_workdir_and_report(
    tool: str, workdir: str | None, report: str | None, is_ours: Callable[[Path], bool]
) -> None:
    """Before a check tool runs: its ``--workdir`` new or empty (its runs are created there,
    never over anything; :func:`check_scratch_dir`), its ``--json`` report never inside a
    directory of a known kind, and an existing file replaced only when ``is_ours`` recognises
    it as a report of ``tool`` (:func:`check_output_file`; its own workdir may hold it)."""
    if workdir is not None:
        check_scratch_dir(workdir, "--workdir", tool, ())
    if report is not None:
        check_output_file(report, "--json", [], is_ours, f"a report of {tool} --json")
