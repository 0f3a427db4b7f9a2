"""Reading parallel text files line by line, and the two normalisations applied to a line.

Lines are split on ``\\n`` only: ``\\r``, U+2028, NUL, form feed and a BOM inside a line never
split or shift it (Python's ``str.splitlines`` would). :func:`read_lines` reads a whole file;
preprocessing streams blocks of whole lines through :func:`decode_block`, :func:`clean_lines`
and :func:`reference_block`, which give the same lines, errors and text line for line. It holds
at most a cap of bytes of any line: a longer line is read past in blocks by
:func:`read_past_line` (checked for UTF-8), which keeps only its length.

* :func:`clean` (training text and encoded dev/test): control characters and the byte-order
  mark removed, every kind of whitespace collapsed to one space, ends stripped.
* :func:`reference` (the raw dev/test references kept in DATA_DIR): the line as given, except
  that characters a line reader may treat as line breaks become a space and NUL/BOM are removed,
  so the file has exactly one line per sentence for any reader.
"""

from __future__ import annotations

import codecs
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from megatron_branchnorm.formats.data_dir import DataError

BAD_UTF8_MODES = ("error", "skip", "replace")

# Characters that some readers treat as line breaks (str.splitlines does).
_LINE_BREAKS = "\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
_REFERENCE_TABLE = {ord(c): " " for c in _LINE_BREAKS} | {0: None, 0xFEFF: None}


def _clean_table() -> dict[int, str | None]:
    table: dict[int, str | None] = {}
    for cp in list(range(0x00, 0x20)) + list(range(0x7F, 0xA0)):
        table[cp] = None
    for c in "\t\n" + _LINE_BREAKS:
        table[ord(c)] = " "
    table[0xFEFF] = None
    return table


_CLEAN_TABLE = _clean_table()
# The same, keeping \n: a block of lines translated at once (a line never contains \n).
_CLEAN_BLOCK_TABLE = _CLEAN_TABLE | {ord("\n"): "\n"}


def clean(line: str) -> str:
    """Training-side normalisation: drop control characters and BOM, collapse whitespace."""
    return " ".join(line.translate(_CLEAN_TABLE).split())


def reference(line: str) -> str:
    """Evaluation-reference form: line-break look-alikes become spaces; NUL and BOM removed."""
    return line.translate(_REFERENCE_TABLE)


def clean_lines(lines: list[str]) -> list[str]:
    """:func:`clean` of each line (lines split on ``\\n``, so none contains one)."""
    if not lines:
        return []
    block = "\n".join(lines).translate(_CLEAN_BLOCK_TABLE)
    return [" ".join(x.split()) for x in block.split("\n")]


def reference_block(lines: list[str]) -> str:
    """:func:`reference` of each line, each ending in ``\\n`` (the references' file text)."""
    return "".join(x + "\n" for x in lines).translate(_REFERENCE_TABLE)


def utf8_error(path: str | Path, line_no: int, column: int, byte: int) -> DataError:
    """The error for invalid UTF-8 at 1-based ``line_no`` and ``column`` of ``path``."""
    return DataError(
        f"{path}:{line_no}: invalid UTF-8 (byte 0x{byte:02x} at column {column}); "
        "use --on-bad-utf8 skip|replace to drop or repair such lines"
    )


def decode_block(block: bytes) -> tuple[list[str], list[int], tuple[int, int, int] | None]:
    """The lines of ``block`` (whole lines split on ``\\n``; the last newline is optional),
    the 0-based numbers of lines with invalid UTF-8 (decoded with U+FFFD replacements), and
    where the first of them fails: (line number, 1-based column, byte); None when all are
    valid. Decoding a file block by block finds the same first error as decoding it whole."""
    try:
        text = block.decode("utf-8")
    except UnicodeDecodeError:
        pass
    else:
        lines = text.split("\n")
        if not text or text.endswith("\n"):
            lines.pop()
        return lines, [], None
    raw = block.split(b"\n")
    if block.endswith(b"\n"):
        raw.pop()
    lines, bad, first = [], [], None
    for i, b in enumerate(raw):
        try:
            lines.append(b.decode("utf-8"))
        except UnicodeDecodeError as exc:
            if first is None:
                first = (i, exc.start + 1, b[exc.start])
            lines.append(b.decode("utf-8", errors="replace"))
            bad.append(i)
    return lines, bad, first


@dataclass(frozen=True)
class LongLine:
    """A line over a reader's byte cap, read past without keeping it (:func:`read_past_line`)."""

    nbytes: int
    """Its length in bytes, without the ``\\n``."""
    bad_utf8: tuple[int, int] | None
    """Its first invalid UTF-8: (1-based column, byte), as :func:`decode_block` reports it;
    None when the line is valid UTF-8."""


def read_past_line(f: BinaryIO, head: bytes) -> LongLine:
    """The rest of a line of ``f`` over the cap of its reader, whose first cap + 1 bytes
    ``head`` were read (``f.readline(cap + 1)``): read in blocks of at most that many bytes and
    checked for UTF-8, so that memory never holds more of the line."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    nbytes, bad, chunk = 0, None, head
    while True:
        last = not chunk or chunk.endswith(b"\n")
        data = chunk[:-1] if chunk.endswith(b"\n") else chunk
        if bad is None:
            held = len(decoder.getstate()[0])  # bytes of an unfinished character, kept back
            try:
                decoder.decode(data, final=last)
            except UnicodeDecodeError as exc:
                bad = (nbytes - held + exc.start + 1, exc.object[exc.start])
        nbytes += len(data)
        if last:
            return LongLine(nbytes, bad)
        chunk = f.readline(len(head))


def read_lines(path: str | Path, on_bad_utf8: str = "error") -> tuple[list[str], list[int]]:
    """The lines of ``path`` (split on ``\\n`` only) and the 0-based numbers of invalid-UTF-8 lines.

    ``on_bad_utf8``: ``error`` raises :class:`DataError` naming the file and line; ``skip`` and
    ``replace`` return the line decoded with U+FFFD replacements and report its number (the
    caller drops such pairs for ``skip`` and counts them in both cases).
    """
    if on_bad_utf8 not in BAD_UTF8_MODES:
        raise DataError(f"on_bad_utf8 must be one of {', '.join(BAD_UTF8_MODES)}: {on_bad_utf8!r}")
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not data:
        return [], []
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if on_bad_utf8 == "error":
            line_no = data.count(b"\n", 0, exc.start) + 1
            col = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
            raise utf8_error(path, line_no, col, data[exc.start]) from None
        raw = data.split(b"\n")
        if data.endswith(b"\n"):
            raw.pop()
        lines, bad = [], []
        for i, b in enumerate(raw):
            try:
                lines.append(b.decode("utf-8"))
            except UnicodeDecodeError:
                lines.append(b.decode("utf-8", errors="replace"))
                bad.append(i)
        return lines, bad
    lines = text.split("\n")
    if text.endswith("\n"):
        lines.pop()
    return lines, []


def is_letterish(text: str) -> bool:
    """True when ``text`` contains at least one letter (any script)."""
    return any(unicodedata.category(c).startswith("L") for c in text)
