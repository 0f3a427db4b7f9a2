"""Preprocessing: round trip, manifest counts, every bad-input case, atomic output, workers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from megatron_branchnorm.data import BatchSampler, DataError, TranslationData, read_references
from megatron_branchnorm.data import preprocess as preprocess_mod
from megatron_branchnorm.data.text import clean

from .conftest import make_opus, run_preprocess, sentences, write_lines

ROOT = Path(__file__).resolve().parents[2]


def _decode_split(data_dir: Path, split: str) -> dict[str, list[tuple[str, str]]]:
    """Every sample of every direction, decoded, in stored order."""
    data = TranslationData(str(data_dir), split)
    sp = spm.SentencePieceProcessor(model_file=str(data_dir / "spm.model"))
    out = {}
    for g, name in enumerate(data.directions):
        out[name] = [
            (sp.decode(s.tolist()), sp.decode(t.tolist()))
            for s, t in (data.pair(g, i) for i in data.group_indices(g))
        ]
    return out


def _odd_corpus(root: Path) -> tuple[list[str], list[str]]:
    """A de-en training set with odd characters, empty and over-long lines."""
    en = sentences("en", 300, 1)
    de = sentences("de", 300, 2)
    en[3] = "carriage\rreturn inside"
    de[4] = "line\u2028separator and nul\x00 inside"
    en[5] = "\ufeffbom at start"
    de[6] = "form\x0cfeed \x85 next line"
    en[10] = ""  # empty source: pair dropped
    de[11] = "   \t "  # empty after cleaning: pair dropped
    en[12] = " ".join(sentences("en", 60, 3))  # far over max_len
    de[13] = " ".join(sentences("de", 60, 4))
    base = root / "opus-100-corpus" / "v1.0" / "supervised" / "de-en"
    write_lines(base / "opus.de-en-train.en", en)
    write_lines(base / "opus.de-en-train.de", de)
    for split, n in (("dev", 12), ("test", 9)):
        e, d = sentences("en", n, 7 + n), sentences("de", n, 8 + n)
        e[1] = ""  # kept in the raw references
        d[2] = "ref\rwith cr"
        write_lines(base / f"opus.de-en-{split}.en", e)
        write_lines(base / f"opus.de-en-{split}.de", d)
    return en, de


def test_round_trip_and_counts(tmp_path: Path) -> None:
    en, de = _odd_corpus(tmp_path / "raw")
    m = run_preprocess(tmp_path / "raw", tmp_path / "out", ["de"], max_len=40)
    expected = []
    for a, b in zip(en, de, strict=True):
        a, b = clean(a), clean(b)
        if a and b and len(a.split()) < 30 and len(b.split()) < 30:
            expected.append((a, b))
    got = _decode_split(tmp_path / "out", "train")
    assert got["en-de"] == expected
    assert got["de-en"] == [(b, a) for a, b in expected]
    train = m["splits"]["train"]["pairs"]["de-en"]
    assert train["filters"] == {"bad_utf8": 0, "empty": 2, "too_long": 2}
    assert train["raw_sentences"] == 300 == train["sentences"] + sum(train["filters"].values())
    assert train["sentences"] == len(expected)
    assert m["splits"]["train"]["filters"]["too_long"] == 2
    # dev/test: never length-filtered; the raw references keep every line.
    for split, n in (("dev", 12), ("test", 9)):
        info = m["splits"][split]["pairs"]["de-en"]
        assert info["raw_sentences"] == n and info["filters"]["empty"] == 1
        src, ref = read_references(tmp_path / "out", split, "de-en")
        assert len(src) == len(ref) == n and ref[1] == "" and src[2] == "ref with cr"


def test_manifest_fields(small_data) -> None:
    data_dir, raw = small_data
    m = json.loads((data_dir / "manifest.json").read_text())
    assert m["languages"] == ["de", "en", "fr"]
    assert m["directions"] == ["de-en", "en-de", "en-fr", "fr-en"]
    assert m["pairs"] == ["de-en", "en-fr"]
    sp = spm.SentencePieceProcessor(model_file=str(data_dir / m["spm_model"]))
    assert m["vocab_size"] == sp.get_piece_size()
    assert [sp.id_to_piece(i) for i in range(4)] == ["<pad>", "<unk>", "<s>", "</s>"]
    assert {lang: sp.id_to_piece(t) for lang, t in m["tag_ids"].items()} == {
        "de": "<2de>",
        "en": "<2en>",
        "fr": "<2fr>",
    }
    assert m["dtype"] == "uint16"
    for split, info in m["splits"].items():
        assert info["sentences"] == sum(p["sentences"] for p in info["pairs"].values())
        for name, p in info["pairs"].items():
            assert p["raw_sentences"] == p["sentences"] + sum(p["filters"].values())
            lang = name.replace("en", "").strip("-")
            assert p["raw_sentences"] == len(raw[lang][split][0])
        for d in info["directions"].values():
            assert (data_dir / f"{d['src']}.bin").is_file() and (
                data_dir / f"{d['tgt']}.idx"
            ).is_file()
        if split != "train":
            assert set(info["references"]) == set(m["directions"])
    assert m["splits"]["train"]["directions"]["de-en"]["src"] == "bin/train.de-en.de"
    assert m["spm"]["sample_sentences"]["en"] > 0


def test_line_count_mismatch(tmp_path: Path) -> None:
    make_opus(tmp_path / "raw", {"de": (50, 5, 5)})
    base = tmp_path / "raw" / "opus-100-corpus" / "v1.0" / "supervised" / "de-en"
    write_lines(base / "opus.de-en-train.de", sentences("de", 49, 0))
    with pytest.raises(DataError) as err:
        run_preprocess(tmp_path / "raw", tmp_path / "out", ["de"])
    msg = str(err.value)
    assert "opus.de-en-train.en has 50 lines" in msg and "opus.de-en-train.de has 49" in msg
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["raw"]


def _bad_utf8_corpus(root: Path) -> Path:
    make_opus(root, {"de": (60, 5, 5)})
    f = root / "opus-100-corpus" / "v1.0" / "supervised" / "de-en" / "opus.de-en-train.de"
    lines = f.read_bytes().split(b"\n")
    lines[6] = b"caf\xe9 latin-1"
    f.write_bytes(b"\n".join(lines))
    return f


def test_invalid_utf8_error(tmp_path: Path) -> None:
    _bad_utf8_corpus(tmp_path / "raw")
    with pytest.raises(DataError, match=r"opus\.de-en-train\.de:7: invalid UTF-8"):
        run_preprocess(tmp_path / "raw", tmp_path / "out", ["de"])
    assert not (tmp_path / "out").exists()


def test_invalid_utf8_skip_and_replace(tmp_path: Path) -> None:
    _bad_utf8_corpus(tmp_path / "raw")
    m = run_preprocess(tmp_path / "raw", tmp_path / "skip", ["de"], on_bad_utf8="skip")
    p = m["splits"]["train"]["pairs"]["de-en"]
    assert p["filters"]["bad_utf8"] == 1 and p["sentences"] == 59
    got = _decode_split(tmp_path / "skip", "train")["en-de"]
    assert all("caf" not in t for _, t in got)
    m = run_preprocess(tmp_path / "raw", tmp_path / "repl", ["de"], on_bad_utf8="replace")
    p = m["splits"]["train"]["pairs"]["de-en"]
    assert p["filters"]["bad_utf8"] == 0 and p["bad_utf8_replaced"] == 1 and p["sentences"] == 60


def test_language_without_files(tmp_path: Path) -> None:
    make_opus(tmp_path / "raw", {"de": (30, 5, 5)})
    with pytest.raises(DataError, match=r"--langs fr: no data for pair en-fr"):
        run_preprocess(tmp_path / "raw", tmp_path / "out", ["de", "fr"])


def test_missing_split(tmp_path: Path) -> None:
    make_opus(tmp_path / "raw", {"de": (30, 5, 5)})
    base = tmp_path / "raw" / "opus-100-corpus" / "v1.0" / "supervised" / "de-en"
    (base / "opus.de-en-dev.de").unlink()
    with pytest.raises(DataError, match=r"opus\.de-en-dev\.de: missing dev split of pair de-en"):
        run_preprocess(tmp_path / "raw", tmp_path / "out", ["de"])


def test_output_not_empty_and_overwrite(tmp_path: Path) -> None:
    make_opus(tmp_path / "raw", {"de": (40, 5, 5)})
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("x")
    with pytest.raises(DataError, match="exists and is not empty"):
        run_preprocess(tmp_path / "raw", tmp_path / "out", ["de"])
    # --overwrite replaces only a DATA_DIR this tool wrote, never a user's directory.
    with pytest.raises(DataError, match="was not written as data by this project"):
        run_preprocess(tmp_path / "raw", tmp_path / "out", ["de"], overwrite=True)
    assert (tmp_path / "out" / "keep").read_text() == "x"
    (tmp_path / "out" / "keep").unlink()
    run_preprocess(tmp_path / "raw", tmp_path / "out", ["de"])
    # ... and only when it holds nothing but a DATA_DIR's entries (formats/dirs.py)
    (tmp_path / "out" / "stale").write_text("x")
    with pytest.raises(DataError, match=r"also holds what data never writes \(stale\)"):
        run_preprocess(tmp_path / "raw", tmp_path / "out", ["de"], overwrite=True)
    assert (tmp_path / "out" / "stale").read_text() == "x"
    (tmp_path / "out" / "stale").unlink()
    run_preprocess(tmp_path / "raw", tmp_path / "out", ["de"], overwrite=True)
    assert (tmp_path / "out" / "manifest.json").is_file()


def test_interrupted_run_leaves_no_output(tmp_path: Path, monkeypatch) -> None:
    make_opus(tmp_path / "raw", {"de": (40, 5, 5)})

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(preprocess_mod, "encode_all", boom)
    with pytest.raises(KeyboardInterrupt):
        run_preprocess(tmp_path / "raw", tmp_path / "out", ["de"])
    assert [p.name for p in tmp_path.iterdir()] == ["raw"]


def test_same_bytes_with_one_and_two_workers(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(preprocess_mod, "CHUNK_LINES", 37)  # many chunks across workers
    make_opus(tmp_path / "raw", {"de": (400, 20, 20), "fr": (200, 20, 20)})
    run_preprocess(tmp_path / "raw", tmp_path / "w1", ["de", "fr"], workers=1)
    run_preprocess(tmp_path / "raw", tmp_path / "w2", ["de", "fr"], workers=2)
    files1 = sorted(
        p.relative_to(tmp_path / "w1") for p in (tmp_path / "w1").rglob("*") if p.is_file()
    )
    files2 = sorted(
        p.relative_to(tmp_path / "w2") for p in (tmp_path / "w2").rglob("*") if p.is_file()
    )
    assert files1 == files2 and len(files1) > 20
    for rel in files1:
        assert (tmp_path / "w1" / rel).read_bytes() == (tmp_path / "w2" / rel).read_bytes(), rel


def test_moses_with_held_out_splits(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    en, de = sentences("en", 300, 1), sentences("de", 300, 2)
    write_lines(raw / "MultiUN.de-en.en", en)
    write_lines(raw / "MultiUN.de-en.de", de)
    m = run_preprocess(raw, tmp_path / "out", ["de"], fmt="moses", dev_size=20, test_size=25)
    sizes = {s: m["splits"][s]["pairs"]["de-en"]["raw_sentences"] for s in ("train", "dev", "test")}
    assert sizes == {"train": 255, "dev": 20, "test": 25}
    assert m["splits"]["train"]["pairs"]["de-en"]["source"] == "held-out"
    src, ref = read_references(tmp_path / "out", "test", "de-en")
    pairs = set(zip(de, en, strict=True))
    assert all(p in pairs for p in zip(src, ref, strict=True))
    train = {(clean(a), clean(b)) for a, b in _decode_split(tmp_path / "out", "train")["de-en"]}
    assert not train & set(zip(src, ref, strict=True))


def test_moses_with_given_splits_and_missing_one(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    for name, n in (("MultiUN", 100), ("Europarl", 50), ("dev", 10), ("newstest-test", 8)):
        write_lines(raw / f"{name}.de-en.en", sentences("en", n, n))
        write_lines(raw / f"{name}.de-en.de", sentences("de", n, n + 1))
    m = run_preprocess(raw, tmp_path / "out", ["de"], fmt="moses")
    sizes = {s: m["splits"][s]["pairs"]["de-en"]["raw_sentences"] for s in ("train", "dev", "test")}
    assert sizes == {"train": 150, "dev": 10, "test": 8}
    (raw / "newstest-test.de-en.en").unlink()
    (raw / "newstest-test.de-en.de").unlink()
    with pytest.raises(DataError, match="missing test split of pair de-en"):
        run_preprocess(raw, tmp_path / "out2", ["de"], fmt="moses")
    (raw / "Europarl.de-en.de").unlink()
    with pytest.raises(DataError, match=r"Europarl\.de-en\.de: missing"):
        run_preprocess(raw, tmp_path / "out3", ["de"], fmt="moses")


def test_plain_format(tmp_path: Path) -> None:
    raw = tmp_path / "raw" / "en-fr"
    for split, n in (("train", 80), ("dev", 6), ("test", 7)):
        write_lines(raw / f"{split}.en", sentences("en", n, n))
        write_lines(raw / f"{split}.fr", sentences("fr", n, n + 3))
    m = run_preprocess(tmp_path / "raw", tmp_path / "out", ["fr"], fmt="plain")
    assert m["directions"] == ["en-fr", "fr-en"]
    assert m["splits"]["test"]["pairs"]["en-fr"]["sentences"] == 7


def test_vocab_too_large_is_a_clear_error(tmp_path: Path) -> None:
    make_opus(tmp_path / "raw", {"de": (30, 5, 5)})
    with pytest.raises(DataError, match="SentencePiece training .* failed: .*[Vv]ocabulary size"):
        run_preprocess(tmp_path / "raw", tmp_path / "out", ["de"], vocab_size=50000)
    assert not (tmp_path / "out").exists()


def _cli(tool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / tool), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_help_and_one_line_error(tmp_path: Path) -> None:
    for tool in ("preprocess_data.py", "build_locale_corpus.py"):
        r = _cli(tool, "--help")
        assert r.returncode == 0 and "usage:" in r.stdout
    make_opus(tmp_path / "raw", {"de": (20, 5, 5)})
    base = tmp_path / "raw" / "opus-100-corpus" / "v1.0" / "supervised" / "de-en"
    write_lines(base / "opus.de-en-test.de", ["only one line"])
    r = _cli(
        "preprocess_data.py",
        "--format",
        "opus100",
        "--input",
        str(tmp_path / "raw"),
        "--langs",
        "de",
        "--output",
        str(tmp_path / "out"),
        "--vocab-size",
        "100",
    )
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "opus.de-en-test.de has 1" in lines[0], r.stderr
    assert not (tmp_path / "out").exists()


def test_cli_success(tmp_path: Path) -> None:
    make_opus(tmp_path / "raw", {"fr": (60, 5, 5)})
    r = _cli(
        "preprocess_data.py",
        "--format",
        "opus100",
        "--input",
        str(tmp_path / "raw"),
        "--langs",
        "fr",
        "--output",
        str(tmp_path / "out"),
        "--vocab-size",
        "100",
        "--character-coverage",
        "1.0",
        "--workers",
        "2",
    )
    assert r.returncode == 0, r.stderr
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert "--workers 2" in m["command"] and m["vocab_size"] == 100
    data = TranslationData(str(tmp_path / "out"))
    batches = list(BatchSampler(data, 256, 5.0, seed=0, shuffle=False))
    assert sum(len(b["ids"]) for b in batches) == 120
    assert np.unique(np.concatenate([b["ids"].numpy() for b in batches])).size == 120
