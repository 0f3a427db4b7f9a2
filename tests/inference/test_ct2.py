"""CTranslate2 exports: the same translations as our beam search (float32), close ones (int8),
translate.py and evaluate.py on them, and the refusals (Pre-LN, --quantization without
--format ctranslate2, an option only the other engine has, ctranslate2 missing, outputs).

The trained model is the shared copy-task model (tests/inference/conftest.py) with a
16-piece character SentencePiece model whose ids are the copy task's: ``<2zh>`` is its tag, ten
Chinese characters and ``▁`` its words, so a sentence of 1-5 characters is a copy-task source.
"""

from __future__ import annotations

import builtins
import io
import json
import random
import sys
from pathlib import Path

import pytest
from sacrebleu.metrics import BLEU

from megatron_branchnorm.commands import OUTPUT_OPTIONS
from megatron_branchnorm.commands import convert as convert_cmd
from megatron_branchnorm.commands import evaluate as evaluate_cmd
from megatron_branchnorm.commands import translate as translate_cmd
from megatron_branchnorm.formats import dirs
from megatron_branchnorm.inference.ct2 import CT2Error, CT2Translator, export_ct2, is_ct2_export
from megatron_branchnorm.inference.export import save_export
from megatron_branchnorm.inference.translate import SearchOptions, TranslateError, Translator
from megatron_branchnorm.model import build_model
from megatron_branchnorm.tokens import SPM_SPECIALS, lang_tag

from .helpers import COPY_TAG, COPY_VOCAB, tiny_config

pytest.importorskip("ctranslate2")
pytest.importorskip("transformers")

CHARS = "我你他是猫狗在上下大"
DIRECTIONS = ["zh-zh"]


@pytest.fixture(scope="module")
def copy_spm(tmp_path_factory) -> Path:
    """A character SentencePiece model whose 16 ids are the copy task's (tag 4 = <2zh>)."""
    import sentencepiece as spm

    root = tmp_path_factory.mktemp("copy_spm")
    rng = random.Random(0)
    lines = ["".join(rng.choice(CHARS) for _ in range(rng.randint(2, 8))) for _ in range(300)]
    (root / "text.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(root / "text.txt"), model_prefix=str(root / "spm"), vocab_size=COPY_VOCAB,
        model_type="char", **SPM_SPECIALS, user_defined_symbols=[lang_tag("zh")],
        character_coverage=1.0, num_threads=1, minloglevel=2,
    )  # fmt: skip
    sp = spm.SentencePieceProcessor(model_file=str(root / "spm.model"))
    assert sp.get_piece_size() == COPY_VOCAB and sp.piece_to_id("<2zh>") == COPY_TAG
    return root / "spm.model"


@pytest.fixture(scope="module")
def exports(tmp_path_factory, copy_model, copy_spm) -> dict[str, Path]:
    """The copy model as a native export and as CTranslate2 float32 and int8 exports."""
    root = tmp_path_factory.mktemp("ct2")
    meta = {"languages": ["zh"], "directions": DIRECTIONS, "source_checkpoint": "test"}
    out = {"native": save_export(copy_model, root / "native", copy_spm, meta)}
    for q in ("float32", "int8"):
        export_ct2(copy_model, root / q, copy_spm, meta, quantization=q)
        out[q] = root / q
    return out


def copy_sentences(n: int, seed: int) -> list[str]:
    """Copy-task sources as text: 1-5 characters (2-6 ids with the leading ``▁``)."""
    rng = random.Random(seed)
    return ["".join(rng.choice(CHARS) for _ in range(rng.randint(1, 5))) for _ in range(n)]


def bleu(hyps: list[str], refs: list[str]) -> float:
    return BLEU(tokenize="zh").corpus_score(hyps, [refs]).score


def test_export_directory(exports, copy_spm):
    out = exports["int8"]
    assert dirs.read_marker(out) == {"tool": "convert_checkpoint", "kind": "ct2_export"}
    names = {p.name for p in out.iterdir()}
    assert names == {dirs.MARKER, "model.bin", "config.json", "shared_vocabulary.json",
                     "spm.model", "export.json"}  # fmt: skip
    assert all(dirs.CT2_EXPORT.owns(n) for n in names)
    meta = json.loads((out / "export.json").read_text())
    assert meta["engine"] == "ctranslate2" and meta["quantization"] == "int8"
    assert meta["directions"] == DIRECTIONS and meta["residual"] == "postln"
    assert set(meta["sha256"]) == names - {dirs.MARKER, "export.json"}
    assert (out / "spm.model").read_bytes() == copy_spm.read_bytes()
    assert is_ct2_export(out) and not is_ct2_export(exports["native"])
    # int8 weights: about a quarter of float32's
    ratio = (out / "model.bin").stat().st_size / (exports["float32"] / "model.bin").stat().st_size
    assert ratio < 0.4, ratio
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temporary left


