"""Finding and reading English-centric parallel corpora in the three supported layouts.

``opus100``  ``DIR[/opus-100-corpus/v1.0]/supervised/<xx-yy>/opus.<xx-yy>-{train,dev,test}.<lang>``
            (pair names alphabetical: ``de-en``, ``en-fr``); all three splits are required.
``moses``    ``DIR/<name>.<xx-yy>.<lang>`` (MultiUN, Europarl, ... as OPUS ships them). A name
            equal to ``dev``/``valid``/``test`` or ending in ``-dev``, ``_test`` ... is that split;
            every other name is training data (several names are concatenated in sorted order).
            Without dev and test files, dev and test are held out from the training lines by a
            seeded permutation (``dev_size``/``test_size`` lines each, at most a tenth each).
``plain``    ``DIR/<xx-yy>/{train,dev,test}.<lang>``; all three splits are required.

:func:`read_corpus` validates everything (files present, equal line counts, UTF-8) before any
output is written and returns the raw lines per pair and split.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megatron_branchnorm.data.errors import DataError
from megatron_branchnorm.data.text import read_lines

FORMATS = ("opus100", "moses", "plain")
SPLITS = ("train", "dev", "test")
LANG_RE = re.compile(r"^[A-Za-z]{2,3}(?:_[A-Za-z0-9]{2,4})?(?:@[A-Za-z]+)?$")
_SPLIT_ALIASES = {"train": "train", "dev": "dev", "valid": "dev", "test": "test"}


def pair_name(a: str, b: str) -> str:
    """The pair's directory name: the two codes in alphabetical order (``de-en``, ``en-fr``)."""
    x, y = sorted((a, b))
    return f"{x}-{y}"


