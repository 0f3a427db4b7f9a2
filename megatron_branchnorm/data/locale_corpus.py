"""The built-in corpus: English-centric sentence pairs from installed gettext catalogs.

Every ``<locale_dir>/<lang>/LC_MESSAGES/<package>.mo`` holds msgid (English) / msgstr
(translation) pairs, the same kind of text as OPUS's GNOME/KDE/Ubuntu subcorpora. Per language
we keep singular, translated entries (the header, plural entries and empty translations are
skipped; msgfmt leaves fuzzy entries out of a .mo unless told otherwise, and a .mo carries no
fuzzy flag to check), strip message contexts and keyboard mnemonics (``_File``, ``(_F)``),
collapse whitespace, and drop pairs without a letter, longer than ``max_chars`` or identical on
both sides.

Splits are made *by package family* (``pg_dump-15`` and ``pg_ctl-15`` are one family, so are the
``iso_*`` catalogs): families are ordered by a hash of their name, the first ones go to test and
the next to dev until each holds about ``eval_fraction`` of the catalog bytes installed (over all
languages), the rest to train. The split depends only on the installed catalogs, not on
``--langs``: it is the same for every language and every language selection. Pairs are deduplicated within a split, and a
dev or test pair whose English side also occurs in train (test: or in dev) is dropped, so test
sentences come from programs, and sentences, never seen in training. Output is the OPUS-100
layout, written to a temporary directory and renamed at the end.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from megatron_branchnorm.data.corpora import LANG_RE, pair_name
from megatron_branchnorm.data.staging import check_output_dir, staged_output
from megatron_branchnorm.data.text import clean, is_letterish
from megatron_branchnorm.formats import dirs
from megatron_branchnorm.formats.data_dir import DataError

DEFAULT_LOCALE_DIR = "/usr/share/locale"
DEFAULT_LANGS = ("de", "es", "fr", "it", "ja", "ru", "zh_CN")
CORPUS_KIND = dirs.CORPUS.name
"""Marker kind of a corpus directory (cli.MARKER): ``overwrite`` replaces only such a one."""
CORPUS_TOOL = "build_locale_corpus"
_MO_MAGIC = 0x950412DE
_MNEMONIC_PAREN = re.compile(r"\s*\((?:_|&)[^\s()]\)")
_MNEMONIC = re.compile(r"_(?=\w)")
_CHARSET = re.compile(r"charset=([A-Za-z0-9_.:-]+)", re.IGNORECASE)
_FAMILY_PREFIXES = ("iso_", "pg_")
_FAMILY_SUFFIX = re.compile(r"[-_.]?\d+(?:\.\d+)*$")


def read_mo(path: str | Path) -> list[tuple[str, str]]:
    """The (msgid, msgstr) singular entries of a compiled catalog, in file order; the context
    is stripped from msgid. Raises :class:`DataError` on a file that is not a valid .mo."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if len(data) < 20:
        raise DataError(f"{path}: too short for a .mo file")
    for endian in ("<", ">"):
        if struct.unpack(endian + "I", data[:4])[0] == _MO_MAGIC:
            break
    else:
        raise DataError(f"{path}: not a .mo file (bad magic)")
    _rev, count, orig_off, trans_off = struct.unpack(endian + "4I", data[4:20])

    def table(off: int) -> list[bytes]:
        end = off + 8 * count
        if end > len(data):
            raise DataError(f"{path}: truncated .mo string table")
        out = []
        for i in range(count):
            length, start = struct.unpack(endian + "2I", data[off + 8 * i : off + 8 * i + 8])
            if start + length > len(data):
                raise DataError(f"{path}: truncated .mo string {i}")
            out.append(data[start : start + length])
        return out

    originals, translations = table(orig_off), table(trans_off)
    charset = "utf-8"
    for k, v in zip(originals, translations, strict=True):
        if k == b"":
            m = _CHARSET.search(v.decode("ascii", errors="replace"))
            if m and m.group(1).upper() not in ("CHARSET", "ASCII"):
                charset = m.group(1)
    entries = []
    for k, v in zip(originals, translations, strict=True):
        if not k or b"\x00" in k:  # header, plural forms
            continue
        try:
            msgid = k.decode(charset)
            msgstr = v.decode(charset)
        except (UnicodeDecodeError, LookupError):
            continue
        if "\x04" in msgid:
            msgid = msgid.split("\x04", 1)[1]
        entries.append((msgid, msgstr))
    return entries