@pytest.mark.parametrize("beam", [4, 1])
def test_float32_gives_our_translations_and_int8_close_ones(exports, beam):
    lines = copy_sentences(200, seed=beam)
    ours = Translator.from_export(exports["native"])
    opts = SearchOptions(beam=beam)
    ref_hyps = ours.translate_hypotheses(lines, "zh", "zh", opts)
    theirs = CT2Translator(exports["float32"], threads=1)
    hyps = theirs.translate_hypotheses(lines, "zh", "zh", opts)
    same = sum(a[0].tokens == b[0].tokens for a, b in zip(ref_hyps, hyps, strict=True))
    assert same >= 0.98 * len(lines), same
    # the same length penalty, log p (EOS included) / (tokens + 1) ** lenpen, not
    # tokens ** lenpen nor GNMT's ((5 + tokens) / 6) ** lenpen: a hypothesis found with and
    # without the penalty has these two scores (the log-probabilities themselves differ from
    # ours by the banned tokens' mass: CTranslate2 renormalises over the others)
    raw = theirs.translate_hypotheses(lines, "zh", "zh", SearchOptions(beam=beam, lenpen=0.0))
    checked = 0
    for b, r in zip(hyps, raw, strict=True):
        if b[0].tokens == r[0].tokens:
            norm = (len(b[0].tokens) + 1) ** opts.lenpen
            assert b[0].score == pytest.approx(r[0].score / norm, rel=1e-4)
            checked += 1
    assert checked >= 0.9 * len(lines)
    ours_text = [ours.decode(h[0].tokens) for h in ref_hyps]
    ct2_text = [theirs.decode(h[0].tokens) for h in hyps]
    int8_text = CT2Translator(exports["int8"], threads=1).translate(lines, "zh", "zh", opts)
    assert ours_text.count("") == 0 and bleu(ours_text, lines) > 50  # a trained model
    assert abs(bleu(ct2_text, lines) - bleu(ours_text, lines)) <= 0.3
    assert abs(bleu(int8_text, lines) - bleu(ours_text, lines)) <= 1.0


def test_length_limit_nbest_and_batches(exports):
    """--max-len-a/-b bound the output as ours does; --nbest gives ranked hypotheses; the
    token budget splits batches without changing results."""
    lines = copy_sentences(12, seed=7)
    ct2 = CT2Translator(exports["float32"], threads=1)
    short = ct2.translate_hypotheses(lines, "zh", "zh", SearchOptions(max_len_a=0, max_len_b=2))
    assert all(0 < len(h[0].tokens) <= 2 for h in short)
    many = ct2.translate_hypotheses(lines, "zh", "zh", SearchOptions(nbest=3, batch_tokens=8))
    assert all(len(h) == 3 and h[0].score >= h[1].score >= h[2].score for h in many)
    one = ct2.translate_hypotheses(lines, "zh", "zh", SearchOptions())
    assert [h[0].tokens for h in many] == [h[0].tokens for h in one]


def _main(module, argv, monkeypatch, capsys, stdin: bytes = b"") -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    code = module.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_translate_command(exports, monkeypatch, capsys):
    lines = copy_sentences(6, seed=3)
    text = "".join(x + "\n" for x in ["", *lines]).encode()
    argv = ["--src-lang", "zh", "--tgt-lang", "zh", "--threads", "1"]
    code, out_ct2, err = _main(
        translate_cmd, ["--model", exports["float32"], *argv], monkeypatch, capsys, text
    )
    assert code == 0, err
    assert err.strip().splitlines()[-1] == "engine: ctranslate2 float32"
    code, out_pt, err = _main(
        translate_cmd, ["--model", exports["native"], *argv], monkeypatch, capsys, text
    )
    assert code == 0 and err.strip().splitlines()[-1] == "engine: pytorch"
    assert out_ct2 == out_pt and out_ct2.splitlines()[0] == ""
    code, out, err = _main(
        translate_cmd,
        ["--model", exports["int8"], *argv, "--compute-type", "float32", "--quiet"],
        monkeypatch, capsys, text,
    )  # fmt: skip
    assert code == 0 and err == "" and len(out.splitlines()) == len(lines) + 1


