"""metrics.jsonl's one reader (megatron_branchnorm/formats/records.py): tolerant for a line a
kill cut short, strict with the file and line named; and the run comparison behind
tools/compare_metrics.py and tools/same_runs.sh, blind to timings only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_branchnorm.formats.records import MetricsFileError, read_metrics
from megatron_branchnorm.training.metrics import first_difference, training_rows

ROOT = Path(__file__).resolve().parents[2]
ROWS = [
    {"step": 1, "loss": 5.0, "tokens_per_sec": 10.0, "elapsed_s": 1.0, "eta_s": 9.0},
    {"step": 1, "valid_loss": 4.0},
    {"step": 2, "skipped": True, "update": 2},
    {"step": 2, "loss": 4.5, "tokens_per_sec": 11.0, "memory_mb": 300.0},
]


def write(run: Path, rows: list[dict], tail: str = "") -> Path:
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    return run


def test_tolerant_and_strict_reading(tmp_path):
    run = write(tmp_path / "a", ROWS, '{"step": 3, "lo')  # the last line of a killed run
    assert read_metrics(run) == ROWS
    assert [r["step"] for r in training_rows(read_metrics(run))] == [1, 2]
    with pytest.raises(MetricsFileError, match=r"metrics.jsonl:5: not a JSON object"):
        read_metrics(run, strict=True)
    assert read_metrics(tmp_path / "none") == []
    with pytest.raises(MetricsFileError, match="missing"):
        read_metrics(tmp_path / "none", strict=True)


def test_runs_compared_without_their_timings(tmp_path):
    a = write(tmp_path / "a", ROWS)
    slower = [{**r, "tokens_per_sec": 1.0, "elapsed_s": 99.0} if "loss" in r else r for r in ROWS]
    assert first_difference(a, write(tmp_path / "b", slower)) is None
    changed = [dict(r) for r in ROWS]
    changed[3]["loss"] = 4.5000001
    assert first_difference(a, write(tmp_path / "c", changed)) == "row 4 (step 2): loss differ"
    assert first_difference(a, write(tmp_path / "d", ROWS[:3])) == "4 rows vs 3"
    tool = [sys.executable, str(ROOT / "tools" / "compare_metrics.py")]
    assert subprocess.run([*tool, str(a), str(tmp_path / "b")]).returncode == 0
    assert subprocess.run([*tool, str(a), str(tmp_path / "c")], capture_output=True).returncode == 1
    proc = subprocess.run([*tool, str(a), str(tmp_path / "x")], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ")
