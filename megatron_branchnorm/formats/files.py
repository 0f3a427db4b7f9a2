"""What the format owners share: reading and writing our own small JSON files with one-line
errors naming the file, a file's SHA-256, and the one-line and quoting rules of every error
message (``cli`` uses the same)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MAX_JSON_BYTES = 64 << 20
"""Largest JSON file of ours read (train_config.json, manifest.json: a few KB to a few MB)."""


QUOTE_LIMIT = 120


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


def read_json_object(
    path: Path, error: type[Exception], missing: str = "missing", max_bytes: int = MAX_JSON_BYTES
) -> dict:
    """The JSON object in ``path``; ``error`` with one line naming the file otherwise
    (``missing`` says what a missing file means)."""
    try:
        if path.stat().st_size > max_bytes:
            raise error(f"{path}: larger than {max_bytes >> 20} MiB; not ours")
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{path}: {missing}") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise error(f"{path}: unreadable ({one_line(reason)})") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise error(f"{path}: not valid JSON ({one_line(exc)})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: not a JSON object")
    return data


def write_json_atomic(path: Path, data: object, **dumps) -> None:
    """``data`` as JSON into ``path``, through a temporary name beside it (a reader never sees
    half a file)."""
    tmp = path.parent / f".{path.name}.tmp"
    tmp.write_text(json.dumps(data, **dumps) + "\n", encoding="utf-8")
    os.replace(tmp, path)
