"""The depth-by-scheme sweep (tools/sweep.py): 2 schemes x 2 depths submitted to a real
SLURM through slurm/tiny_cpu.sh, each cell its own job and save_dir, collected into one table;
and how the table decides "diverged"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_branchnorm.experiments import sweep
from tests.slurm.conftest import ROOT

TINY = (
    "model.hidden_size=16 model.ffn_hidden_size=32 model.num_attention_heads=2 "
    "train.max_steps=6 train.eval_interval=3 train.save_interval=3 train.log_interval=1"
)


def write_rows(save_dir: Path, rows: list[dict]) -> None:
    save_dir.mkdir(parents=True, exist_ok=True)
    (save_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_table_layout_and_divergence(tmp_path):
    cells = {}
    runs = {
        ("postln", 6): [{"step": 1, "loss": 5.0}, {"step": 2, "valid_loss": 4.0}],
        ("postln", 18): [{"step": 1, "loss": 5.0}, {"step": 2, "loss": float("nan")}],
        ("branchnorm", 6): [{"step": 1, "loss": 5.0}, {"step": 2, "valid_loss": 3.5}],
        # stopped on train.max_consecutive_skips: the last row is a skipped update
        ("branchnorm", 18): [{"step": 1, "loss": 5.0}, {"step": 1, "skipped": True, "update": 2}],
    }
    for (scheme, depth), rows in runs.items():
        save_dir = tmp_path / sweep.cell_name(scheme, depth) / "run"
        write_rows(save_dir, rows)
        cells[sweep.cell_name(scheme, depth)] = {"scheme": scheme, "depth": depth, "save_dir": str(save_dir)}  # fmt: skip
    (tmp_path / sweep.SWEEP_FILE).write_text(json.dumps({"cells": cells}))
    result = sweep.collect(tmp_path, "valid_loss")
    assert result["schemes"] == ["postln", "branchnorm"] and result["depths"] == [6, 18]
    paper = {"branchnorm": {"6": 28.1}}
    assert sweep.format_table(result).splitlines() == [
        "| valid_loss | 6L-6L | 18L-18L |",
        "| --- | ---: | ---: |",
        "| postln | 4.000 | diverged |",
        "| branchnorm | 3.500 | diverged |",
    ]
    assert sweep.format_table(result, paper).splitlines() == [
        "| valid_loss | 6L-6L | paper | 18L-18L | paper |",
        "| --- | ---: | ---: | ---: | ---: |",
        "| postln | 4.000 |  | diverged |  |",
        "| branchnorm | 3.500 | 28.1 | diverged |  |",
    ]
    # by BLEU: the companion's best row; a run without one says so
    (tmp_path / "branchnorm_6L" / "run" / "valid_bleu.jsonl").write_text(
        "".join(json.dumps({"step": s, "valid_bleu": b}) + "\n" for s, b in ((2, 1.5), (4, 2.5)))
    )
    result = sweep.collect(tmp_path, "valid_bleu")
    assert result["cells"]["branchnorm_6L"]["value"] == 2.5
    assert result["cells"]["branchnorm_6L"]["step"] == 4
    assert result["cells"]["postln_6L"]["status"] == "no result"


@pytest.mark.slow
@pytest.mark.distributed
def test_two_by_two_sweep_on_slurm(slurm_cluster, tmp_path):
    out = tmp_path / "sweep"
    env = dict(slurm_cluster.env, VENV=str(ROOT / ".venv"))
    args = [sys.executable, str(ROOT / "tools" / "sweep.py"), "submit", "--launcher"]
    args += [str(ROOT / "slurm" / "tiny_cpu.sh"), "--schemes", "postln,branchnorm"]
    args += ["--depths", "1,2", "--out", str(out), "--extra", TINY]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    cells = json.loads((out / sweep.SWEEP_FILE).read_text())["cells"]
    assert sorted(cells) == ["branchnorm_1L", "branchnorm_2L", "postln_1L", "postln_2L"]
    for name, cell in cells.items():
        state = slurm_cluster.wait_job(cell["job_id"], 600)
        log = next((out / name).glob("*.out"), None)
        assert state == "COMPLETED", log.read_text()[-2000:] if log else "no log"
        config = json.loads((Path(cell["save_dir"]) / "global_step6" / "train_config.json").read_text())  # fmt: skip
        model = config["config"]["model"]
        assert (model["residual"], model["encoder_layers"]) == (cell["scheme"], cell["depth"])
    # a second submit sends nothing again
    again = subprocess.run(args, env=env, capture_output=True, text=True, cwd=ROOT)
    assert again.returncode == 0 and again.stdout == ""
    table = out / "table.md"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "sweep.py"), "table", str(out)]
        + ["--metric", "valid_loss", "--markdown", str(table)],
        capture_output=True,
        text=True,
        env=dict(os.environ),
    )
    assert proc.returncode == 0, proc.stderr
    lines = table.read_text().splitlines()
    assert lines[0] == "| valid_loss | 1L-1L | 2L-2L |"
    for line, scheme in zip(lines[2:], ("postln", "branchnorm"), strict=True):
        values = [x.strip() for x in line.strip("|").split("|")][1:]
        assert line.startswith(f"| {scheme} |") and all(float(v) > 0 for v in values), line
