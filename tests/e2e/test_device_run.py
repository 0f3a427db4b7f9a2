"""tools/device_run.sh as a lent GPU machine runs it, rehearsed on the CPU in that machine's
layout: the interpreter is a virtual environment's and holds torch (this test's own
interpreter), the wheelhouse is carried, there is no package index. The install must add only
the wheels the interpreter lacks, on PYTHONPATH, never replace what it has, and check the
imports before anything else; the one-call plan must fit its 9 minutes."""

from __future__ import annotations

import base64
import hashlib
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "device_run.sh"


def make_wheel(where: Path, name: str, version: str, code: str) -> Path:
    """A pure-Python wheel of one module ``name`` holding ``code``."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": code,
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = hashlib.sha256(text.encode()).digest()
        b64 = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
        record.append(f"{path},sha256={b64},{len(text.encode())}")
    files[f"{dist}/RECORD"] = "\n".join([*record, f"{dist}/RECORD,,"]) + "\n"
    wheel = where / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return wheel


def run(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    base = {
        "OUT": str(tmp_path / "out"),
        "WORK": str(tmp_path / "work"),
        "SITE": str(tmp_path / "site"),
        "WHEELHOUSE": str(tmp_path / "wheelhouse"),
        "PYTHON": sys.executable,
        "PIP_NO_INDEX": "1",  # no network there
        "DEVICE": "cpu",
    }
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        env={**os.environ, **base, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_one_call_plan_fits_nine_minutes_by_its_own_budgets(tmp_path) -> None:
    proc = run(tmp_path, "plan")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    budgets = re.findall(r"^  (\w+) +(\d+) s", proc.stdout, re.M)
    names = [n for n, _ in budgets]
    assert names[:4] == ["install", "graphs_check", "bench_train", "anchors"]  # first things
    assert names.index("compile") > names.index("precision")  # the compile variant late
    assert sum(int(b) for _, b in budgets) <= 540
    assert proc.stdout.strip().endswith("fits")
    tight = run(tmp_path, "plan", TOTAL_S="300")
    assert tight.returncode == 1 and "does not fit" in tight.stdout


def test_install_adds_only_what_the_venv_lacks_and_checks_the_imports(tmp_path) -> None:
    wheels = tmp_path / "wheelhouse"
    wheels.mkdir()
    make_wheel(wheels, "mbn_fake_missing", "1.0", "VALUE = 7\n")
    # what the device's venv already has must never be replaced (its torch, its numpy)
    make_wheel(wheels, "numpy", "0.0.1", "raise ImportError('the fake numpy was installed')\n")
    make_wheel(wheels, "torch", "0.0.1", "raise ImportError('the fake torch was installed')\n")
    proc = run(tmp_path, "install", IMPORTS="mbn_fake_missing")
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert proc.returncode == 0, summary + proc.stderr
    site = tmp_path / "site"
    assert sorted(p.name for p in site.iterdir() if not p.name.startswith(".")) == [
        "mbn_fake_missing",
        "mbn_fake_missing-1.0.dist-info",
    ]
    assert "the interpreter's own: numpy " in summary and "torch " in summary
    assert re.search(r"^torch \S+ cuda \S+ deepspeed \S+ device ", summary, re.M)
    assert "(a venv)" in summary  # the layout rehearsed: a venv's interpreter holding torch
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["logs.tgz", "summary.md"]


def test_an_interpreter_without_torch_is_one_line_and_nothing_else_runs(tmp_path) -> None:
    bare = tmp_path / "bare"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(bare)], check=True)
    (tmp_path / "wheelhouse").mkdir()
    proc = run(tmp_path, "all", PYTHON=str(bare / "bin" / "python"))
    assert proc.returncode == 1
    summary = (tmp_path / "out" / "summary.md").read_text()
    failed = [line for line in summary.splitlines() if line.startswith("install failed")]
    assert failed == ["install failed: ModuleNotFoundError: No module named 'torch'"], summary
    assert summary.rstrip().endswith("nothing else ran")
    assert "## graphs_check" not in summary


@pytest.mark.parametrize("what", ["bench", "install,speed"])
def test_an_unknown_section_is_one_line(tmp_path, what: str) -> None:
    proc = run(tmp_path, what)
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: unknown section "), err
    assert not (tmp_path / "out").exists()  # refused before anything was written
