"""tools/rehearse.py on tiny_cpu at 4 stages x 1 gloo rank: the four checks pass and the
table has its figures; a broken resume or checkpoint makes the tool exit 1; bad input exits 2."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest

from tests.pipeline.conftest import ROOT

pytestmark = pytest.mark.distributed

TOOL = str(ROOT / "tools" / "rehearse.py")
STEPS = 4


def _tool(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, TOOL, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    """One rehearsal of tiny_cpu (4 stages x 1, other topology 2 x 2): (out dir, process)."""
    out = tmp_path_factory.mktemp("rehearse")
    proc = _tool(
        "--config",
        "tiny_cpu",
        "--stages",
        "4",
        "--world",
        "4",
        "--steps",
        str(STEPS),
        "--workdir",
        str(out / "work"),
        "--json",
        str(out / "report.json"),
        "--markdown",
        str(out / "report.md"),
    )
    return out, proc


def test_rehearsal_passes_and_reports_its_figures(rehearsal):
    out, proc = rehearsal
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["ok"]
    assert [c["name"][:3] for c in report["checks"]] == ["(1)", "(2)", "(3)", "(4)"]
    assert all(c["ok"] for c in report["checks"]), report["checks"]
    f = report["figures"]
    assert f["topology"] == "4 stages x 1 data-parallel = 4 ranks"
    assert f["other_topology"] == "2 stages x 2 = 4 ranks"
    assert 0 < f["startup_s"] < 600 and 0 < f["update_s"] < f["startup_s"]
    peaks = f["peak_rss"]["uninterrupted"]
    assert 50 < peaks["mean_mb"] <= peaks["max_mb"] < peaks["sum_mb"]  # every rank measured
    assert f["save_signal_s"] is not None and f["save_end_s"] is not None
    assert set(f["build_s"]) >= {"uninterrupted", "resumed", "other_topology"}
    # tiny_cpu: 6 + 6 layers; 17 entries, of which the tied output shares the embedding's file
    assert f["checkpoint"]["layer_files"] >= 12 and f["checkpoint"]["bytes"] > 10_000
    assert f["translate_s"] > 0 and isinstance(f["translation"], str)
    # the resume really went through a SIGUSR1 checkpoint and both topologies resumed it
    runs = json.loads((out / "work" / "runs.json").read_text())["runs"]
    assert set(runs["interrupted"]["exit_codes"]) == {75}
    assert runs["resumed"]["resumed"]["step"] <= STEPS - 2
    assert "in another layout" in runs["other_topology"]["relayout"]
    assert "layout_warning" not in runs["other_topology"]  # no state started afresh
    table = (out / "report.md").read_text()
    for row in (
        "start-up: launch to first update",
        "time per update",
        "peak RSS per rank",
        "save: SIGUSR1",
        "checkpoint |",
        "PASS: steps 1-4",
    ):
        assert row in table, row
    assert "| (4) convert + translate | PASS" in proc.stdout


def test_a_failing_check_makes_the_tool_exit_1(rehearsal, tmp_path):
    """The same rehearsal, evaluated again after one resumed loss moved by one ulp and one
    layer file was corrupted: checks (2) and (4) fail and name what, (1) and (3) still pass."""
    out, proc = rehearsal
    assert proc.returncode == 0
    work = tmp_path / "work"
    shutil.copytree(out / "work", work)
    metrics = work / "interrupted" / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    for r in rows:
        if r.get("step") == STEPS and "loss" in r:
            r["loss"] = math.nextafter(r["loss"], math.inf)
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    layer = work / "interrupted" / f"global_step{STEPS}" / "layer_03-model_states.pt"
    data = bytearray(layer.read_bytes())
    data[len(data) // 2] ^= 0xFF
    layer.write_bytes(bytes(data))
    bad = _tool(
        "--config",
        "tiny_cpu",
        "--workdir",
        str(work),
        "--evaluate-only",
        "--json",
        str(tmp_path / "bad.json"),
    )
    assert bad.returncode == 1, bad.stdout[-2000:] + bad.stderr[-2000:]
    checks = {c["name"][:3]: c for c in json.loads((tmp_path / "bad.json").read_text())["checks"]}
    assert checks["(1)"]["ok"] and checks["(3)"]["ok"]
    assert not checks["(2)"]["ok"] and f"step {STEPS} loss" in checks["(2)"]["detail"]
    assert not checks["(4)"]["ok"]
    assert "layer_03-model_states.pt: checksum mismatch" in checks["(4)"]["detail"]
    assert "**FAIL**" in bad.stdout


def test_bad_topology_is_refused_with_exit_2(tmp_path):
    proc = _tool(
        "--config",
        "tiny_cpu",
        "--stages",
        "3",
        "--world",
        "4",
        "--workdir",
        str(tmp_path / "w"),
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: 3 pipeline stages do not divide the world size 4"
    )
    assert not (tmp_path / "w").exists()


def test_help():
    proc = _tool("--help", timeout=120)
    assert proc.returncode == 0 and "--world" in proc.stdout and "--evaluate-only" in proc.stdout
