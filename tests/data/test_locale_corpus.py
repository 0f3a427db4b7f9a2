"""The built-in corpus from gettext catalogs: .mo parsing, package split, determinism, errors."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from megatron_branchnorm.data import DataError
from megatron_branchnorm.data.locale_corpus import (
    DEFAULT_LOCALE_DIR,
    LocaleCorpusOptions,
    build_locale_corpus,
    package_family,
    read_mo,
    strip_mnemonic,
)
from megatron_branchnorm.data.text import read_lines

from .conftest import sentences

HEADER = "Content-Type: text/plain; charset=UTF-8\nPlural-Forms: nplurals=2;\n"


def write_mo(path: Path, entries: list[tuple[str, str]], big_endian: bool = False) -> None:
    """A compiled gettext catalog (keys sorted, as msgfmt writes them)."""
    entries = sorted([("", HEADER), *entries])
    e = ">" if big_endian else "<"
    n = len(entries)
    keys = [k.encode() for k, _ in entries]
    vals = [v.encode() for _, v in entries]
    start = 28 + 16 * n
    orig, trans, blob = [], [], b""
    for s in keys:
        orig.append((len(s), start + len(blob)))
        blob += s + b"\x00"
    for s in vals:
        trans.append((len(s), start + len(blob)))
        blob += s + b"\x00"
    head = struct.pack(e + "7I", 0x950412DE, 0, n, 28, 28 + 8 * n, 0, 0)
    table = b"".join(struct.pack(e + "2I", *x) for x in orig + trans)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(head + table + blob)


@pytest.mark.parametrize("big_endian", [False, True])
def test_read_mo(tmp_path: Path, big_endian: bool) -> None:
    f = tmp_path / "x.mo"
    write_mo(
        f,
        [
            ("Open file", "Datei öffnen"),
            ("menu\x04_Quit", "_Beenden"),
            ("one file\x00%d files", "eine Datei\x00%d Dateien"),
            ("Untranslated", ""),
        ],
        big_endian,
    )
    entries = read_mo(f)
    assert ("Open file", "Datei öffnen") in entries
    assert ("_Quit", "_Beenden") in entries
    assert all("\x00" not in k for k, _ in entries) and len(entries) == 3
    f.write_bytes(b"not a catalog at all")
    with pytest.raises(DataError, match=r"x\.mo: not a \.mo file"):
        read_mo(f)


def test_mnemonics_and_families() -> None:
    assert strip_mnemonic("_Open") == "Open" and strip_mnemonic("ファイル(_F)") == "ファイル"
    assert strip_mnemonic("file_name and _x") == "file_name and _x"
    assert package_family("psql-15") == "psql" and package_family("pg_dump-15") == "pg"
    assert package_family("iso_3166-1") == "iso" and package_family("gtk30") == "gtk"


def _fake_locale(
    root: Path, langs: tuple[str, ...], packages: int = 12, per_pkg: int = 150
) -> None:
    shared = sentences("en", 5, 99)  # strings every package has ("Cancel", "OK", ...)
    for p in range(packages):
        en = sentences("en", per_pkg, p) + shared
        for lang in langs:
            xx = sentences(lang, per_pkg, 1000 + p) + sentences(lang, 5, 98)
            entries = list(zip(en, xx, strict=True)) + [("same", "same"), ("%s", "%s")]
            write_mo(root / lang / "LC_MESSAGES" / f"pkg{chr(97 + p)}.mo", entries)


def test_build_split_by_package(tmp_path: Path) -> None:
    _fake_locale(tmp_path / "locale", ("de", "fr"))
    opts = LocaleCorpusOptions(
        output=str(tmp_path / "c1"),
        langs=("fr", "de"),
        locale_dir=str(tmp_path / "locale"),
        min_pairs=100,
        eval_fraction=0.1,
    )
    summary = build_locale_corpus(opts)
    fams = summary["families"]
    assert fams["test"] and fams["dev"] and fams["train"]
    assert not set(fams["test"]) & set(fams["train"])
    base = tmp_path / "c1" / "opus-100-corpus" / "v1.0" / "supervised"
    for lang in ("de", "fr"):
        pair = "de-en" if lang == "de" else "en-fr"
        lines = {
            s: read_lines(base / pair / f"opus.{pair}-{s}.en")[0] for s in ("train", "dev", "test")
        }
        other = {
            s: read_lines(base / pair / f"opus.{pair}-{s}.{lang}")[0]
            for s in ("train", "dev", "test")
        }
        for s in lines:
            assert len(lines[s]) == len(other[s]) == summary["languages"][lang][s] > 0
        assert not set(lines["test"]) & set(lines["train"])
        assert not set(lines["dev"]) & set(lines["train"])
        assert "same" not in lines["train"] and "%s" not in lines["train"]
        assert len(set(zip(lines["train"], other["train"], strict=True))) == len(lines["train"])
    # The split does not depend on which languages are built together.
    build_locale_corpus(
        LocaleCorpusOptions(**{**opts.__dict__, "output": str(tmp_path / "de"), "langs": ("de",)})
    )
    for f in (base / "de-en").iterdir():
        other_base = tmp_path / "de" / "opus-100-corpus" / "v1.0" / "supervised"
        assert f.read_bytes() == (other_base / "de-en" / f.name).read_bytes()
    # Deterministic: a second build gives the same bytes.
    build_locale_corpus(LocaleCorpusOptions(**{**opts.__dict__, "output": str(tmp_path / "c2")}))
    for f in (tmp_path / "c1").rglob("*"):
        if f.is_file():
            assert f.read_bytes() == (tmp_path / "c2" / f.relative_to(tmp_path / "c1")).read_bytes()


def test_build_errors(tmp_path: Path) -> None:
    _fake_locale(tmp_path / "locale", ("de",), packages=6, per_pkg=20)
    with pytest.raises(DataError, match=r"too few pairs for de \(\d+ train"):
        build_locale_corpus(
            LocaleCorpusOptions(
                output=str(tmp_path / "o"),
                langs=("de",),
                locale_dir=str(tmp_path / "locale"),
                min_pairs=1000,
            )
        )
    with pytest.raises(DataError, match=r"--langs xx: no catalogs in .*xx/LC_MESSAGES"):
        build_locale_corpus(
            LocaleCorpusOptions(
                output=str(tmp_path / "o"),
                langs=("de", "xx"),
                locale_dir=str(tmp_path / "locale"),
            )
        )
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(
    not all((Path(DEFAULT_LOCALE_DIR) / lang / "LC_MESSAGES").is_dir() for lang in ("de", "fr")),
    reason="no de/fr gettext catalogs on this machine",
)
def test_machine_catalogs(tmp_path: Path) -> None:
    try:
        summary = build_locale_corpus(
            LocaleCorpusOptions(output=str(tmp_path / "lc"), langs=("de", "fr"), min_pairs=100)
        )
    except DataError as exc:
        if "too few pairs" in str(exc):
            pytest.skip(f"catalogs here are too small: {exc}")
        raise
    for lang in ("de", "fr"):
        counts = summary["languages"][lang]
        assert counts["train"] >= 100 and counts["dev"] > 0 and counts["test"] > 0
    assert (tmp_path / "lc" / "opus-100-corpus" / "v1.0" / "supervised" / "en-fr").is_dir()