def test_refusals_in_one_line(exports, monkeypatch, capsys, tmp_path):
    argv = ["--src-lang", "zh", "--tgt-lang", "zh", "--threads", "1"]
    cases = [
        (["--model", exports["native"], *argv, "--compute-type", "int8"], "--compute-type"),
        (["--model", exports["int8"], "--src-lang", "zh", "--tgt-lang", "de"], "--tgt-lang de"),
        (["--model", exports["int8"], "--src-lang", "zh", "--tgt-lang", "zh", "--nbest", "5"],
         "--nbest"),
    ]  # fmt: skip
    for args, needle in cases:
        code, out, err = _main(translate_cmd, args, monkeypatch, capsys, b"ab\n")
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
        assert needle in lines[0] and out == ""
    # a CTranslate2 export with a modified file
    bad = tmp_path / "bad"
    bad.mkdir()
    for p in exports["int8"].iterdir():
        (bad / p.name).write_bytes(p.read_bytes())
    (bad / "shared_vocabulary.json").write_text('["x"]')
    with pytest.raises(CT2Error, match="shared_vocabulary.json: checksum mismatch"):
        CT2Translator(bad)


def test_untrained_direction_needs_zero_shot(copy_spm, copy_model, tmp_path):
    out = tmp_path / "ct2"
    export_ct2(copy_model, out, copy_spm, {"languages": ["zh"], "directions": ["de-zh"]})
    ct2 = CT2Translator(out)
    with pytest.raises(TranslateError, match="--zero-shot"):
        ct2.check_direction("zh", "zh")
    ct2.check_direction("zh", "zh", zero_shot=True)


