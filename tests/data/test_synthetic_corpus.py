"""The synthetic OPUS-100-shaped corpus: layout, sizes, determinism, scripts, Zipf words."""

from __future__ import annotations

import hashlib
import unicodedata
from collections import Counter
from pathlib import Path

import pytest

from megatron_branchnorm.commands.opus_like import main
from megatron_branchnorm.data import DataError
from megatron_branchnorm.data.corpora import read_corpus
from megatron_branchnorm.data.synthetic_corpus import (
    language_codes,
    train_sizes,
    write_opus100_like,
)

TOTAL = 30_000


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("syn") / "corpus"
    write_opus100_like(out, TOTAL, dev_size=50, test_size=40, vocab_words=3000)
    return out


def _digest(root: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(root.rglob("opus.*")):
        h.update(f.relative_to(root).as_posix().encode() + f.read_bytes())
    return h.hexdigest()


def test_sizes_fall_geometrically_and_sum() -> None:
    sizes = train_sizes(1_000_000)
    assert sum(sizes) == 1_000_000 and len(sizes) == 20
    assert all(a >= b for a, b in zip(sizes, sizes[1:], strict=False))
    assert 55 < sizes[0] / sizes[-1] < 80
    assert sizes[0] <= 1_000_000 / 4.5
    assert sum(train_sizes(57, 3)) == 57 and train_sizes(5, 1) == [5]
    with pytest.raises(DataError):
        train_sizes(10, 20)


def test_layout_readable_as_opus100(corpus: Path) -> None:
    langs = language_codes(20)
    assert len(set(langs)) == 20 and "en" not in langs
    data, source = read_corpus("opus100", corpus, langs)
    assert set(source.values()) == {"files"}
    train = [len(data[lang]["train"].other_lines) for lang in langs]
    assert sum(train) == TOTAL
    assert train == sorted(train, reverse=True) and train[0] > 20 * train[-1]
    for lang in langs:
        assert (
            len(data[lang]["dev"].other_lines) == 50 and len(data[lang]["test"].pivot_lines) == 40
        )
        for pairs in data[lang].values():
            assert len(pairs.other_lines) == len(pairs.pivot_lines)
            assert all(3 <= len(s.split()) <= 60 for s in pairs.other_lines)


def test_deterministic_per_seed(corpus: Path, tmp_path: Path) -> None:
    again = write_opus100_like(tmp_path / "a", TOTAL, dev_size=50, test_size=40, vocab_words=3000)
    assert _digest(again) == _digest(corpus)
    other = write_opus100_like(
        tmp_path / "b", TOTAL, seed=2, dev_size=50, test_size=40, vocab_words=3000
    )
    assert _digest(other) != _digest(corpus)


def _letters(path: Path) -> set[str]:
    text = path.read_text(encoding="utf-8")
    return {c for c in text if unicodedata.category(c)[0] in "LM"}


def test_each_language_has_its_own_script(corpus: Path) -> None:
    sup = corpus / "supervised"
    english = _letters(next(sup.glob("de-en/*-dev.en")))
    assert english <= set("abcdefghijklmnopqrstuvwxyz")
    seen = []
    for lang in language_codes(20):
        letters = _letters(next(sup.glob(f"*/opus.*-dev.{lang}")))
        assert letters - english, lang
        assert all(letters != other for other in seen), lang
        seen.append(letters)
    cyrillic = _letters(next(sup.glob("*/opus.*-dev.ru")))
    assert all(unicodedata.name(c).startswith("CYRILLIC") for c in cyrillic)


def test_zipf_frequencies_and_learnable_english(corpus: Path) -> None:
    sup = corpus / "supervised" / "de-en"
    counts = Counter((sup / "opus.de-en-train.de").read_text(encoding="utf-8").split())
    ranked = [n for _, n in counts.most_common()]
    assert ranked[0] > 30 * ranked[99]
    de = (sup / "opus.de-en-train.de").read_text(encoding="utf-8").splitlines()
    en = (sup / "opus.de-en-train.en").read_text(encoding="utf-8").splitlines()
    # the English side is a word-by-word function of German plus noise: the most frequent
    # German word's most frequent aligned English word is nearly always there
    top = counts.most_common(1)[0][0]
    rows = [(d, e) for d, e in zip(de, en, strict=True) if top in d.split()][:500]
    together = Counter(w for _, e in rows for w in set(e.split()))
    assert together.most_common(1)[0][1] > 0.9 * len(rows)


def test_refuses_a_users_directory_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(DataError, match="not empty"):
        write_opus100_like(mine, 100, n_pairs=2, dev_size=5, test_size=5, vocab_words=200)
    assert main(["--output", str(mine), "--pairs", "100", "--overwrite"]) == 2
    assert (mine / "notes.txt").read_text() == "keep"
    out = tmp_path / "cli"
    argv = ["--output", str(out), "--pairs", "300", "--n-pairs", "3", "--vocab-words", "200"]
    assert main([*argv, "--dev-size", "5", "--test-size", "5"]) == 0
    assert "de-en" in capsys.readouterr().out
    assert main([*argv, "--dev-size", "5", "--test-size", "5", "--overwrite"]) == 0
    assert sorted(p.name for p in (out / "supervised").iterdir()) == ["de-en", "en-fr", "en-ru"]
