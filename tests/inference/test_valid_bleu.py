"""Validation BLEU from the companion process (tools/watch_bleu.py,
megatron_branchnorm/inference/valid_bleu.py): one row per checkpoint, the same BLEU as
converting and evaluating that checkpoint by hand, restart-safe, one companion per run."""

from __future__ import annotations

import fcntl
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_branchnorm.commands import convert as convert_cmd
from megatron_branchnorm.commands import evaluate as evaluate_cmd
from megatron_branchnorm.commands import watch_bleu as watch_cmd
from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.formats.records import (
    BEST_FILE,
    BLEU_FILE,
    read_metrics,
    valid_bleus,
    validation_bleus,
)
from megatron_branchnorm.inference import valid_bleu
from megatron_branchnorm.training.retention import apply_retention
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
    pending = valid_bleu.Pending(gone, "0" * 64, str(tmp_path), [], {"split": "dev"})
    monkeypatch.setattr(valid_bleu, "pending_checkpoints", lambda save_dir, opts: [pending])
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


def test_a_device_this_machine_lacks_is_one_line(tmp_path, capsys, monkeypatch):
    """--device cuda without CUDA was a traceback once a checkpoint was scored."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:0", "tpu", ""):
        assert watch_cmd.main(["--checkpoint", str(tmp_path), "--device", device]) == 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert watch_cmd.main(["--checkpoint", str(tmp_path), "--device", "cuda:1"]) == 2
    out = capsys.readouterr()
    assert out.err.strip().splitlines() == [
        "error: --device cuda: no CUDA device on this machine; use --device cpu",
        "error: --device cuda:0: no CUDA device on this machine; use --device cpu",
        "error: --device 'tpu': expected cpu, cuda or cuda:N",
        "error: --device '': expected cpu, cuda or cuda:N",
        "error: --device cuda:1: this machine has 1 CUDA device(s)",
    ]
    assert "checkpoint(s) scored" not in out.out


def copy_run(save_dir: Path, dest: Path) -> Path:
    """The fixture's run without its BLEU rows."""
    shutil.copytree(save_dir, dest, ignore=shutil.ignore_patterns(BLEU_FILE, "tensorboard"))
    return dest


def rows_of(save_dir: Path) -> list[dict]:
    return read_metrics(save_dir, strict=True, name=BLEU_FILE)


def current_ids(save_dir: Path) -> dict[int, str]:
    complete, _ = ckpt.checkpoint_tags(save_dir)
    return {ckpt.tag_step(t): ckpt.checkpoint_id(save_dir / t) for t in complete}


QUICK = ["--max-sentences", "4", "--beam", "1"]


def test_a_test_split_run_then_a_default_run_scores_every_checkpoint(run, tmp_path, capsys):
    """Rows were keyed by step, so after --split test a default run scored nothing
    and keep_best ranked by test BLEU."""
    copy = copy_run(run[0], tmp_path / "run")
    args = ["--checkpoint", str(copy), *QUICK]
    assert watch_cmd.main([*args, "--split", "test"]) == 0
    assert watch_cmd.main(args) == 0
    assert watch_cmd.main([*args, "--max-sentences", "3"]) == 0  # other options: scored again
    assert watch_cmd.main(args) == 0  # a restart: nothing left under this key
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if "scored; rows in" in line] == [
        f"{n} checkpoint(s) scored; rows in {copy / BLEU_FILE}" for n in (3, 3, 3, 0)
    ]
    rows = rows_of(copy)
    ids = current_ids(copy)
    assert [(r["step"], r["scoring"]["split"], r["scoring"]["sentences"]) for r in rows] == [
        (s, split, n) for split, n in (("test", 4), ("dev", 4), ("dev", 3)) for s in STEPS
    ]
    assert all(r["checkpoint_id"] == ids[r["step"]] for r in rows)
    assert rows[0]["scoring"]["references_sha256"] != rows[3]["scoring"]["references_sha256"]
    assert {r["scoring"]["beam"] for r in rows} == {1}
    # ranking reads the dev rows of one scoring (the most recent of the equally complete ones)
    dev = {r["step"]: r["valid_bleu"] for r in rows[6:]}
    assert validation_bleus(copy, ids) == dev
    apply_retention(copy, keep_last=0, keep_best=3, metric="valid_bleu")
    best = json.loads((copy / BEST_FILE).read_text())["checkpoints"]
    assert sorted((c["tag"], c["valid_bleu"]) for c in best) == sorted((ckpt.tag_for(s), b) for s, b in dev.items())  # fmt: skip


def test_a_rewritten_checkpoint_is_scored_again(run, tmp_path, capsys):
    """After a rollback rewrote global_step6, the new step 6 was never scored and
    the deleted branch's score was used."""
    import torch

    copy = copy_run(run[0], tmp_path / "run")
    args = ["--checkpoint", str(copy), *QUICK]
    assert watch_cmd.main(args) == 0
    old = rows_of(copy)[-1]
    # the rollback: step 6 saved again with other weights (a different checksums.json)
    tag_dir = copy / ckpt.tag_for(6)
    layer = ckpt.layer_files(tag_dir)[min(ckpt.layer_files(tag_dir))]
    state = torch.load(layer, weights_only=True)
    key = next(k for k, v in state.items() if v.is_floating_point())
    state[key] = state[key] + 1.0
    torch.save(state, layer)
    ckpt.write_manifest(tag_dir, 6)
    new_id = ckpt.checkpoint_id(tag_dir)
    assert new_id != old["checkpoint_id"]
    capsys.readouterr()
    assert watch_cmd.main(args) == 0
    assert "1 checkpoint(s) scored" in capsys.readouterr().out
    rows = rows_of(copy)
    assert len(rows) == 4 and (rows[-1]["step"], rows[-1]["checkpoint_id"]) == (6, new_id)
    # only the new row counts for step 6; the old one ranks nothing
    ids = current_ids(copy)
    assert validation_bleus(copy, ids)[6] == rows[-1]["valid_bleu"]
    ids_before = {**ids, 6: old["checkpoint_id"]}
    assert validation_bleus(copy, ids_before)[6] == old["valid_bleu"]
    assert 6 not in validation_bleus(copy, {**ids, 6: "f" * 64})


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