def copy_data_dir(root: Path, n: int) -> Path:
    """A DATA_DIR whose one test direction zh-zh is the copy task (source = reference)."""
    data = root / "data"
    (data / "raw").mkdir(parents=True)
    text = "".join(x + "\n" for x in copy_sentences(n, seed=5))
    (data / "raw" / "test.zh").write_text(text, encoding="utf-8")
    refs = {"zh-zh": {"src": "raw/test.zh", "tgt": "raw/test.zh", "sentences": n}}
    manifest = {
        "format": "megatron_branchnorm-data", "pivot": "en", "languages": ["zh"],
        "splits": {"train": {}, "dev": {"references": {}}, "test": {"references": refs}},
    }  # fmt: skip
    (data / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    return data


def test_evaluate_command(exports, tmp_path, monkeypatch, capsys):
    data = copy_data_dir(tmp_path, 40)
    reports = {}
    for name in ("float32", "native"):
        report = tmp_path / f"{name}.json"
        argv = ["--model", exports[name], "--data", data, "--quiet", "--threads", "1",
                "--json", report]  # fmt: skip
        code, out, err = _main(evaluate_cmd, argv, monkeypatch, capsys)
        assert code == 0, err
        rows = out.splitlines()
        engine = "ctranslate2 float32" if name == "float32" else "pytorch"
        at = rows.index(f"engine: {engine}")
        assert rows[0].startswith("scoring:") and rows[at + 1].startswith("direction ")
        reports[name] = json.loads(report.read_text())
        assert reports[name]["engine"] == engine
    bleus = {k: r["directions"]["zh-zh"]["bleu"] for k, r in reports.items()}
    assert bleus["native"] > 50 and abs(bleus["float32"] - bleus["native"]) <= 0.3, bleus


def test_export_refuses_preln_and_leaves_nothing(copy_spm, tmp_path):
    model = build_model(tiny_config(vocab_size=COPY_VOCAB, residual="preln"), 1)
    with pytest.raises(CT2Error, match="Pre-LN") as exc:
        export_ct2(model, tmp_path / "out", copy_spm)
    assert "\n" not in str(exc.value)
    assert list(tmp_path.iterdir()) == []


def test_convert_refuses_quantization_without_ctranslate2_format(capsys):
    code = convert_cmd.main(["--checkpoint", "x", "--output", "y", "--quantization", "int8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "--quantization applies to --format ctranslate2 only" in err[0]


def test_convert_without_ctranslate2_says_how_to_install(tmp_path, monkeypatch, capsys):
    real_import = builtins.__import__

    def no_ct2(name, *args, **kwargs):
        if name == "ctranslate2" or name.startswith("ctranslate2."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ct2)
    argv = ["--checkpoint", tmp_path / "none", "--output", tmp_path / "out"]
    code = convert_cmd.main([str(a) for a in [*argv, "--format", "ctranslate2"]])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "pip install ctranslate2" in err[0]
    assert not (tmp_path / "out").exists()


def test_convert_output_placement(tmp_path, exports, monkeypatch, capsys):
    """commands.OUTPUT_OPTIONS declares convert's --output: with --format ctranslate2 it is
    refused over a run, a checkpoint, a native export, a user's folder, with or without
    --overwrite, before the checkpoint is read; an earlier CTranslate2 export is its own."""
    from tests.faults.test_output_placement import fake_export, fake_run, snapshot

    assert OUTPUT_OPTIONS["convert"] == {"--output": "dir"}
    run = fake_run(tmp_path / "run")
    user = tmp_path / "user"
    user.mkdir()
    (user / "mine.txt").write_text("notes\n")
    targets = [run, run / "global_step4", fake_export(tmp_path / "export"), user]
    ckpt = fake_run(tmp_path / "ckpt")
    before = snapshot(tmp_path)
    for target in targets:
        for extra in ([], ["--overwrite"]):
            argv = ["--checkpoint", ckpt, "--output", target, "--format", "ctranslate2", *extra]
            code = convert_cmd.main([str(a) for a in argv])
            err = capsys.readouterr().err.strip().splitlines()
            assert code == 2 and len(err) == 1 and f"--output {target}" in err[0], err
    assert snapshot(tmp_path) == before
    # an earlier CTranslate2 export is replaceable with --overwrite (it fails later: the fake
    # checkpoint has no weights, and the export is left as it was)
    own = tmp_path / "own"
    own.mkdir()
    for p in exports["int8"].iterdir():
        (own / p.name).write_bytes(p.read_bytes())
    argv = ["--checkpoint", ckpt, "--output", own, "--format", "ctranslate2"]
    code = convert_cmd.main([str(a) for a in argv])
    assert code == 2 and "--overwrite" in capsys.readouterr().err
    code = convert_cmd.main([str(a) for a in [*argv, "--overwrite"]])
    err = capsys.readouterr().err
    assert code == 2 and "checksums.json" in err and "--output" not in err, err
    assert snapshot(own) == snapshot(exports["int8"])


def test_translate_output_inside_a_ct2_export_is_refused(exports, tmp_path, monkeypatch, capsys):
    src = tmp_path / "in.zh"
    src.write_text("我你\n", encoding="utf-8")
    before = sorted(p.name for p in exports["int8"].iterdir())
    for target in (exports["int8"] / "out.txt", exports["int8"] / "config.json"):
        argv = ["--model", exports["int8"], "--src-lang", "zh", "--tgt-lang", "zh", "--input",
                src, "--output", target]  # fmt: skip
        code, out, err = _main(translate_cmd, argv, monkeypatch, capsys)
        assert code == 2 and f"--output {target}" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in exports["int8"].iterdir()) == before


def test_engines_benchmark_on_the_same_sentences(exports, tmp_path):
    """tools/benchmark.py --beam-engines: every engine on the same sentences; CTranslate2
    float32 generates what our beam search generates."""
    from megatron_branchnorm.experiments.bench_beam import ENGINES, bench_engines

    data = copy_data_dir(tmp_path, 8)
    res = bench_engines(str(exports["native"]), str(data), 8, isolate=False, configs=[(4, 1)])
    assert list(res["engines"]) == list(ENGINES)
    for key, ours in res["engines"]["ours"]["rows"].items():
        ct2 = res["engines"]["ct2 float32"]["rows"][key]
        assert ours["sentences"] == ct2["sentences"] == 8
        assert (ct2["tokens"], ct2["bleu"]) == (ours["tokens"], ours["bleu"]), key
        assert res["engines"]["hf"]["rows"][key]["tokens"] > 0
    sizes = res["model_bytes"]
    assert sizes["ct2 int8 model.bin"] < 0.5 * sizes["ct2 float32 model.bin"]
    rows = [x for x in res["table"].splitlines() if x.startswith("| ") and "---" not in x]
    assert len(rows) == 1 + len(ENGINES) * len(res["configs"])
    assert res["cpu"].startswith("CPU: ")
