"""What every entry point shares: one-line errors, Ctrl-C, and outputs that never eat inputs.

- :func:`run_main` runs a ``main(argv) -> int``: an expected error (the caller's exception
  types, and any ``OSError``: a missing file, a full disk, a file where a directory should
  be) becomes ``error: <one line>`` on stderr and exit 2; Ctrl-C becomes one line and exit 130.
  Writers publish by renaming a finished temporary file or directory, so an interrupt leaves
  nothing half-written that looks complete.
- :func:`quote` caps what an error message repeats of a user's value.
- :func:`refuse_overlap` refuses an output path that is, contains or lies inside an input.
- Output directories carry a marker file (:data:`MARKER`) naming the tool that wrote them;
  ``--overwrite`` removes a directory only when :func:`check_overwritable` finds that marker
  (:func:`prepare_output`), never a directory a user made or another tool wrote.
"""

from __future__ import annotations

import errno
import json
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

EXIT_BAD_INPUT = 2
"""Exit code of every entry point for bad input (a one-line error)."""
EXIT_INTERRUPTED = 130
"""Exit code after Ctrl-C (128 + SIGINT), as shells report it."""
MARKER = ".megatron_branchnorm-output.json"
"""Marker file in every directory an entry point creates: {"tool": ..., "kind": ...}."""
QUOTE_LIMIT = 120


def quote(value: object, limit: int = QUOTE_LIMIT) -> str:
    """``repr(value)``, cut to ``limit`` characters with the full length said."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text):,} characters)"


def one_line(text: str, limit: int = 2000) -> str:
    """Whitespace folded to single spaces, at most ``limit`` characters."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else f"{line[:limit]}... (cut)"


def describe_os_error(exc: OSError) -> str:
    """``PATH: reason`` for an OSError (full disk, missing file, permission...)."""
    reason = exc.strerror or str(exc)
    if exc.errno == errno.ENOSPC:
        reason = "no space left on device"
    name = exc.filename if exc.filename is not None else None
    if name is not None and getattr(exc, "filename2", None):
        name = f"{exc.filename} -> {exc.filename2}"
    return f"{name}: {reason}" if name is not None else one_line(str(exc))


def run_main(
    main: Callable[[list[str] | None], int],
    argv: list[str] | None = None,
    errors: tuple[type[BaseException], ...] = (),
) -> int:
    """``main(argv)`` with expected errors as one line and exit 2, Ctrl-C as exit 130."""
    try:
        return main(argv)
    except KeyboardInterrupt:
        print("interrupted (Ctrl-C): nothing half-written was kept", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as exc:
        print(f"error: {describe_os_error(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except errors as exc:
        print(f"error: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_BAD_INPUT


class OutputError(ValueError):
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


def read_marker(directory: str | Path) -> dict | None:
    """The marker of a directory an entry point wrote, or None."""
    path = Path(directory) / MARKER
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_marker(directory: str | Path, tool: str, kind: str) -> None:
    """Mark ``directory`` as written by ``tool`` (its contents are of ``kind``)."""
    path = Path(directory) / MARKER
    path.write_text(json.dumps({"tool": tool, "kind": kind}) + "\n", encoding="utf-8")


def check_overwritable(output: str | Path, kind: str, output_flag: str) -> bool:
    """Whether ``output`` exists and must be replaced; raises :class:`OutputError` when it
    exists, is not empty and was not written by one of our tools as ``kind``."""
    out = Path(output)
    if not out.exists() and not out.is_symlink():
        return False
    if out.is_symlink() or not out.is_dir():
        raise OutputError(f"{output_flag} {output}: exists and is not a directory")
    if not any(out.iterdir()):
        return True
    marker = read_marker(out)
    if marker is None or marker.get("kind") != kind:
        what = f"holds {marker.get('kind')!r}" if marker else f"has no {MARKER}"
        raise OutputError(
            f"{output_flag} {output}: exists and was not written as {kind} by this project "
            f"({what}); --overwrite only replaces such a directory: remove it yourself or "
            "choose another path"
        )
    return True


def prepare_output(
    output: str | Path,
    kind: str,
    overwrite: bool,
    output_flag: str,
    inputs: Iterable[tuple[str, str | Path | None]] = (),
) -> bool:
    """Check an output directory before anything is written: not overlapping an input, and
    either absent/empty or (with ``overwrite``) written by us as ``kind``. Returns whether
    an existing directory will be replaced; the caller replaces it only after its new
    contents are complete (temporary directory + rename)."""
    refuse_overlap(output, inputs, output_flag)
    out = Path(output)
    if out.exists() and out.is_dir() and any(out.iterdir()) and not overwrite:
        raise OutputError(
            f"{output_flag} {output}: exists and is not empty (pass --overwrite to replace an "
            f"earlier {kind})"
        )
    return check_overwritable(out, kind, output_flag)


def is_same_file(a: str | Path, b: str | Path) -> bool:
    """Whether two paths name the same existing file (links included)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
