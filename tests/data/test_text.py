"""Line reading and normalisation: odd characters never split or shift lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_branchnorm.data import DataError
from megatron_branchnorm.data.text import clean, read_lines, reference


def test_only_newline_splits(tmp_path: Path) -> None:
    f = tmp_path / "x.txt"
    f.write_bytes(
        "\ufeffone\rstill one\n"
        "two\u2028still two\x00\x0c\x85\n"
        "\n"
        "four\u2029\x1c\x1d\x1e\x0b end".encode()
    )
    lines, bad = read_lines(f)
    assert len(lines) == 4 and bad == []
    assert lines[2] == ""
    assert clean(lines[0]) == "one still one"
    assert clean(lines[1]) == "two still two"
    assert clean(lines[3]) == "four end"
    assert reference(lines[0]) == "one still one"
    assert "\n" not in reference(lines[1]) and len(reference(lines[1]).splitlines()) == 1


def test_invalid_utf8_error_names_file_and_line(tmp_path: Path) -> None:
    f = tmp_path / "bad.de"
    f.write_bytes(b"ok\nalso ok\nbro\xffken\n")
    with pytest.raises(DataError, match=r"bad\.de:3: invalid UTF-8 \(byte 0xff at column 4\)"):
        read_lines(f)
    lines, bad = read_lines(f, "skip")
    assert bad == [2] and lines[2] == "bro\ufffdken"


def test_empty_file_and_no_final_newline(tmp_path: Path) -> None:
    f = tmp_path / "e"
    f.write_bytes(b"")
    assert read_lines(f) == ([], [])
    f.write_bytes(b"a\nb")
    assert read_lines(f) == (["a", "b"], [])


def test_clean_whitespace() -> None:
    assert clean("  a\t\tb  \u00a0c ") == "a b c"
    assert clean("\x00\ufeff \u2028") == ""