def parse_langs(spec: str | list[str], pivot: str = "en") -> list[str]:
    """Validate a ``de,fr,...`` list of non-pivot language codes (sorted, no duplicates)."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    langs = [x.strip() for x in items if x.strip()]
    if not langs:
        raise DataError("--langs: no language given")
    for lang in langs:
        if not LANG_RE.match(lang):
            raise DataError(f"--langs: {lang!r} is not a language code (like de, pt_BR, zh_CN)")
        if lang == pivot:
            raise DataError(
                f"--langs: {pivot} is the pivot language of every pair; list the others"
            )
    if len(set(langs)) != len(langs):
        raise DataError(f"--langs: duplicate language in {','.join(langs)}")
    return sorted(langs)


@dataclass
class SplitFiles:
    """The files of one pair and split: parallel lists, pivot side and other side."""

    pivot_files: list[Path] = field(default_factory=list)
    other_files: list[Path] = field(default_factory=list)


@dataclass
class PairLines:
    """Raw lines of one pair and split (pivot side and other side), before any cleaning."""

    pair: str
    lang: str
    pivot: str
    pivot_lines: list[str]
    other_lines: list[str]
    bad_utf8: set[int]
    """0-based line numbers where either side had invalid UTF-8 (only with skip/replace)."""
    origin: str
    """Where the lines came from (files, or a held-out split of them), for messages."""


def _opus_root(input_dir: Path) -> Path:
    for cand in (
        input_dir / "opus-100-corpus" / "v1.0" / "supervised",
        input_dir / "v1.0" / "supervised",
        input_dir / "supervised",
    ):
        if cand.is_dir():
            return cand
    return input_dir


def discover(
    fmt: str, input_dir: str | Path, langs: list[str], pivot: str = "en"
) -> dict[str, dict[str, SplitFiles]]:
    """Files per language and split, ``{lang: {split: SplitFiles}}``; a moses pair without dev
    and test files has only ``train`` (the caller holds dev/test out). Raises on a language with
    no files or a missing split, naming what was expected."""
    if fmt not in FORMATS:
        raise DataError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    root = Path(input_dir)
    if not root.is_dir():
        raise DataError(f"--input {root}: not a directory")
    found: dict[str, dict[str, SplitFiles]] = {}
    for lang in langs:
        pair = pair_name(pivot, lang)
        if fmt == "moses":
            found[lang] = _discover_moses(root, pair, lang, pivot)
            continue
        if fmt == "opus100":
            base = _opus_root(root) / pair

            def name(split: str, code: str, base: Path = base, pair: str = pair) -> Path:
                return base / f"opus.{pair}-{split}.{code}"
        else:
            base = root / pair

            def name(split: str, code: str, base: Path = base, pair: str = pair) -> Path:
                return base / f"{split}.{code}"

        if not base.is_dir():
            raise DataError(f"--langs {lang}: no data for pair {pair} ({base} does not exist)")
        splits = {}
        for split in SPLITS:
            p, o = name(split, pivot), name(split, lang)
            for path in (p, o):
                if not path.is_file():
                    raise DataError(f"{path}: missing {split} split of pair {pair}")
            splits[split] = SplitFiles([p], [o])
        found[lang] = splits
    return found


def _moses_split(name: str) -> str:
    low = name.lower()
    if low in _SPLIT_ALIASES:
        return _SPLIT_ALIASES[low]
    for alias, split in _SPLIT_ALIASES.items():
        if low.endswith(("-" + alias, "_" + alias, "." + alias)):
            return split
    return "train"


def _discover_moses(root: Path, pair: str, lang: str, pivot: str) -> dict[str, SplitFiles]:
    names = sorted(
        p.name[: -len(f".{pair}.{pivot}")] for p in root.glob(f"*.{pair}.{pivot}") if p.is_file()
    )
    others = sorted(
        p.name[: -len(f".{pair}.{lang}")] for p in root.glob(f"*.{pair}.{lang}") if p.is_file()
    )
    if not names and not others:
        raise DataError(
            f"--langs {lang}: no data for pair {pair} (no {root}/<name>.{pair}.{{{pivot},{lang}}})"
        )
    for n in sorted(set(names) ^ set(others)):
        have, miss = (pivot, lang) if n in names else (lang, pivot)
        raise DataError(f"{root / f'{n}.{pair}.{miss}'}: missing (but {n}.{pair}.{have} exists)")
    splits: dict[str, SplitFiles] = {}
    for n in names:
        sf = splits.setdefault(_moses_split(n), SplitFiles())
        sf.pivot_files.append(root / f"{n}.{pair}.{pivot}")
        sf.other_files.append(root / f"{n}.{pair}.{lang}")
    if "train" not in splits:
        raise DataError(f"{root}: missing train split of pair {pair} (only dev/test files)")
    if ("dev" in splits) != ("test" in splits):
        missing = "test" if "dev" in splits else "dev"
        raise DataError(
            f"{root}: missing {missing} split of pair {pair} (give both dev and test files, "
            "or neither to hold them out of the training data)"
        )
    return splits


def _read_split(sf: SplitFiles, pair: str, lang: str, pivot: str, on_bad_utf8: str) -> PairLines:
    pivot_lines: list[str] = []
    other_lines: list[str] = []
    bad: set[int] = set()
    for pf, of in zip(sf.pivot_files, sf.other_files, strict=True):
        p_lines, p_bad = read_lines(pf, on_bad_utf8)
        o_lines, o_bad = read_lines(of, on_bad_utf8)
        if len(p_lines) != len(o_lines):
            raise DataError(
                f"line counts differ: {pf} has {len(p_lines)} lines but {of} has {len(o_lines)}"
            )
        offset = len(pivot_lines)
        bad.update(offset + i for i in p_bad + o_bad)
        pivot_lines += p_lines
        other_lines += o_lines
    origin = ", ".join(str(f) for f in sf.other_files)
    return PairLines(pair, lang, pivot, pivot_lines, other_lines, bad, origin)


def _hold_out(train: PairLines, dev_size: int, test_size: int, seed: int) -> dict[str, PairLines]:
    n = len(train.pivot_lines)
    n_dev = min(dev_size, n // 10)
    n_test = min(test_size, n // 10)
    perm = np.random.RandomState(seed).permutation(n)
    parts = {
        "test": np.sort(perm[:n_test]),
        "dev": np.sort(perm[n_test : n_test + n_dev]),
        "train": np.sort(perm[n_test + n_dev :]),
    }
    out = {}
    for split, idx in parts.items():
        keep = set(idx.tolist())
        renum = {old: new for new, old in enumerate(idx.tolist())}
        out[split] = PairLines(
            train.pair,
            train.lang,
            train.pivot,
            [train.pivot_lines[i] for i in idx],
            [train.other_lines[i] for i in idx],
            {renum[i] for i in train.bad_utf8 if i in keep},
            f"{train.origin} (held-out {split}, seed {seed})",
        )
    return out


def read_corpus(
    fmt: str,
    input_dir: str | Path,
    langs: list[str],
    pivot: str = "en",
    on_bad_utf8: str = "error",
    dev_size: int = 2000,
    test_size: int = 2000,
    seed: int = 1,
) -> tuple[dict[str, dict[str, PairLines]], dict[str, str]]:
    """All raw lines, ``{lang: {split: PairLines}}``, and how each pair's dev/test were made
    (``files`` or ``held-out``). Everything is validated before the caller writes output."""
    files = discover(fmt, input_dir, langs, pivot)
    corpus: dict[str, dict[str, PairLines]] = {}
    split_source: dict[str, str] = {}
    for lang, splits in files.items():
        pair = pair_name(pivot, lang)
        read = {s: _read_split(sf, pair, lang, pivot, on_bad_utf8) for s, sf in splits.items()}
        if "dev" not in read:
            read = _hold_out(read["train"], dev_size, test_size, seed)
            split_source[pair] = "held-out"
        else:
            split_source[pair] = "files"
        corpus[lang] = {s: read[s] for s in SPLITS}
    return corpus, split_source
