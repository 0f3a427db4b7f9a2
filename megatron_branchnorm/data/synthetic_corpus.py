"""A synthetic corpus of OPUS-100's shape, of any size, for measuring the data path.

Twenty English-centric pairs (real OPUS-100 codes) whose other sides use their own scripts:
Latin with each language's diacritics, Cyrillic, Greek, Arabic, Hebrew, Devanagari, Thai,
Hangul, CJK, kana, Georgian, Armenian, Bengali, Tamil, Ethiopic, Sinhala. Each language has
``vocab_words`` pseudo-words made from its alphabet (frequent words are the short ones), drawn
with Zipf frequencies (s between 1.0 and 1.1 per language); sentences have 3-60 words, a
log-normal length with median 10. The English side is a word-by-word function of the other
side (a per-language map onto the English words of about the same rank) plus noise: 4% of the
words replaced by a random English word, 3% dropped. Words are separated by spaces in every
script (real Chinese, Japanese and Thai are not), so this is not a tokenisation study.

Training sizes fall geometrically from the largest pair to the smallest with ratio 1M/15k,
as OPUS-100's do, and sum to ``total_pairs``; every pair has ``dev_size`` dev and
``test_size`` test lines. Output is ``DIR/supervised/<pair>/opus.<pair>-<split>.<lang>``
(readable as ``--format opus100``), written in chunks of :data:`CHUNK` sentences with numpy
(memory stays bounded whatever the size) to a temporary directory renamed at the end. The
same arguments give the same bytes.

    python tools/make_opus_like_corpus.py --output /tmp/opus4m --pairs 4000000
"""

from __future__ import annotations

import functools
import json
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_branchnorm.data.corpora import pair_name
from megatron_branchnorm.data.locale_corpus import CORPUS_KIND
from megatron_branchnorm.data.staging import check_output_dir, staged_output
from megatron_branchnorm.formats.data_dir import DataError

CORPUS_TOOL = "make_opus_like_corpus"
SUMMARY = "synthetic_corpus.json"
PIVOT = "en"
SIZE_RATIO = 1_000_000 / 15_000
"""Largest over smallest training pair, as in OPUS-100 (1M pairs down to about 15k)."""
CHUNK = 50_000
"""Sentences generated and written at a time (about 50 MB of temporaries)."""
MIN_WORDS, MAX_WORDS, MEDIAN_WORDS, SIGMA_WORDS = 3, 60, 10.0, 0.6
REPLACE_P, DROP_P = 0.04, 0.03
LENGTH_SPREAD = 2.0
"""Word length vs rank: words are ranked by length plus this much normal noise."""
_LATIN = "abcdefghijklmnopqrstuvwxyz"


def _span(first: int, last: int) -> str:
    """The letters and combining marks among code points ``first..last``."""
    chars = (chr(c) for c in range(first, last + 1))
    return "".join(c for c in chars if unicodedata.category(c)[0] in "LM")


def _subset(chars: str, n: int, seed: int) -> str:
    """A fixed choice of ``n`` characters of a large block (CJK, Hangul)."""
    rng = np.random.default_rng([seed, len(chars)])
    return "".join(chars[i] for i in sorted(rng.choice(len(chars), n, replace=False)))


@dataclass(frozen=True)
class Script:
    """How a language's pseudo-words are spelled."""

    letters: str
    mean_chars: float
    """Mean word length in characters (frequent words are shorter)."""
    comma: str = ","
    stop: str = "."


@functools.cache
def scripts() -> dict[str, Script]:
    """The pivot and the 20 languages, largest pair first."""
    return {
        "en": Script(_LATIN, 6.5),
        "de": Script(_LATIN + "äöüß", 6.5),
        "fr": Script(_LATIN + "éèêàçôûîëù", 5.5),
        "ru": Script(_span(0x0430, 0x044F) + "ё", 6.0),
        "zh": Script(_subset(_span(0x4E00, 0x9FFF), 6000, 1), 1.7, "，", "。"),
        "ar": Script(_span(0x0621, 0x064A), 4.5, "،"),
        "ja": Script(
            _span(0x3041, 0x3093) + _span(0x30A1, 0x30F3) + _subset(_span(0x4E00, 0x9FFF), 2000, 2),
            2.5,
            "、",
            "。",
        ),
        "ko": Script(_subset(_span(0xAC00, 0xD7A3), 2350, 3), 2.5),
        "el": Script(_span(0x03B1, 0x03C9) + "άέήίόύώ", 6.0),
        "he": Script(_span(0x05D0, 0x05EA), 4.5),
        "hi": Script(_span(0x0905, 0x0939) + _span(0x093E, 0x094C), 4.5, ",", "।"),
        "th": Script(_span(0x0E01, 0x0E2E) + _span(0x0E30, 0x0E39) + _span(0x0E40, 0x0E44), 6.0),
        "vi": Script(_LATIN + "ăâđêôơưàáảãạằắầấèéẻẽẹềếìíỉĩịòóỏõọồốờớùúủũụừứỳýỷỹỵ", 3.5),
        "tr": Script(_LATIN.translate({ord(c): None for c in "qwx"}) + "çğışöü", 6.5),
        "cs": Script(_LATIN + "áčďéěíňóřšťúůýž", 6.0),
        "ka": Script(_span(0x10D0, 0x10F0), 6.5),
        "hy": Script(_span(0x0561, 0x0586), 6.0),
        "bn": Script(_span(0x0985, 0x09B9) + _span(0x09BE, 0x09CC), 4.5, ",", "।"),
        "ta": Script(_span(0x0B85, 0x0BB9) + _span(0x0BBE, 0x0BCC), 5.5),
        "si": Script(_span(0x0D85, 0x0DC6) + _span(0x0DCF, 0x0DDF), 5.0),
        "am": Script(_span(0x1200, 0x135A), 4.0, "፣", "።"),
    }


