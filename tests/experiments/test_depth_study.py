"""The depth study (tools/depth_study.py) without launching DeepSpeed: the divergence
criterion, result parsing, the cell command (a valid config), resume, the report-only table and
PNG, CLI errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megatron_branchnorm.config import load_config
from megatron_branchnorm.experiments import depth_study as study


def rows(losses, grad=1.0, skipped=0):
    return [
        {"step": i + 1, "loss": x, "grad_norm": grad, "skipped_steps": skipped, "elapsed_s": i}
        for i, x in enumerate(losses)
    ]


DECREASING = [8.0 - 0.05 * i for i in range(40)]


@pytest.mark.parametrize(
    ("records", "rc", "status", "needle"),
    [
        (rows(DECREASING), 0, "ok", ""),
        (rows(DECREASING[:3]), 3, "diverged", "consecutive non-finite"),
        (
            rows(DECREASING) + [{"step": 40, "skipped": True, "skipped_steps": 1}],
            0,
            "diverged",
            "1 update",
        ),
        (rows([8.0, 7.0, math.nan, 7.5]), 0, "diverged", "non-finite loss at step 3"),
        (rows([8.0] + [7.0] * 20 + [9.0] * 5), 0, "diverged", "above the initial 8.000"),
        (rows([8.0] + [9.0] * 3 + [7.9] * 10), 0, "ok", ""),
        (rows(DECREASING), 1, "failed", "exit code 1"),
        ([], 0, "failed", "no training step"),
    ],
)
def test_judge(records, rc, status, needle):
    got, reason = study.judge(records, rc)
    assert got == status and needle in reason


def test_summarize_and_read_rows(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    recs = rows(DECREASING) + [{"step": 40, "valid_loss": 6.5}]
    recs[2]["grad_norm"] = math.inf
    text = "".join(json.dumps(r) + "\n" for r in recs) + '{"step": 41, "lo'  # torn last line
    metrics.write_text(text)
    parsed = study.read_rows(metrics)
    assert len(parsed) == 41 and study.read_rows(tmp_path / "none.jsonl") == []
    s = study.summarize(parsed, 0)
    assert s["status"] == "ok" and s["steps_done"] == 40 and s["valid_loss"] == 6.5
    assert s["initial_loss"] == 8.0 and s["min_loss"] == pytest.approx(DECREASING[-1])
    assert s["final_loss"] == pytest.approx(sum(DECREASING[-5:]) / 5)
    assert s["series"]["grad_norm"][2] is None and len(s["series"]["step"]) == 40
    assert s["train_s"] == 39


def test_cell_command_is_a_valid_config(tmp_path):
    args = study.parse_args(["--steps", "30", "--width", "32", "--lr", "0.01"])
    s = study.settings_of(args)
    assert s["branchnorm_steps"] == 15 and s["ffn"] == 128
    argv = study.cell_overrides("deepnorm", 50, s, tmp_path / "data", tmp_path / "run", 5.0)
    assert argv[:2] == ["--config", "tiny_cpu"]
    cfg = load_config("tiny_cpu", [a for a in argv[2:] if not a.startswith("data.dataset=")])
    assert (cfg.model.encoder_layers, cfg.model.decoder_layers, cfg.model.residual) == (
        50,
        50,
        "deepnorm",
    )
    assert (cfg.train.max_steps, cfg.train.lr, cfg.train.warmup_steps) == (30, 0.01, 0)
    assert cfg.train.log_interval == 1 and cfg.train.eval_interval == 30
    assert cfg.pipeline.stages == 2 and cfg.model.branchnorm_steps == 15
    name = study.cell_name("deepnorm", 50, s)
    assert name.startswith("deepnorm_50L_d32_lr0.01_wu0_s30")


def fake_result(cell_dir: Path, scheme: str, layers: int, s: dict, status="ok") -> None:
    cell_dir.mkdir(parents=True)
    r = {"scheme": scheme, "layers": layers, "settings": s, "returncode": 0, "wall_s": 30.0}
    r.update(study.summarize(rows(DECREASING), 0))
    r.update({"status": status, "time_limited": False})
    (cell_dir / study.RESULT).write_text(json.dumps(r))


def test_resume_and_report_only(tmp_path, capsys):
    args = study.parse_args(["--out", str(tmp_path), "--steps", "40"])
    s = study.settings_of(args)
    cells = tmp_path / "cells"
    for scheme in ("postln", "branchnorm"):
        fake_result(cells / study.cell_name(scheme, 6, s), scheme, 6, s)
    other = dict(s, lr=1.0)
    assert study.load_result(cells / study.cell_name("postln", 6, s), s) is not None
    assert study.load_result(cells / study.cell_name("postln", 6, s), other) is None
    # every cell is done: the run skips both (no launch) and writes the table and the PNG
    code = study.main(
        ["--out", str(tmp_path), "--steps", "40", "--schemes", "postln,branchnorm", "--depths", "6",
         "--data", str(make_manifest(tmp_path))]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and out.count("skipped") == 2
    assert "| postln | 6L-6L | ok | 40 | 8.000 |" in out
    assert (tmp_path / "grad_norm.png").stat().st_size > 1000
    code = study.main(["--out", str(tmp_path), "--report-only", "--depths", "6,50"])
    assert code == 0 and "| branchnorm | 6L-6L |" in capsys.readouterr().out


def test_report_only_names_the_settings_that_differ(tmp_path, capsys):
    s = study.settings_of(study.parse_args(["--steps", "40"]))
    hot = dict(s, lr=0.02, warmup=10)
    cells = tmp_path / "cells"
    for setting in (s, hot):
        for scheme in ("postln", "branchnorm"):
            fake_result(cells / study.cell_name(scheme, 6, setting), scheme, 6, setting)
    assert study.main(["--out", str(tmp_path), "--report-only", "--depths", "6"]) == 0
    out = capsys.readouterr().out
    assert "| scheme | layers | settings | status |" in out
    assert "| postln | 6L-6L | lr=0.005 wu=0 | ok |" in out
    assert "| branchnorm | 6L-6L | lr=0.02 wu=10 | ok |" in out
    # one setting: no settings column, as before
    assert study.setting_labels([{"settings": s}, {"settings": s}]) == ["", ""]
    assert "settings" not in study.table(
        [json.loads((cells / study.cell_name("postln", 6, s) / study.RESULT).read_text())], 5
    )


def make_manifest(root: Path) -> Path:
    data = root / "data"
    data.mkdir(exist_ok=True)
    (data / "manifest.json").write_text("{}")
    return data


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--schemes", "rezero"], "--schemes: unknown 'rezero'"),
        (["--depths", "6,x"], "--depths"),
        (["--depths", "0"], "--depths"),
        (["--width", "30", "--heads", "4"], "--width 30"),
        (["--data", "/nonexistent/data"], "manifest.json"),
        (["--report-only"], "no finished cells"),
    ],
)
def test_cli_errors(tmp_path, capsys, argv, needle):
    code = study.main(["--out", str(tmp_path), *argv])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
