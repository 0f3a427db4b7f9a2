"""The depth-by-scheme sweep (tools/sweep.py): 2 schemes x 2 depths of WMT17 En-De (its recipe
configs, narrowed) submitted to a real SLURM through slurm/tiny_cpu.sh, each cell its own job
and save_dir, collected into Table 1's layout beside the published figures; and how the table
decides "diverged"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_branchnorm.experiments import sweep
from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.formats.records import append_bleu_row
from tests.slurm.conftest import ROOT


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
    # by BLEU: the companion's best row of a checkpoint on disk; a run without one says so
    run = tmp_path / "branchnorm_6L" / "run"
    for step, bleu in ((2, 1.5), (4, 2.5)):
        tag = run / ckpt.tag_for(step)
        tag.mkdir()
        (tag / ckpt.MANIFEST).write_text(json.dumps({"step": step}))
        scoring = {"split": "dev", "sentences": 8}
        row = {"step": step, "checkpoint_id": ckpt.checkpoint_id(tag), "scoring": scoring}
        append_bleu_row(run, {**row, "valid_bleu": bleu})
    result = sweep.collect(tmp_path, "valid_bleu")
    assert result["cells"]["branchnorm_6L"]["value"] == 2.5
    assert result["cells"]["branchnorm_6L"]["step"] == 4
    assert result["cells"]["postln_6L"]["status"] == "no result"


def en_de_data(root: Path) -> Path:
    """A tiny WMT-style DATA_DIR: plain en-de text with its own dev and test, en->de only."""
    from megatron_branchnorm.commands import preprocess as preprocess_cmd
    from tests.data.conftest import sentences, write_lines

    raw = root / "raw" / "de-en"
    for split, n in (("train", 200), ("dev", 8), ("test", 8)):
        write_lines(raw / f"{split}.en", sentences("en", n, len(split)))
        write_lines(raw / f"{split}.de", sentences("de", n, 7 + len(split)))
    data = root / "data"
    args = ["--format", "plain", "--input", str(root / "raw"), "--langs", "de", "--directions"]
    args += ["en-de", "--output", str(data), "--vocab-size", "100", "--character-coverage", "1.0"]
    assert preprocess_cmd.main([*args, "--no-progress", "--workers", "1"]) == 0
    return data


# The task's recipe configs (wmt17_en_de_6L, _18L) at their real depths, narrowed for 2 CPU ranks.
RECIPE_TINY = (
    "model.hidden_size=16 model.ffn_hidden_size=32 model.num_attention_heads=2 "
    "data.max_tokens=256 data.max_length=48 train.micro_batches=2 pipeline.data_parallel=1 "
    "train.max_steps=2 "
    "train.eval_interval=2 train.save_interval=2 train.log_interval=1 train.patience=0 "
    "pipeline.activation_checkpoint_interval=0 train.deepspeed_config=ds_configs/cpu_fp32.json"
)


@pytest.mark.slow
@pytest.mark.distributed
def test_two_by_two_bilingual_sweep_on_slurm_beside_table_1(slurm_cluster, tmp_path):
    """postln and branchnorm at 6L-6L and 18L-18L of WMT17 En-De (its recipe configs, narrow,
    on a tiny plain-text en-de corpus), each a job of slurm/tiny_cpu.sh, collected into Table
    1's layout with the published column beside each depth."""
    data = en_de_data(tmp_path)
    out = tmp_path / "sweep"
    env = dict(slurm_cluster.env, VENV=str(ROOT / ".venv"))
    args = [sys.executable, str(ROOT / "tools" / "sweep.py"), "submit", "--task", "wmt17_en_de"]
    args += ["--launcher", str(ROOT / "slurm" / "tiny_cpu.sh"), "--schemes", "postln,branchnorm"]
    args += ["--depths", "6,18", "--out", str(out), "--extra", f"{RECIPE_TINY} data.dataset={data}"]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    sweep_json = json.loads((out / sweep.SWEEP_FILE).read_text())
    cells = sweep_json["cells"]
    assert sweep_json["task"] == "wmt17_en_de"
    assert sorted(cells) == ["branchnorm_18L", "branchnorm_6L", "postln_18L", "postln_6L"]
    for name, cell in cells.items():
        assert cell["config"] == f"wmt17_en_de_{cell['depth']}L"
        state = slurm_cluster.wait_job(cell["job_id"], 600)
        log = next((out / name).glob("*.out"), None)
        assert state == "COMPLETED", log.read_text()[-2000:] if log else "no log"
        saved = Path(cell["save_dir"]) / "global_step2" / "train_config.json"
        config = json.loads(saved.read_text())["config"]
        model = config["model"]
        assert (model["residual"], model["encoder_layers"]) == (cell["scheme"], cell["depth"])
        assert model["dropout"] == 0.4 and config["train"]["weight_decay"] == 1e-4  # the recipe's
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
    assert lines[0] == "| valid_loss | 6L-6L | paper | 18L-18L | paper |"
    published = {"postln": ("28.1", "diverged"), "branchnorm": ("29.x", "30.x")}
    for line, scheme in zip(lines[2:4], ("postln", "branchnorm"), strict=True):
        values = [x.strip() for x in line.strip("|").split("|")]
        assert values[0] == scheme and all(float(v) > 0 for v in values[1::2]), line
        assert tuple(values[2::2]) == published[scheme], line
    assert lines[-1].startswith("paper: WMT17 En-De, Table 1 of the BranchNorm paper")
