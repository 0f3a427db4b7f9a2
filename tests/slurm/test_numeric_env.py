"""slurm/*.sh read numbers from the environment (the user's and SLURM's own variables) and bash
evaluates a variable's value used in arithmetic as an expression: ``x[$(cmd)]`` there runs cmd.
Each such variable is refused in one line naming it before any use (slurm/common.sh mb_int),
and every name that reaches arithmetic in the scripts is one of them or the scripts' own.
Bash only: fake ``scontrol``, ``srun`` and ``python`` stand in for the cluster."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.slurm.conftest import ROOT

SLURM = ROOT / "slurm"

# Every environment variable whose value the scripts use as a number (test_class_is_closed).
NUMERIC = [
    "SLURM_JOB_ID",
    "MASTER_PORT",
    "SLURM_JOB_NUM_NODES",
    "SLURM_NNODES",
    "SLURM_NTASKS_PER_NODE",
    "GPUS_PER_NODE",
    "SLURM_CPUS_PER_TASK",
    "SLURM_RESTART_COUNT",
    "MB_SIGNAL_LEAD",
    "SBATCH_SIGNAL",
]
# Names the scripts themselves set from those (after mb_int) or from literals and exit codes.
INTERNAL = {
    "NNODES", "GPUS_PER_NODE", "per_node", "days", "h", "m", "s", "limit", "MB_LEAD",
    "plan_status", "status", "MB_REQUEUE_EXIT_CODE", "_mb_value", "_mb_min", "_mb_max",
}  # fmt: skip
# HOME[...]: under set -u an unset name (x) fails before its subscript is expanded; `...`
# survives common.sh's "8(x4)" -> "8"
PAYLOADS = ["x[$(touch {marker})]", "HOME[$(touch {marker})]", "HOME[`touch {marker}`]"]
FAKES = {
    "scontrol": 'case "$1 $2" in\n"show hostnames") echo node1 ;;\n'
    '"show job") echo "JobId=$3 TimeLimit=00:30:00" ;;\nesac\n',
    "srun": 'echo "srun $*" >>"$FAKE_LOG"\n',
    "python": 'echo "python $*" >>"$FAKE_LOG"\n',
}


@pytest.fixture
def fakes(tmp_path: Path) -> Path:
    """A bin directory with the fake scontrol, srun and python."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in FAKES.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def launch(script: str, bin_dir: Path, **env: str | None) -> subprocess.CompletedProcess:
    """Run slurm/<script> as sbatch would in a 1-node job of 2 tasks; ``env`` adds variables
    (None removes one)."""
    base = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(bin_dir.parent),
        "FAKE_LOG": str(bin_dir.parent / "calls.log"),
        "SLURM_SUBMIT_DIR": str(ROOT),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_NNODES": "1",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_CPUS_PER_TASK": "1",
        "SLURM_RESTART_COUNT": "0",
        "SAVE_DIR": str(bin_dir.parent / "run"),
    }
    base.update(env)
    return subprocess.run(
        ["bash", str(SLURM / script)],
        cwd=bin_dir.parent,
        env={k: v for k, v in base.items() if v is not None},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_fakes_run_the_launcher_to_the_end(fakes):
    """The control: valid numbers (one with a leading zero) go through to srun, in base 10."""
    proc = launch("tiny_cpu.sh", fakes, GPUS_PER_NODE="02", MB_SIGNAL_LEAD="060")
    assert proc.returncode == 0, proc.stderr
    calls = (fakes.parent / "calls.log").read_text()
    assert "srun --nodes=1 --ntasks-per-node=2 --ntasks=2 " in calls
    assert "plan_memory.py --config tiny_cpu --gpus 2 " in calls


@pytest.mark.parametrize("payload", PAYLOADS, ids=["unset", "dollar", "backtick"])
@pytest.mark.parametrize("name", NUMERIC)
def test_an_expression_in_a_numeric_variable_is_refused_unrun(fakes, name, payload):
    marker = fakes.parent / "MARKER"
    value = payload.format(marker=marker)
    env: dict[str, str | None] = {name: f"USR1@{value}" if name == "SBATCH_SIGNAL" else value}
    # unset what would take precedence over the variable under test
    shadowed = {"SLURM_NNODES": "SLURM_JOB_NUM_NODES", "SBATCH_SIGNAL": "MB_SIGNAL_LEAD"}
    if name in shadowed:
        env[shadowed[name]] = None
    proc = launch("tiny_cpu.sh", fakes, **env)
    assert not marker.exists(), f"{name}={value} ran its command"
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"error: {name}=" in lines[0], proc.stderr
    assert "expected a whole number" in lines[0]
    assert not (fakes.parent / "calls.log").exists()  # nothing launched


@pytest.mark.parametrize("value", ["0", "-1", "1e3", " 8", "99999999999", "0x10"])
def test_out_of_range_and_non_decimal_numbers_are_refused(fakes, value):
    proc = launch("tiny_cpu.sh", fakes, GPUS_PER_NODE=value)
    assert proc.returncode == 2 and "error: GPUS_PER_NODE=" in proc.stderr, proc.stderr
    assert "from 1 to 1024" in proc.stderr


def test_watch_bleu_checks_its_thread_count(fakes):
    marker = fakes.parent / "MARKER"
    proc = launch("watch_bleu.sh", fakes, SLURM_CPUS_PER_TASK=f"HOME[$(touch {marker})]")
    assert not marker.exists() and proc.returncode == 2
    assert "error: SLURM_CPUS_PER_TASK=" in proc.stderr
    assert launch("watch_bleu.sh", fakes, SLURM_CPUS_PER_TASK="16").returncode == 0
    assert "--threads 16\n" in (fakes.parent / "calls.log").read_text()


def _arithmetic(text: str) -> list[str]:
    """The bodies of every $(( )) and (( )) in a script (comments dropped)."""
    code = "\n".join(line.split(" #")[0] for line in text.splitlines() if not line.startswith("#"))
    bodies, start = [], code.find("((")
    while start != -1:
        depth, i = 0, start
        while True:
            depth += {"(": 1, ")": -1}.get(code[i], 0)
            i += 1
            if depth == 0:
                break
        bodies.append(code[start:i])
        start = code.find("((", i)
    return bodies


def test_class_is_closed():
    """Every name in arithmetic is a checked variable or the scripts' own; the other ways bash
    evaluates arithmetic (let, declare -i, [[ -lt ]]-style tests, ${x:offset}) are not used."""
    scripts = sorted(SLURM.glob("*.sh"))
    assert {"common.sh", "tiny_cpu.sh", "watch_bleu.sh"} <= {p.name for p in scripts}
    names = set()
    for path in scripts:
        text = path.read_text()
        for body in _arithmetic(text):
            names |= set(re.findall(r"(?<![\w#])[A-Za-z_]\w*", body))
        code = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
        assert not re.search(r"\blet\b|\b(declare|local|typeset)\s+-\w*i", code), path.name
        assert not re.search(r"\[\[[^]]*\s-(eq|ne|lt|le|gt|ge)\s", code), path.name
        assert not re.search(r"\$\{\w+:[^-=?+]", code), path.name  # ${x:1}, ${x: -1}
        for subscript in re.findall(r"\$\{#?\w+\[([^]]*)\]", code):  # ${a[i]}: arithmetic
            assert subscript in ("@", "*") or subscript.isdigit(), (path.name, subscript)
    unchecked = names - set(NUMERIC) - INTERNAL
    assert not unchecked, f"reach arithmetic unchecked: {sorted(unchecked)}"
    assert "SLURM_JOB_ID" in names and "GPUS_PER_NODE" in names  # the scan sees them