def strip_mnemonic(text: str) -> str:
    """Remove a keyboard mnemonic: ``(_F)``/``(&F)`` anywhere, or one ``_`` before a letter."""
    text = _MNEMONIC_PAREN.sub("", text)
    if text.count("_") == 1:
        text = _MNEMONIC.sub("", text)
    return text


def package_family(domain: str) -> str:
    """The family a catalog belongs to for splitting (versions and ``iso_``/``pg_`` merged)."""
    for prefix in _FAMILY_PREFIXES:
        if domain.startswith(prefix):
            return prefix.rstrip("_")
    return _FAMILY_SUFFIX.sub("", domain) or domain


@dataclass
class LocaleCorpusOptions:
    """Options of :func:`build_locale_corpus`."""

    output: str
    langs: tuple[str, ...] = DEFAULT_LANGS
    locale_dir: str = DEFAULT_LOCALE_DIR
    min_pairs: int = 1000
    """A language with fewer training pairs than this is an error."""
    eval_fraction: float = 0.05
    """Target share of the installed catalog bytes for each of dev and test."""
    max_chars: int = 400
    overwrite: bool = False


def _lang_pairs(
    locale_dir: Path, lang: str, max_chars: int
) -> tuple[dict[str, list[tuple[str, str]]], int]:
    """Cleaned pairs per package (``{domain: [(en, xx), ...]}``) and the raw entry count."""
    msg_dir = locale_dir / lang / "LC_MESSAGES"
    files = sorted(msg_dir.glob("*.mo")) if msg_dir.is_dir() else []
    if not files:
        raise DataError(f"--langs {lang}: no catalogs in {msg_dir}")
    out, raw = {}, 0
    for f in files:
        pairs = []
        entries = read_mo(f)
        raw += len(entries)
        for msgid, msgstr in entries:
            en, xx = clean(strip_mnemonic(msgid)), clean(strip_mnemonic(msgstr))
            if not en or not xx or en == xx or not is_letterish(en):
                continue
            if len(en) > max_chars or len(xx) > max_chars:
                continue
            pairs.append((en, xx))
        if pairs:
            out[f.stem] = pairs
    return out, raw


def family_weights(locale_dir: str | Path) -> dict[str, int]:
    """Bytes of compiled catalogs per package family, over every language installed: a proxy
    for each family's message count that does not depend on which languages are built."""
    weights: dict[str, int] = {}
    for f in sorted(Path(locale_dir).glob("*/LC_MESSAGES/*.mo")):
        fam = package_family(f.stem)
        weights[fam] = weights.get(fam, 0) + f.stat().st_size
    return weights


def _stable_hash(name: str) -> str:
    return hashlib.sha256(name.encode("utf-8")).hexdigest()


def assign_splits(family_sizes: dict[str, int], eval_fraction: float) -> dict[str, str]:
    """Split name per family: test first, then dev, each to about ``eval_fraction`` of the
    total weight, in hash order; a family heavier than twice the target stays in train."""
    total = sum(family_sizes.values())
    target = eval_fraction * total
    fill = {"test": 0, "dev": 0}
    out = {}
    for fam in sorted(family_sizes, key=_stable_hash):
        size = family_sizes[fam]
        for split in ("test", "dev"):
            if fill[split] < target and size <= 2 * target:
                out[fam] = split
                fill[split] += size
                break
        else:
            out[fam] = "train"
    return out


def _check_options(opts: LocaleCorpusOptions) -> None:
    """Numbers finite and in range (the command line checks them too)."""
    if not isinstance(opts.min_pairs, int) or opts.min_pairs < 1:
        raise DataError(f"--min-pairs must be an integer >= 1, got {opts.min_pairs!r}")
    if not isinstance(opts.max_chars, int) or opts.max_chars < 1:
        raise DataError(f"--max-chars must be an integer >= 1, got {opts.max_chars!r}")
    frac = opts.eval_fraction
    if not isinstance(frac, (int, float)) or not (math.isfinite(frac) and 0 < frac < 0.5):
        raise DataError(f"--eval-fraction must be a finite number in (0, 0.5), got {frac!r}")


