"""Validation BLEU from the companion process (tools/watch_bleu.py,
megatron_branchnorm/inference/valid_bleu.py): one row per checkpoint, the same BLEU as
converting and evaluating that checkpoint by hand, restart-safe, one companion per run."""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_branchnorm import checkpoint as ckpt
from megatron_branchnorm.commands import convert as convert_cmd
from megatron_branchnorm.commands import evaluate as evaluate_cmd
from megatron_branchnorm.commands import watch_bleu as watch_cmd
from megatron_branchnorm.inference import valid_bleu
from megatron_branchnorm.training.metrics import BLEU_FILE, read_metrics, valid_bleus
from tests.data.conftest import make_opus, run_preprocess

ROOT = Path(__file__).resolve().parents[2]
TRAIN = str(ROOT / "megatron_branchnorm" / "train.py")
STEPS = (2, 4, 6)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, Path]:
    """(save_dir, DATA_DIR): a 1L-1L model trained 6 updates on a tiny de-en corpus, saved
    at 2, 4 and 6."""
    root = tmp_path_factory.mktemp("valid_bleu")
    make_opus(root / "raw", {"de": (300, 10, 10)})
    manifest = run_preprocess(root / "raw", root / "data", ["de"], max_len=48)
    vocab = manifest["vocab_size"]
    save_dir = root / "run"
    overrides = [
        "model.encoder_layers=1",
        "model.decoder_layers=1",
        "model.hidden_size=32",
        "model.ffn_hidden_size=64",
        f"model.vocab_size={vocab}",
        f"data.dataset={root / 'data'}",
        "data.max_length=48",
        "train.max_steps=6",
        "train.save_interval=2",
        "train.eval_interval=0",
        "train.log_interval=1",
        f"train.save_dir={save_dir}",
    ]
    proc = subprocess.run(
        [sys.executable, TRAIN, "--config", "tiny_cpu", *overrides],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return save_dir, root / "data"


def test_every_checkpoint_scored_once_as_the_evaluator_scores_it(run, tmp_path, capsys):
    save_dir, data = run
    args = ["--checkpoint", str(save_dir), "--max-sentences", "8", "--beam", "2"]
    assert watch_cmd.main(args) == 0
    assert "3 checkpoint(s) scored" in capsys.readouterr().out
    rows = read_metrics(save_dir, strict=True, name=BLEU_FILE)
    assert [r["step"] for r in rows] == list(STEPS)
    assert all(set(r["directions"]) == {"de-en", "en-de"} for r in rows)
    for r in rows:
        assert r["valid_bleu"] == pytest.approx(sum(r["directions"].values()) / 2)
    # the same checkpoint converted and evaluated by hand gives the same scores
    export = tmp_path / "export"
    assert convert_cmd.main(["--checkpoint", str(save_dir), "--tag", "global_step4", "--output", str(export)]) == 0  # fmt: skip
    report = tmp_path / "eval.json"
    ev = ["--model", str(export), "--data", str(data), "--split", "dev", "--max-sentences", "8"]
    assert evaluate_cmd.main([*ev, "--beam", "2", "--json", str(report), "--quiet"]) == 0
    by_hand = json.loads(report.read_text())["directions"]
    assert rows[1]["directions"] == {k: v["bleu"] for k, v in by_hand.items()}
    assert rows[1]["chrf"] == {k: v["chrf"] for k, v in by_hand.items()}
    assert all(v > 0 for v in rows[1]["chrf"].values())  # real output: the check can fail
    assert rows[1]["signature"] == by_hand["de-en"]["signature"]
    # TensorBoard beside the trainer's curves
    assert list((save_dir / "tensorboard" / "valid_bleu").glob("events.out.tfevents.*"))
    # a restarted companion scores only what is missing
    capsys.readouterr()
    assert watch_cmd.main(args) == 0
    assert "0 checkpoint(s) scored" in capsys.readouterr().out
    assert len(read_metrics(save_dir, name=BLEU_FILE)) == 3


def test_follow_returns_once_the_finished_run_is_scored(run):
    save_dir, _ = run
    assert valid_bleu.run_finished(save_dir)  # a complete checkpoint at train.max_steps
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "watch_bleu.py"), "--checkpoint", str(save_dir)]
        + ["--max-sentences", "4", "--beam", "1", "--follow", "--poll-s", "0.1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert set(valid_bleus(save_dir)) == set(STEPS)


def test_one_companion_per_run(run, capsys):
    save_dir, _ = run
    with open(save_dir / watch_cmd.LOCK, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert watch_cmd.main(["--checkpoint", str(save_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "another watch_bleu.py is scoring this run" in err[0]


def test_a_checkpoint_removed_before_scoring_is_skipped(tmp_path, monkeypatch):
    gone = ckpt.tag_for(8)
    monkeypatch.setattr(valid_bleu, "unscored_tags", lambda save_dir: [gone])
    lines: list[str] = []
    assert valid_bleu.watch(tmp_path, valid_bleu.WatchOptions(data=str(tmp_path)), log=lines.append) == 0  # fmt: skip
    assert lines == [f"{tmp_path / gone}: removed before it was scored (retention): skipped"]
    assert not (tmp_path / BLEU_FILE).exists()


def test_bad_input_is_one_line(tmp_path, capsys):
    assert watch_cmd.main(["--checkpoint", str(tmp_path / "none")]) == 2
    assert watch_cmd.main(["--checkpoint", str(tmp_path), "--bleu", "tokenized", "--tokenize", "intl"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: --checkpoint {tmp_path / 'none'}: no such directory",
        "error: --tokenize applies to --bleu sacrebleu only",
    ]


def test_the_companion_job_script_scores_a_run(run, tmp_path):
    """slurm/watch_bleu.sh run as the job would run it (outside SLURM: no srun needed)."""
    save_dir, _ = run
    copy = tmp_path / "run"
    subprocess.run(["cp", "-r", str(save_dir), str(copy)], check=True)
    (copy / BLEU_FILE).unlink(missing_ok=True)
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "PYTHON": sys.executable,
        "SAVE_DIR": str(copy),
        "WATCH_ARGS": "--max-sentences 4 --beam 1 --poll-s 0.1",
    }
    proc = subprocess.run(
        ["bash", str(ROOT / "slurm" / "watch_bleu.sh")], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert set(valid_bleus(copy)) == set(STEPS)
    env.pop("SAVE_DIR")
    proc = subprocess.run(
        ["bash", str(ROOT / "slurm" / "watch_bleu.sh")], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "SAVE_DIR is not set" in proc.stderr
