"""What the format owners share: reading and writing our own small JSON files with one-line
errors naming the file, a file's SHA-256, and the one-line and quoting rules of every error
message (``cli`` uses the same).

A small file a user may hand us (a marker, ``latest``, a manifest, ``best.json``) is read with
:func:`read_small_file`: only a regular file, at most a given size. A device (a marker linked to
``/dev/zero``) would otherwise be read without end, and a FIFO would block the reader forever."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import BinaryIO

from megatron_branchnorm.errors import UserError

MAX_JSON_BYTES = 64 << 20
"""Largest JSON file of ours read (train_config.json, manifest.json: a few KB to a few MB)."""


QUOTE_LIMIT = 120


MAX_INT = 2**31 - 1
"""Largest integer a config key or a count flag takes."""


def one_line(text: object, limit: int = 2000) -> str:
    """Whitespace folded to single spaces, at most ``limit`` characters."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else f"{line[:limit]}... (cut)"


def quote(value: object, limit: int = QUOTE_LIMIT) -> str:
    """``repr(value)``, cut to ``limit`` characters with the full length said."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text):,} characters)"


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class FileShapeError(UserError, ValueError):
    """A file we read that is not a regular file (a device, a FIFO, a directory, a link where
    none is allowed) or is larger than its kind ever is: one line naming it."""


_NOT_REGULAR = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
)


def _size_text(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n:,} bytes"


def open_regular(path: str | Path, follow_symlinks: bool = True) -> BinaryIO:
    """``path`` opened for binary reading, only if it is a regular file (with
    ``follow_symlinks`` False, not a symbolic link either): a :class:`FileShapeError` naming it
    otherwise. Never blocks on a FIFO. A missing or unreadable file is the ``OSError``."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow_symlinks:
        if Path(path).is_symlink():
            raise FileShapeError(f"{path}: a symbolic link, not a regular file")
        flags |= getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            what = next((name for test, name in _NOT_REGULAR if test(mode)), "not a file")
            raise FileShapeError(f"{path}: {what}, not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_small_file(path: str | Path, max_bytes: int, follow_symlinks: bool = True) -> bytes:
    """The bytes of the regular file ``path`` of at most ``max_bytes`` (a marker, ``latest``, a
    JSON record of ours): a :class:`FileShapeError` naming it for anything else (a device, a
    FIFO, a directory, a larger file; with ``follow_symlinks`` False a symbolic link), never an
    unbounded read. A missing or unreadable file is the ``OSError``."""
    with open_regular(path, follow_symlinks) as fh:
        if os.fstat(fh.fileno()).st_size > max_bytes:
            raise FileShapeError(f"{path}: larger than {_size_text(max_bytes)}; not ours")
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:  # grew while we read it
        raise FileShapeError(f"{path}: larger than {_size_text(max_bytes)}; not ours")
    return data


def read_json_object(
    path: Path, error: type[Exception], missing: str = "missing", max_bytes: int = MAX_JSON_BYTES
) -> dict:
    """The JSON object in ``path``; ``error`` with one line naming the file otherwise
    (``missing`` says what a missing file means)."""
    return read_json_file(path, error, missing, max_bytes)[0]


def read_json_file(
    path: Path, error: type[Exception], missing: str = "missing", max_bytes: int = MAX_JSON_BYTES
) -> tuple[dict, bytes]:
    """The JSON object in ``path`` and the bytes it was parsed from (one read: to hash what
    was parsed); errors as :func:`read_json_object`."""
    try:
        raw = read_small_file(path, max_bytes)
        text = raw.decode("utf-8")
    except FileNotFoundError:
        raise error(f"{path}: {missing}") from None
    except FileShapeError as exc:
        raise error(str(exc)) from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise error(f"{path}: unreadable ({one_line(reason)})") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise error(f"{path}: not valid JSON ({one_line(exc)})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: not a JSON object")
    return data, raw


def write_json_atomic(path: Path, data: object, **dumps) -> None:
    """``data`` as JSON into ``path``, through a temporary name beside it (a reader never sees
    half a file)."""
    tmp = path.parent / f".{path.name}.tmp"
    tmp.write_text(json.dumps(data, **dumps) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def name_problem(name: object) -> str | None:
    """Why ``name`` is not a relative path inside a directory, checked as text before any file
    is touched (a string, not empty, no NUL, not absolute, no ``..`` part, no backslash); None
    when it is one. A manifest's name never makes us stat, read, hash or write a file outside
    its directory."""
    if not isinstance(name, str):
        return f"must be a file name (a string), got {quote(name)}"
    if not name or "\0" in name or "\\" in name:
        return f"{quote(name)} is not a file name"
    if name.startswith("/") or os.path.isabs(name):
        return f"{quote(name)} is an absolute path; only names inside the directory are allowed"
    if any(part == ".." for part in name.split("/")):
        return f"{quote(name)} leaves the directory ('..'); only names inside it are allowed"
    if not [part for part in name.split("/") if part not in ("", ".")]:
        return f"{quote(name)} is not a file name"
    return None


def file_inside(
    directory: str | Path,
    name: object,
    where: str | Path,
    key: str | None,
    error: type[Exception] = FileShapeError,
    must_exist: bool = True,
) -> Path:
    """The file ``name`` names inside ``directory``, as a manifest (``where``, its ``key``)
    names it: the one rule of every manifest reader (a DATA_DIR's ``manifest.json``, an
    export's ``export.json``, a checkpoint's ``checksums.json``, a run's marker and records).
    With ``key`` None, ``name`` is one of the fixed names of the directory ``where``.

    ``name`` must pass :func:`name_problem` (checked as text first, so an absolute or ``..``
    name touches no file), resolve inside ``directory`` (no symbolic link on the way leads out
    of it), and be a regular file that is not itself a link. ``error`` with one line naming
    ``where`` and ``key`` otherwise; with ``must_exist`` False a missing file is allowed (the
    path is returned) but everything else is still checked."""
    at = f"{where}: key {key}" if key is not None else str(where)
    named = f"named by key {key} of {where}" if key is not None else f"in {where}"
    problem = name_problem(name)
    if problem:
        raise error(f"{at}: {problem}")
    base = Path(directory)
    path = base / str(name)
    try:
        root = base.resolve(strict=True)
        resolved = path.resolve(strict=False)
    except (OSError, RuntimeError) as exc:  # a link loop, an unreadable directory
        raise error(f"{at}: {quote(name)} cannot be resolved ({one_line(exc)})") from None
    if resolved != root and root not in resolved.parents:
        raise error(f"{path}: leads out of {base} through a symbolic link ({named}); not allowed")
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        if must_exist:
            raise error(f"{path}: missing ({named})") from None
        return path
    except OSError as exc:
        raise error(f"{path}: unreadable ({one_line(exc.strerror or exc)})") from None
    if stat.S_ISLNK(mode):
        raise error(f"{path}: a symbolic link ({named}); not allowed")
    if not stat.S_ISREG(mode):
        what = next((label for test, label in _NOT_REGULAR if test(mode)), "not a file")
        raise error(f"{path}: {what}, not a regular file ({named})")
    return path