def build_locale_corpus(opts: LocaleCorpusOptions) -> dict:
    """Write the corpus under ``opts.output`` and return its summary (also ``locale_corpus.json``)."""
    locale_dir = Path(opts.locale_dir)
    langs = sorted(set(opts.langs))
    if not langs:
        raise DataError("--langs: no language given")
    for lang in langs:
        if lang == "en" or not LANG_RE.match(lang):
            raise DataError(f"--langs: {lang!r} is not a non-English language code")
    _check_options(opts)
    out = Path(opts.output)
    inputs = [("--locale-dir", locale_dir)]
    check_output_dir(out, CORPUS_KIND, opts.overwrite, inputs)
    if not locale_dir.is_dir():
        what = "does not exist" if not locale_dir.exists() else "is not a directory"
        raise DataError(f"--locale-dir {locale_dir}: {what}")

    per_lang: dict[str, dict[str, list[tuple[str, str]]]] = {}
    raw_counts = {}
    for lang in langs:
        per_lang[lang], raw_counts[lang] = _lang_pairs(locale_dir, lang, opts.max_chars)
    split_of = assign_splits(family_weights(locale_dir), opts.eval_fraction)

    corpus: dict[str, dict[str, list[tuple[str, str]]]] = {}
    summary: dict = {"locale_dir": str(locale_dir), "languages": {}, "families": {}}
    for split in ("train", "dev", "test"):
        summary["families"][split] = sorted(f for f, s in split_of.items() if s == split)
    too_small = []
    for lang in langs:
        by_split: dict[str, list[tuple[str, str]]] = {"train": [], "dev": [], "test": []}
        seen: dict[str, set] = {s: set() for s in by_split}
        for domain in sorted(per_lang[lang]):
            split = split_of[package_family(domain)]
            for en, xx in per_lang[lang][domain]:
                key = (en, xx) if split == "train" else en
                if key not in seen[split]:
                    seen[split].add(key)
                    by_split[split].append((en, xx))
        train_en = {en for en, _ in by_split["train"]}
        dev_en = {en for en, _ in by_split["dev"]}
        by_split["dev"] = [p for p in by_split["dev"] if p[0] not in train_en]
        by_split["test"] = [
            p for p in by_split["test"] if p[0] not in train_en and p[0] not in dev_en
        ]
        corpus[lang] = by_split
        summary["languages"][lang] = {
            "packages": len(per_lang[lang]),
            "catalog_entries": raw_counts[lang],
            **{s: len(v) for s, v in by_split.items()},
        }
        if len(by_split["train"]) < opts.min_pairs or not by_split["dev"] or not by_split["test"]:
            too_small.append(
                f"{lang} ({len(by_split['train'])} train / {len(by_split['dev'])} dev / "
                f"{len(by_split['test'])} test pairs)"
            )
    if too_small:
        raise DataError(
            f"{locale_dir}: too few pairs for {', '.join(too_small)}; need at least "
            f"{opts.min_pairs} training pairs and non-empty dev and test (--min-pairs)"
        )

    with staged_output(out, CORPUS_TOOL, CORPUS_KIND, opts.overwrite, inputs) as tmp:
        base = tmp / "opus-100-corpus" / "v1.0" / "supervised"
        for lang, by_split in corpus.items():
            pair = pair_name("en", lang)
            (base / pair).mkdir(parents=True)
            for split, pairs in by_split.items():
                for code, side in (("en", 0), (lang, 1)):
                    with open(
                        base / pair / f"opus.{pair}-{split}.{code}",
                        "w",
                        encoding="utf-8",
                        newline="\n",
                    ) as f:
                        f.writelines(p[side] + "\n" for p in pairs)
        with open(tmp / "locale_corpus.json", "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2, ensure_ascii=False)
            f.write("\n")
    return summary
