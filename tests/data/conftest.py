"""Small corpora built on the fly for the data tests."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from megatron_branchnorm.data.preprocess import PreprocessOptions, preprocess
from megatron_branchnorm.data.spm import SpmOptions

_SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ze", "po", "da", "fe"]


def words(lang: str, n: int = 60) -> list[str]:
    """A fixed pseudo-word list per language (ASCII, so decoding is exact)."""
    rng = random.Random(f"words-{lang}")
    return [
        "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) + lang[0]
        for _ in range(n)
    ]


def sentences(
    lang: str, count: int, seed: int, min_words: int = 2, max_words: int = 9
) -> list[str]:
    """``count`` pseudo sentences of ``lang``."""
    rng = random.Random(f"{lang}-{seed}")
    vocab = words(lang)
    return [
        " ".join(rng.choice(vocab) for _ in range(rng.randint(min_words, max_words)))
        for _ in range(count)
    ]


def write_lines(path: Path, lines: list[str], newline_at_end: bool = True) -> None:
    """Write lines joined by \\n as UTF-8 bytes (no newline translation)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "\n".join(lines) + ("\n" if newline_at_end and lines else "")
    path.write_bytes(text.encode("utf-8"))


def make_opus(root: Path, sizes: dict[str, tuple[int, int, int]]) -> dict:
    """OPUS-100 layout under ``root``; returns ``{lang: {split: (en_lines, xx_lines)}}``."""
    out: dict = {}
    for lang, (n_train, n_dev, n_test) in sizes.items():
        pair = "-".join(sorted(("en", lang)))
        base = root / "opus-100-corpus" / "v1.0" / "supervised" / pair
        out[lang] = {}
        for split, n in (("train", n_train), ("dev", n_dev), ("test", n_test)):
            en = sentences("en", n, sum(map(ord, lang + split)))
            xx = sentences(lang, n, len(split))
            write_lines(base / f"opus.{pair}-{split}.en", en)
            write_lines(base / f"opus.{pair}-{split}.{lang}", xx)
            out[lang][split] = (en, xx)
    return out


def run_preprocess(input_dir: Path, output: Path, langs: list[str], fmt: str = "opus100", **kw):
    """Preprocess with a tiny vocabulary and full character coverage."""
    spm_kw = {k: kw.pop(k) for k in list(kw) if k in ("vocab_size", "model_type", "temperature")}
    spm = SpmOptions(
        vocab_size=spm_kw.get("vocab_size", 100),
        character_coverage=1.0,
        model_type=spm_kw.get("model_type", "unigram"),
        temperature=spm_kw.get("temperature", 5.0),
    )
    opts = PreprocessOptions(
        fmt=fmt,
        input_dir=str(input_dir),
        langs=langs,
        output=str(output),
        spm=spm,
        progress=False,
        **kw,
    )
    return preprocess(opts)


@pytest.fixture(scope="session")
def small_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A DATA_DIR with two pairs of unequal size (de 600, fr 150 training pairs)."""
    root = tmp_path_factory.mktemp("small")
    raw = make_opus(root / "raw", {"de": (600, 40, 30), "fr": (150, 20, 20)})
    run_preprocess(root / "raw", root / "data", ["de", "fr"], max_len=64)
    return root / "data", raw
