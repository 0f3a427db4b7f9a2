"""Corpora fuzzing (fault 7): random mixes of bad input at 4000 lines per pair.

Each pair gets at most one fault, drawn at random: invalid UTF-8 on one side, an empty or
whitespace-only side, an over-long side, or harmless control characters (\\r, U+2028, NUL,
BOM, form feed, NEL) that must neither split nor shift lines. With ``--on-bad-utf8 skip``
every survivor must come back aligned and every drop must be counted under its filter;
1 and 2 workers must write the same bytes.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import sentencepiece as spm

from megatron_branchnorm.data import TranslationData
from megatron_branchnorm.data import preprocess as preprocess_mod
from megatron_branchnorm.data.text import clean
from tests.data.conftest import run_preprocess, sentences, write_lines

pytestmark = pytest.mark.faults

ODD = ["\r", "\u2028", "\x00", "\ufeff", "\x0c", "\x85"]
FAULTS = ("bad_utf8", "empty", "blank", "too_long", "odd", None, None, None)


def _fuzzed_pair_files(base: Path, lang: str, n: int, seed: int) -> dict:
    """Write a fuzzed en-``lang`` training set; return the expected survivors and drops."""
    rng = random.Random(seed)
    en, xx = sentences("en", n, seed), sentences(lang, n, seed + 1)
    en_bytes, xx_bytes = [], []
    expected, drops = [], {"bad_utf8": 0, "empty": 0, "too_long": 0}
    long_text = " ".join(sentences("en", 40, seed + 2))  # > 200 words, far over max_len
    for a, b in zip(en, xx, strict=True):
        fault = rng.choice(FAULTS)
        side = rng.randint(0, 1)
        pair = [a, b]
        raw = None
        if fault == "bad_utf8":
            raw = pair[side].encode() + b" \xff\xfe"
            drops["bad_utf8"] += 1
        elif fault in ("empty", "blank"):
            pair[side] = "" if fault == "empty" else " \t  "
            drops["empty"] += 1
        elif fault == "too_long":
            pair[side] = long_text
            drops["too_long"] += 1
        elif fault == "odd":
            words = pair[side].split(" ")
            k = rng.randint(0, len(words) - 1)
            words[k] = words[k] + rng.choice(ODD) + "x"
            pair[side] = " ".join(words)
        encoded = [p.encode() for p in pair]
        if raw is not None:
            encoded[side] = raw
        en_bytes.append(encoded[0])
        xx_bytes.append(encoded[1])
        if fault not in ("bad_utf8", "empty", "blank", "too_long"):
            expected.append((clean(pair[0]), clean(pair[1])))
    pair_name = "-".join(sorted(("en", lang)))
    (base / f"opus.{pair_name}-train.en").write_bytes(b"\n".join(en_bytes) + b"\n")
    (base / f"opus.{pair_name}-train.{lang}").write_bytes(b"\n".join(xx_bytes) + b"\n")
    for split in ("dev", "test"):
        write_lines(base / f"opus.{pair_name}-{split}.en", sentences("en", 10, seed + 5))
        write_lines(base / f"opus.{pair_name}-{split}.{lang}", sentences(lang, 10, seed + 6))
    return {"expected": expected, "drops": drops}


@pytest.mark.parametrize("seed", [11, 23])
def test_fuzzed_corpus_survivors_aligned_and_drops_counted(tmp_path: Path, seed, monkeypatch):
    monkeypatch.setattr(preprocess_mod, "CHUNK_LINES", 211)  # many chunks across workers
    raw = tmp_path / "raw"
    truth = {}
    for i, lang in enumerate(("de", "fr")):
        base = raw / "opus-100-corpus" / "v1.0" / "supervised" / "-".join(sorted(("en", lang)))
        base.mkdir(parents=True)
        truth[lang] = _fuzzed_pair_files(base, lang, 4000, seed * 10 + i)
    outs = {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        outs[workers] = run_preprocess(
            raw, out, ["de", "fr"], max_len=128, on_bad_utf8="skip", workers=workers
        )
    manifest = outs[2]
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "w2" / "spm.model"))
    data = TranslationData(str(tmp_path / "w2"), "train")
    for lang in ("de", "fr"):
        name = f"en-{lang}"
        g = data.directions.index(name)
        got = [
            (sp.decode(s.tolist()), sp.decode(t.tolist()))
            for s, t in (data.pair(g, i) for i in data.group_indices(g))
        ]
        assert got == truth[lang]["expected"]  # 100% of survivors aligned, order kept
        info = manifest["splits"]["train"]["pairs"]["-".join(sorted(("en", lang)))]
        assert info["filters"] == truth[lang]["drops"]
        assert info["raw_sentences"] == info["sentences"] + sum(info["filters"].values()) == 4000
    files = sorted(
        p.relative_to(tmp_path / "w1") for p in (tmp_path / "w1").rglob("*") if p.is_file()
    )
    for rel in files:
        assert (tmp_path / "w1" / rel).read_bytes() == (tmp_path / "w2" / rel).read_bytes(), rel
