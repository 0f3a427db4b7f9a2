"""Evaluation: manifest references, sacreBLEU parity with its command line, the JSON report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_branchnorm.commands import evaluate as evaluate_cmd
from megatron_branchnorm.formats.data_dir import DataError
from megatron_branchnorm.inference.evaluate import (
    EvaluationError,
    Scoring,
    averages,
    bleu_tokenizer,
    choose_scoring,
    references_from_manifest,
    score_direction,
)

from .helpers import sentences

SACREBLEU = Path(sys.executable).with_name("sacrebleu")


def make_data_dir(root: Path, n: int = 6) -> Path:
    """A DATA_DIR with the layout of tools/preprocess_data.py: raw/<split>.<pair>.<lang> and
    manifest.json ``splits.<split>.references.<src>-<tgt>``."""
    data = root / "data"
    (data / "raw").mkdir(parents=True)
    text = sentences(n, seed=11)
    refs: dict[str, dict] = {}
    for pair, other in (("de-en", "de"), ("en-zh", "zh")):
        for lang in ("en", other):
            (data / "raw" / f"test.{pair}.{lang}").write_text(
                "".join(x + "\n" for x in text[lang]), encoding="utf-8"
            )
        for src, tgt in ((other, "en"), ("en", other)):
            refs[f"{src}-{tgt}"] = {
                "src": f"raw/test.{pair}.{src}",
                "tgt": f"raw/test.{pair}.{tgt}",
                "sentences": n,
            }
    manifest = {
        "format": "megatron_branchnorm-data",
        "pivot": "en",
        "languages": ["de", "en", "zh"],
        "splits": {"train": {}, "dev": {"references": {}}, "test": {"references": refs}},
    }
    (data / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    return data


def sacrebleu_cli(ref: Path, hyp: Path, *args: str) -> float:
    proc = subprocess.run(
        [str(SACREBLEU), str(ref), "-i", str(hyp), "-b", "-w", "4", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return float(proc.stdout.strip())


def test_references_from_manifest(tmp_path):
    data = make_data_dir(tmp_path)
    refs = references_from_manifest(data, "test")
    assert sorted(refs) == ["de-en", "en-de", "en-zh", "zh-en"]
    assert refs["en-zh"].ref_path == data / "raw" / "test.en-zh.zh"
    with pytest.raises(DataError, match="split 'dev' has no references"):
        references_from_manifest(data, "dev")
    with pytest.raises(DataError, match="no split 'valid'"):
        references_from_manifest(data, "valid")
    (data / "raw" / "test.de-en.de").unlink()
    with pytest.raises(DataError, match=r"test\.de-en\.de: missing"):
        references_from_manifest(data, "test")
    with pytest.raises(DataError, match=r"manifest\.json: missing"):
        references_from_manifest(tmp_path, "test")


def test_tokenizer_follows_target_language():
    assert bleu_tokenizer("zh") == "zh"
    assert bleu_tokenizer("ja") in ("ja-mecab", "char")
    assert bleu_tokenizer("de") == "13a"


@pytest.mark.parametrize(
    ("lang", "lowercase", "cli_args"),
    [
        ("en", False, ["-tok", "13a"]),
        ("en", True, ["-tok", "13a", "-lc"]),
        ("zh", False, ["-tok", "zh"]),
    ],
)
def test_bleu_equals_sacrebleu_command_line(tmp_path, lang, lowercase, cli_args):
    refs = sentences(20, seed=5)[lang]
    hyps = [r.lower() if i % 3 else r[: len(r) // 2] for i, r in enumerate(refs)]
    (tmp_path / "ref").write_text("".join(x + "\n" for x in refs), encoding="utf-8")
    (tmp_path / "hyp").write_text("".join(x + "\n" for x in hyps), encoding="utf-8")
    ours = score_direction(hyps, refs, lang, lowercase)
    assert 0 < ours["bleu"] < 100
    assert ours["bleu"] == pytest.approx(
        sacrebleu_cli(tmp_path / "ref", tmp_path / "hyp", *cli_args), abs=1e-4
    )
    assert f"tok:{cli_args[1]}" in ours["signature"]
    assert ("case:lc" in ours["signature"]) == lowercase


def test_averages():
    d = {
        name: {"bleu": b}
        for name, b in [("de-en", 10.0), ("zh-en", 20.0), ("en-de", 30.0), ("de-zh", 1.0)]
    }
    avg = averages(d, "en")
    assert avg == {"x-en": 15.0, "en-x": 30.0, "all": 15.25, "zero-shot": 1.0}
    assert averages({"de-en": {"bleu": 4.0}})["en-x"] is None


def test_evaluate_cli_json_hyps_and_sacrebleu_parity(tmp_path, text_export, monkeypatch, capsys):
    data = make_data_dir(tmp_path)
    out_json, hyp_dir = tmp_path / "res" / "test.json", tmp_path / "hyp"
    code = evaluate_cmd.main(
        [
            "--model",
            str(text_export),
            "--data",
            str(data),
            "--split",
            "test",
            "--json",
            str(out_json),
            "--hyp-dir",
            str(hyp_dir),
            "--directions",
            "de-en,en-zh",
            "--beam",
            "2",
            "--max-len-a",
            "0",
            "--max-len-b",
            "6",
            "--max-sentences",
            "4",
            "--threads",
            "1",
            "--quiet",
        ]
    )
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    report = json.loads(out_json.read_text(encoding="utf-8"))
    assert set(report) == {"directions", "averages", "scoring", "engine"}
    assert report["engine"] == "pytorch"
    # no paper task recognised: cased sacreBLEU, as before
    assert report["scoring"]["bleu"] == "sacrebleu" and not report["scoring"]["lowercase"]
    assert list(report["directions"]) == ["de-en", "en-zh"]
    for name, entry in report["directions"].items():
        assert set(entry) == {"bleu", "chrf", "signature"}
        assert entry["signature"].startswith("nrefs:1|case:mixed|")
        hyps = (hyp_dir / f"{name}.txt").read_text(encoding="utf-8").splitlines()
        assert len(hyps) == 4
    assert "tok:zh" in report["directions"]["en-zh"]["signature"]
    assert "tok:13a" in report["directions"]["de-en"]["signature"]
    assert set(report["averages"]) == {"x-en", "en-x", "all"}
    assert report["averages"]["x-en"] == report["directions"]["de-en"]["bleu"]
    assert "de-en" in stdout and "avg all" in stdout
    # evaluate.py's BLEU equals sacreBLEU's own command line on the same hypothesis file.
    ref = tmp_path / "ref.zh"
    ref.write_text("".join(x + "\n" for x in sentences(6, seed=11)["zh"][:4]), encoding="utf-8")
    cli = sacrebleu_cli(ref, hyp_dir / "en-zh.txt", "-tok", "zh")
    assert report["directions"]["en-zh"]["bleu"] == pytest.approx(cli, abs=1e-4)


def test_tokenized_bleu_known_values():
    """BLEU = BP * exp(mean log p_n) (Papineni et al., 2002), computed by hand."""
    from megatron_branchnorm.inference.evaluate import Scoring

    tokenized = Scoring(bleu="tokenized")
    # 6 tokens, 5 right: p1..p4 = 5/6, 4/5, 3/4, 2/3 -> (1/3)^(1/4)
    r = score_direction(["a b c d e f"], ["a b c d e g"], "en", scoring=tokenized)
    assert r["bleu"] == pytest.approx(100 * (1 / 3) ** 0.25, abs=1e-3)  # 75.98
    assert (
        r["signature"].startswith("moses-tok:en|compound-split:no|")
        and "tok:none" in r["signature"]
    )
    # Moses tokenisation of both sides: "world!" and "world !" are the same tokens
    assert score_direction(["Hello, big world!"], ["Hello , big world !"], "en", scoring=tokenized)["bleu"] == 100.0  # fmt: skip
    assert score_direction(["Hello, big world!"], ["Hello , big world !"], "en")["bleu"] == 100.0  # 13a too  # fmt: skip
    # compound splitting: without it the hyphenated word is one (matching) token of two
    hyp, ref = ["state-of-the-art system"], ["state-of-the-art method"]
    assert score_direction(hyp, ref, "de", scoring=tokenized)["bleu"] == 0.0
    split = score_direction(hyp, ref, "de", scoring=Scoring(bleu="tokenized", compound_split=True))
    # 8 tokens (##AT##-##AT## is one), 7 right: p = 7/8, 6/7, 5/6, 4/5 -> (1/2)^(1/4)
    assert split["bleu"] == pytest.approx(100 * 0.5**0.25, abs=1e-3)  # 84.09
    assert "compound-split:yes" in split["signature"]
    # cased unless asked
    assert score_direction(["A b c d"], ["a b c d"], "en", scoring=tokenized)["bleu"] < 100
    lower = Scoring(bleu="tokenized", lowercase=True)
    assert score_direction(["A b c d"], ["a b c d"], "en", scoring=lower)["bleu"] == 100.0


def test_sacrebleu_tokenizer_is_selectable_and_checked():
    from megatron_branchnorm.inference.evaluate import Scoring

    for tok in ("13a", "intl", "char"):
        Scoring(tokenize=tok).check()
        r = score_direction(["a b c d"], ["a b c d"], "en", scoring=Scoring(tokenize=tok))
        assert f"tok:{tok}" in r["signature"]
    for bad, needle in (
        (Scoring(tokenize="moses"), "--tokenize: unknown 'moses'"),
        (Scoring(bleu="tokenized", tokenize="13a"), "--tokenize applies to --bleu sacrebleu"),
        (Scoring(compound_split=True), "--compound-split applies to --bleu tokenized"),
    ):
        with pytest.raises(EvaluationError, match=needle):
            bad.check()


def test_evaluate_cli_errors(tmp_path, text_export, capsys):
    data = make_data_dir(tmp_path)
    main = evaluate_cmd.main
    cases = [
        (["--directions", "fr-en"], "fr-en"),
        (["--split", "valid"], "valid"),
        (["--max-sentences", "0"], "--max-sentences"),
        (["--tokenize", "moses"], "--tokenize: unknown"),
        (["--compound-split"], "--compound-split applies to --bleu tokenized"),
    ]
    for extra, needle in cases:
        code = main(["--model", str(text_export), "--data", str(data), "--quiet", *extra])
        err = capsys.readouterr().err
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    code = main(["--model", str(text_export), "--data", str(tmp_path / "none")])
    assert code == 2 and "manifest.json" in capsys.readouterr().err


def test_evaluate_cli_tokenized_bleu(tmp_path, text_export, capsys):
    data = make_data_dir(tmp_path)
    out_json = tmp_path / "tok.json"
    code = evaluate_cmd.main(
        ["--model", str(text_export), "--data", str(data), "--directions", "de-en",
         "--bleu", "tokenized", "--compound-split", "--max-sentences", "3", "--beam", "1",
         "--max-len-a", "0", "--max-len-b", "6", "--threads", "1", "--quiet",
         "--json", str(out_json)]
    )  # fmt: skip
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    sig = json.loads(out_json.read_text())["directions"]["de-en"]["signature"]
    assert sig.startswith("moses-tok:en|compound-split:yes|nrefs:1|case:mixed|")
    assert "moses + compound split" in stdout and f"signature: {sig}" in stdout


def _scoring_args(**kw):
    base = dict(bleu=None, tokenize=None, lowercase=False, compound_split=False, task="auto")
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize(("source", "task"), [("files", "wmt17_en_de"), ("held-out", None)])
def test_task_auto_takes_a_wmt_task_only_for_a_test_set_from_files(tmp_path, source, task):
    """An en-de DATA_DIR whose test set was held out of its training lines is not newstest2014:
    --task auto leaves it to the default sacreBLEU and says why; --task still forces it."""
    pairs = {"de-en": {"source": source}}
    manifest = {"directions": ["en-de"], "languages": ["de", "en"], "pivot": "en"}
    manifest["splits"] = {"test": {"pairs": pairs}, "dev": {"pairs": pairs}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    scoring, how = choose_scoring(_scoring_args(), tmp_path, "test")
    assert how["task"] == task and "newstest" not in how["chosen_by"]
    if task is None:
        assert scoring == Scoring() and "held out of the training lines" in how["chosen_by"]
    else:
        assert scoring.compound_split and how["task_directions"] == ["en-de"]
    forced, how = choose_scoring(_scoring_args(task="wmt17_en_de"), tmp_path, "test")
    assert forced.compound_split and how["task"] == "wmt17_en_de"


def test_task_scoring_applies_to_its_own_direction_and_zero_shot_is_labelled(
    tmp_path, text_export, capsys
):
    """--task wmt17_en_de on a multilingual DATA_DIR: en-de scored the WMT17 way, the other
    directions with the default sacreBLEU, the header naming what was scored; a direction the
    export did not train is evaluated, marked zero-shot and averaged apart."""
    from tests.inference.test_untrusted_exports import with_directions

    data = make_data_dir(tmp_path)
    model = with_directions(text_export, tmp_path / "exp", ["de-en", "en-de"])
    out_json = tmp_path / "r.json"
    code = evaluate_cmd.main(
        ["--model", str(model), "--data", str(data), "--task", "wmt17_en_de",
         "--directions", "de-en,en-de,en-zh", "--max-sentences", "2", "--beam", "1",
         "--max-len-a", "0", "--max-len-b", "4", "--threads", "1", "--quiet",
         "--json", str(out_json)]
    )  # fmt: skip
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    report = json.loads(out_json.read_text())
    sigs = {name: r["signature"] for name, r in report["directions"].items()}
    assert sigs["en-de"].startswith("moses-tok:de|compound-split:yes|")
    assert sigs["de-en"].startswith("nrefs:1|case:mixed|") and "tok:13a" in sigs["de-en"]
    assert "tok:zh" in sigs["en-zh"]
    how = report["scoring"]
    assert how["applies_to"] == ["en-de"] and how["default_for"] == ["de-en", "en-zh"]
    assert how["scored"] == f"the test split of {data}"
    assert "newstest" not in stdout
    assert f"scored: the test split of {data}: en-de" in stdout
    assert "scored: de-en, en-zh: default cased sacreBLEU (WMT17 En-De's scoring is for en-de only)" in stdout  # fmt: skip
    assert report["directions"]["en-zh"]["zero_shot"] is True
    assert "zero_shot" not in report["directions"]["de-en"]
    avg = report["averages"]
    assert avg["zero-shot"] == report["directions"]["en-zh"]["bleu"]
    assert avg["en-x"] == report["directions"]["en-de"]["bleu"]
    assert [x for x in stdout.splitlines() if "zero-shot: not trained" in x][0].startswith("en-zh")
