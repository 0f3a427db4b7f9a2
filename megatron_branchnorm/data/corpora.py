"""Finding and reading English-centric parallel corpora in the three supported layouts.

``opus100``  ``DIR[/opus-100-corpus/v1.0]/supervised/<xx-yy>/opus.<xx-yy>-{train,dev,test}.<lang>``
            (pair names alphabetical: ``de-en``, ``en-fr``); all three splits are required.
``moses``    ``DIR/<name>.<xx-yy>.<lang>`` (MultiUN, Europarl, ... as OPUS ships them). A name
            equal to ``dev``/``valid``/``test`` or ending in ``-dev``, ``_test`` ... is that split;
            every other name is training data (several names are concatenated in sorted order).
            Without dev and test files, dev and test are held out from the training lines by a
            seeded permutation (``dev_size``/``test_size`` lines each, at most a tenth each).
``plain``    ``DIR/<xx-yy>/{train,dev,test}.<lang>``; all three splits are required.

:func:`discover` finds the files and checks that they are all there; preprocessing then reads
each pair of files in blocks of lines (:class:`LineReader`), checking equal line counts and
UTF-8 as it goes. A held-out dev/test split is a label per training line
(:func:`hold_out_labels`, one byte a line), applied while the lines stream past.
:func:`read_corpus` makes the same splits in memory, for tests and small corpora.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megatron_branchnorm.data.text import LongLine, read_lines, read_past_line
from megatron_branchnorm.formats.data_dir import DataError

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


def origin(files: SplitFiles, split: str, held_out: bool, seed: int) -> str:
    """Where a split's lines come from (its files, or a held-out part of them), for messages."""
    names = ", ".join(str(f) for f in files.other_files)
    return f"{names} (held-out {split}, seed {seed})" if held_out else names


def count_lines(path: Path) -> int:
    """How many lines :func:`text.read_lines` would return, counted in blocks."""
    n, last = 0, b"\n"
    try:
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                n += block.count(b"\n")
                last = block[-1:]
    except OSError as exc:
        raise DataError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return n + (last != b"\n")


def hold_out_labels(n: int, dev_size: int, test_size: int, seed: int) -> np.ndarray:
    """The split of each of ``n`` training lines (an index into :data:`SPLITS`, uint8) when dev
    and test are held out: ``dev_size``/``test_size`` lines each (at most a tenth each), chosen
    by the permutation ``RandomState(seed).permutation(n)``: its first lines go to test, the
    next to dev. Each split keeps the lines in their input order."""
    n_dev = min(dev_size, n // 10)
    n_test = min(test_size, n // 10)
    # shuffle() of a uint32 arange gives permutation(n) at half its memory.
    perm = np.arange(n, dtype=np.uint32 if n < 1 << 32 else np.int64)
    np.random.RandomState(seed).shuffle(perm)
    labels = np.zeros(n, np.uint8)
    labels[perm[:n_test]] = SPLITS.index("test")
    labels[perm[n_test : n_test + n_dev]] = SPLITS.index("dev")
    return labels


class LineReader:
    """Whole lines of an input file, ``n`` at a time, as one block of bytes; a line over
    ``max_line_bytes`` bytes is read past (:func:`text.read_past_line`) and stands in the
    block as an empty line. An OSError becomes a DataError naming the file."""

    def __init__(self, path: Path, max_line_bytes: int) -> None:
        self.path = path
        self.max_line_bytes = max_line_bytes
        self.lines = 0
        try:
            self._f = open(path, "rb")  # noqa: SIM115 (closed by close())
        except OSError as exc:
            raise DataError(f"{path}: cannot read: {exc.strerror or exc}") from None

    def take(self, n: int) -> tuple[bytes, int, dict[int, LongLine]]:
        """The next ``n`` lines (fewer at the end of the file), how many there were, and the
        lines over ``max_line_bytes`` among them, by their 0-based number in the block."""
        lines: list[bytes] = []
        long: dict[int, LongLine] = {}
        readline, cap = self._f.readline, self.max_line_bytes
        try:
            while len(lines) < n:
                line = readline(cap + 1)
                if len(line) > cap and not line.endswith(b"\n"):
                    long[len(lines)] = read_past_line(self._f, line)
                    line = b"\n"
                elif not line:
                    break
                lines.append(line)
        except OSError as exc:
            raise DataError(f"{self.path}: cannot read: {exc.strerror or exc}") from None
        self.lines += len(lines)
        return b"".join(lines), len(lines), long

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> LineReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def line_mismatch(pivot_file: Path, pivot_lines: int, other_file: Path, other_lines: int) -> str:
    """The message for two sides of a pair with different line counts."""
    return (
        f"line counts differ: {pivot_file} has {pivot_lines} lines but {other_file} has "
        f"{other_lines}"
    )


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
    """All raw lines in memory, ``{lang: {split: PairLines}}``, and how each pair's dev/test
    were made (``files`` or ``held-out``): the splits preprocessing makes, for tests and
    inspection of small corpora (preprocessing itself streams)."""
    corpus: dict[str, dict[str, PairLines]] = {}
    split_source: dict[str, str] = {}
    for lang, splits in discover(fmt, input_dir, langs, pivot).items():
        pair = pair_name(pivot, lang)
        held_out = "dev" not in splits
        split_source[pair] = "held-out" if held_out else "files"
        corpus[lang] = {}
        for name, sf in splits.items():
            sides: list[list[str]] = [[], []]
            bad: set[int] = set()
            for pf, of in zip(sf.pivot_files, sf.other_files, strict=True):
                (p_lines, p_bad), (o_lines, o_bad) = (read_lines(f, on_bad_utf8) for f in (pf, of))
                if len(p_lines) != len(o_lines):
                    raise DataError(line_mismatch(pf, len(p_lines), of, len(o_lines)))
                bad.update(len(sides[0]) + i for i in p_bad + o_bad)
                sides[0] += p_lines
                sides[1] += o_lines
            labels = (
                hold_out_labels(len(sides[0]), dev_size, test_size, seed)
                if held_out
                else np.full(len(sides[0]), SPLITS.index(name), np.uint8)
            )
            for s, split in enumerate(SPLITS):
                if not held_out and split != name:
                    continue
                idx = np.flatnonzero(labels == s)
                renumber = np.full(labels.size, -1, np.int64)
                renumber[idx] = np.arange(idx.size)
                corpus[lang][split] = PairLines(
                    pair,
                    lang,
                    pivot,
                    [sides[0][i] for i in idx],
                    [sides[1][i] for i in idx],
                    {int(renumber[i]) for i in bad if renumber[i] >= 0},
                    origin(sf, split, held_out, seed),
                )
        corpus[lang] = {split: corpus[lang][split] for split in SPLITS}
    return corpus, split_source