def language_codes(n_pairs: int = 20) -> list[str]:
    """The non-English languages of a corpus of ``n_pairs`` pairs, largest pair first."""
    langs = [lang for lang in scripts() if lang != PIVOT]
    if not 1 <= n_pairs <= len(langs):
        raise DataError(f"--n-pairs must be in 1..{len(langs)}, got {n_pairs}")
    return langs[:n_pairs]


def train_sizes(total_pairs: int, n_pairs: int = 20) -> list[int]:
    """Training pairs per language pair: geometric, largest/smallest = :data:`SIZE_RATIO`
    (a ratio of 1 for one pair), summing to ``total_pairs``, each at least 1."""
    if total_pairs < n_pairs:
        raise DataError(f"--pairs must be at least --n-pairs ({n_pairs}), got {total_pairs}")
    r = SIZE_RATIO ** (-1 / (n_pairs - 1)) if n_pairs > 1 else 1.0
    w = r ** np.arange(n_pairs)
    raw = 1 + (total_pairs - n_pairs) * w / w.sum()
    sizes = np.floor(raw).astype(np.int64)
    short = total_pairs - int(sizes.sum())
    sizes[np.argsort(-(raw - sizes), kind="stable")[:short]] += 1
    return [int(s) for s in sizes]


@dataclass
class Vocab:
    """A language's words as one byte buffer: word ``i`` followed by a space is
    ``buf[off[i] : off[i] + size[i]]``; ``cdf`` draws Zipf ranks."""

    words: list[str]
    buf: np.ndarray
    off: np.ndarray
    size: np.ndarray
    cdf: np.ndarray

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` word ids with Zipf frequencies."""
        ids = np.searchsorted(self.cdf, rng.random(n, dtype=np.float64), side="right")
        return np.minimum(ids, len(self.words) - 1).astype(np.int32)


def make_vocab(lang: str, vocab_words: int, seed: int) -> Vocab:
    """``vocab_words`` distinct pseudo-words of ``lang`` (ids 1 and 3 are its comma and full
    stop), shorter ones more frequent, with a Zipf exponent in [1.0, 1.1)."""
    script = scripts()[lang]
    index = list(scripts()).index(lang)
    rng = np.random.default_rng([seed, index, 0])
    letters = np.array(list(script.letters))
    letter_p = 1.0 / np.arange(1, len(letters) + 1) ** 0.8
    letter_p = rng.permutation(letter_p / letter_p.sum())
    words: dict[str, None] = {}
    while len(words) < vocab_words - 2:
        n = vocab_words + 1000
        lengths = 1 + rng.poisson(script.mean_chars - 1, n)
        chars = rng.choice(letters, size=int(lengths.sum()), p=letter_p)
        ends = np.cumsum(lengths)
        for a, b in zip(ends - lengths, ends, strict=True):
            words.setdefault("".join(chars[a:b]), None)
    words.pop(script.comma, None)
    words.pop(script.stop, None)
    kept = list(words)[: vocab_words - 2]
    key = np.array([len(w) for w in kept]) + rng.normal(0.0, LENGTH_SPREAD, len(kept))
    ordered = [kept[i] for i in np.argsort(key, kind="stable")]
    ordered[1:1] = [script.comma]
    ordered[3:3] = [script.stop]
    encoded = [w.encode("utf-8") + b" " for w in ordered]
    size = np.array([len(e) for e in encoded], dtype=np.int64)
    s = 1.0 + 0.1 * rng.random()
    p = 1.0 / np.arange(1, vocab_words + 1) ** s
    return Vocab(
        words=ordered,
        buf=np.frombuffer(b"".join(encoded), dtype=np.uint8),
        off=np.cumsum(size) - size,
        size=size,
        cdf=np.cumsum(p) / p.sum(),
    )


def english_map(lang: str, vocab_words: int, seed: int) -> np.ndarray:
    """Word id of ``lang`` -> English word id: near the same rank (a local shuffle), the
    punctuation onto the punctuation."""
    rng = np.random.default_rng([seed, list(scripts()).index(lang), 1])
    core = np.setdiff1d(np.arange(vocab_words), [1, 3])
    jitter = rng.normal(0.0, 0.05 * core + 1.0)
    out = np.empty(vocab_words, dtype=np.int32)
    out[core] = core[np.argsort(core + jitter, kind="stable")]
    out[[1, 3]] = [1, 3]
    return out


def sentence_lengths(rng: np.random.Generator, n: int) -> np.ndarray:
    """Words per sentence: log-normal, median :data:`MEDIAN_WORDS`, clipped to 3..60."""
    x = np.rint(rng.lognormal(np.log(MEDIAN_WORDS), SIGMA_WORDS, n))
    return np.clip(x, MIN_WORDS, MAX_WORDS).astype(np.int64)


def render(vocab: Vocab, ids: np.ndarray, lengths: np.ndarray) -> bytes:
    """The sentences (``lengths`` words each, from ``ids`` in order) as UTF-8 lines."""
    size = vocab.size[ids]
    ends = np.cumsum(size)
    total = int(ends[-1])
    idx = np.repeat(vocab.off[ids] - (ends - size), size) + np.arange(total, dtype=np.int64)
    out = vocab.buf[idx]
    out[ends[np.cumsum(lengths) - 1] - 1] = ord("\n")
    return out.tobytes()


def chunks(
    src: Vocab, en: Vocab, to_en: np.ndarray, rng: np.random.Generator, count: int
) -> Iterator[tuple[bytes, bytes]]:
    """``count`` sentence pairs as (other side, English side) byte blocks of at most
    :data:`CHUNK` lines."""
    for start in range(0, count, CHUNK):
        n = min(CHUNK, count - start)
        lengths = sentence_lengths(rng, n)
        ids = src.sample(rng, int(lengths.sum()))
        en_ids = to_en[ids]
        replace = rng.random(len(ids)) < REPLACE_P
        en_ids[replace] = en.sample(rng, int(replace.sum()))
        first = np.cumsum(lengths) - lengths
        keep = rng.random(len(ids)) >= DROP_P
        keep[first] = True
        en_lengths = np.add.reduceat(keep.astype(np.int64), first)
        yield render(src, ids, lengths), render(en, en_ids[keep], en_lengths)


def _check(total_pairs: int, n_pairs: int, dev_size: int, test_size: int, vocab: int) -> None:
    for name, value, low in (
        ("total_pairs", total_pairs, 1),
        ("n_pairs", n_pairs, 1),
        ("dev_size", dev_size, 1),
        ("test_size", test_size, 1),
        ("vocab_words", vocab, 100),
    ):
        if not isinstance(value, (int, np.integer)) or value < low:
            raise DataError(f"{name} must be an integer >= {low}, got {value!r}")


def write_opus100_like(
    out_dir: str | Path,
    total_pairs: int,
    n_pairs: int = 20,
    seed: int = 1,
    dev_size: int = 2000,
    test_size: int = 2000,
    vocab_words: int = 50000,
    overwrite: bool = False,
) -> Path:
    """Write the corpus (module docstring) to ``out_dir`` and return it; a non-empty
    ``out_dir`` is refused unless ``overwrite`` and it is a corpus this project wrote."""
    _check(total_pairs, n_pairs, dev_size, test_size, vocab_words)
    langs = language_codes(n_pairs)
    sizes = train_sizes(total_pairs, n_pairs)
    out = Path(out_dir)
    check_output_dir(out, CORPUS_KIND, overwrite, [])
    summary = {
        "generator": CORPUS_TOOL,
        "seed": seed,
        "vocab_words": vocab_words,
        "total_pairs": total_pairs,
        "pairs": {},
    }
    with staged_output(out, CORPUS_TOOL, CORPUS_KIND, overwrite, []) as tmp:
        en = make_vocab(PIVOT, vocab_words, seed)
        for index, (lang, size) in enumerate(zip(langs, sizes, strict=True)):
            src = make_vocab(lang, vocab_words, seed)
            to_en = english_map(lang, vocab_words, seed)
            pair = pair_name(PIVOT, lang)
            base = tmp / "supervised" / pair
            base.mkdir(parents=True)
            for split_id, (split, count) in enumerate(
                (("train", size), ("dev", dev_size), ("test", test_size))
            ):
                rng = np.random.default_rng([seed, index, 2, split_id])
                with (
                    open(base / f"opus.{pair}-{split}.{lang}", "wb") as f_src,
                    open(base / f"opus.{pair}-{split}.{PIVOT}", "wb") as f_en,
                ):
                    for src_bytes, en_bytes in chunks(src, en, to_en, rng, count):
                        f_src.write(src_bytes)
                        f_en.write(en_bytes)
            summary["pairs"][pair] = {"train": size, "dev": dev_size, "test": test_size}
        with open(tmp / SUMMARY, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")
    return out
