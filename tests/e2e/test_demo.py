"""The whole chain on a tiny corpus (docs/design.md §4 budget: <= 3 min on 2 cores):
locale corpus -> preprocess -> 2-stage DeepSpeed training (2 CPU ranks, early + final
checkpoint) -> convert -> evaluate -> report.md with a BLEU row per direction, and the plots."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_branchnorm.experiments import probe_learning
from megatron_branchnorm.workflows.demo import DemoOptions, Status, run_demo

ROOT = Path(__file__).resolve().parents[2]
SPLIT_LINES = {"train": 1500, "dev": 40, "test": 8}


def tiny_corpus(tmp: Path) -> Path:
    """The built-in corpus for German, cut to a handful of sentences per split."""
    full = tmp / "full"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools/build_locale_corpus.py"),
            "--output",
            str(full),
            "--langs",
            "de",
        ],
        check=True,
        capture_output=True,
    )
    tiny = tmp / "tiny"
    for src in full.rglob("opus.*"):
        split = src.name.split("-")[-1].split(".")[0]
        dst = tiny / src.relative_to(full)
        dst.parent.mkdir(parents=True, exist_ok=True)
        lines = src.read_text(encoding="utf-8").splitlines(keepends=True)
        dst.write_text("".join(lines[: SPLIT_LINES[split]]), encoding="utf-8")
    return tiny


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object, str]:
    tmp = tmp_path_factory.mktemp("e2e")
    out = tmp / "demo"
    opts = DemoOptions(
        out=out,
        langs="de",
        config="tiny_cpu",
        minutes=0.15,
        early_fraction=0.3,
        vocab_size=300,
        eval_sentences=4,
        beam=2,
        corpus=tiny_corpus(tmp),
        overrides=[
            "data.max_length=48",
            "model.vocab_size=null",
            "train.eval_interval=4",
            "train.log_interval=1",
            "train.micro_batches=2",
        ],
    )
    stream = io.StringIO()
    result = run_demo(opts, Status(stream, every_s=0.0))
    return out, result, stream.getvalue()


def test_report_has_a_bleu_row_per_direction(demo_run) -> None:
    out, result, _ = demo_run
    report = (out / "report.md").read_text(encoding="utf-8")
    for row in ("| de->en |", "| en->de |", "| **X->En** |", "| **En->X** |", "| **average** |"):
        assert row in report
    assert "BLEU copy the source" in report and "signature" in report
    assert "nrefs:1|case:mixed" in report
    early, final = (int(result.tags[k].removeprefix("global_step")) for k in ("early", "final"))
    assert 1 <= early < final
    for name in ("early", "final", "copy-source"):
        data = json.loads((out / "eval" / f"{name}.json").read_text(encoding="utf-8"))
        assert set(data["directions"]) == {"de-en", "en-de"}
    assert (out / "eval" / "hyp_final" / "de-en.txt").is_file()
    assert (out / "data" / "manifest.json").is_file()


def test_report_measures_source_use(demo_run) -> None:
    out, result, _ = demo_run
    report = (out / "report.md").read_text(encoding="utf-8")
    assert "## Does the model read its source?" in report
    saved = json.loads((out / "eval" / "source-use.json").read_text(encoding="utf-8"))
    assert set(saved) == {"early", "final"} and saved == result.source
    for name, nll in saved.items():
        assert set(nll) == {"true", "shuffled", "empty"}
        assert all(0.0 < v < 20.0 for v in nll.values())
        worth = nll["shuffled"] - nll["true"]
        assert f"| {name} ({result.tags[name]}) | {nll['true']:.2f} |" in report
        assert f"| {worth:.2f} |" in report


def test_status_lines_and_plots(demo_run, tmp_path: Path) -> None:
    out, _, status = demo_run
    assert "elapsed" in status and "left" in status and "[6/7] evaluate final" in status
    png = out / "plots" / "training.png"
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    overlay = tmp_path / "two.png"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools/plot_training.py"),
            str(out / "train"),
            str(out / "train"),
            "--labels",
            "a,b",
            "--output",
            str(overlay),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert overlay.is_file()


def test_clis_refuse_bad_input(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools/plot_training.py"), str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "metrics.jsonl: missing" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools/run_demo.py"),
            "--layers",
            "x",
            "--out",
            str(tmp_path / "d"),
            "--corpus",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "--layers 'x'" in proc.stderr


def test_probe_learning_on_the_demo_data(demo_run, tmp_path: Path, capsys) -> None:
    """tools/probe_learning.py trains the flat model on a DATA_DIR and reports NLL, source use
    and BLEU per variant; a bad variant is a one-line error before any training."""
    out, _, _ = demo_run
    main = probe_learning.main
    tiny = "model.encoder_layers=1;model.decoder_layers=1;data.max_length=48;train.micro_batches=1"
    args = ["--config", "demo_cpu", "--data", str(out / "data"), "--device", "cpu"]
    jsonl = tmp_path / "probe.jsonl"
    rc = main(
        [*args, "--updates", "4", "--eval-every", "2", "--valid-batches", "1",
         "--bleu-sentences", "2", "--beam", "1", "--threads", "1", "--output", str(jsonl),
         "--variant", f"a={tiny}", "--variant", f"b={tiny};model.residual=postln"]
    )  # fmt: skip
    assert rc == 0
    recs = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [(r["variant"], r["step"]) for r in recs] == [("a", 2), ("a", 4), ("b", 2), ("b", 4)]
    for r in recs:
        assert r["valid_nll"] > 0 and abs(r["source_gain"]) < 10
        assert ("bleu" in r) == (r["step"] == 4)
    assert set(recs[-1]["bleu_dirs"]) == {"de-en", "en-de"}
    assert recs[0]["alpha"] == 1.0 / 10 * 2  # BranchNorm t=2 of T=10 (demo_cpu)
    assert recs[2]["alpha"] == 1.0  # Post-LN
    capsys.readouterr()
    assert main([*args, "--variant", "nameonly"]) == 2
    assert "--variant 'nameonly'" in capsys.readouterr().err
    assert main([*args, "--variant", "x=model.residual=bogus"]) == 2
    assert "model.residual" in capsys.readouterr().err
