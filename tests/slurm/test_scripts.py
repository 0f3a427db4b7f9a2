"""Static checks of the sbatch launchers: syntax, shellcheck, the SLURM directives docs/design.md §12
requires, and that every config and DeepSpeed JSON they name exists and loads."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from megatron_branchnorm.config import load_config
from megatron_branchnorm.resources import DS_CONFIG_DIR
from megatron_branchnorm.training.ds_config import load_ds_config
from megatron_branchnorm.training.exit_codes import REQUEUE_EXIT_CODE
from tests.slurm.conftest import ROOT, apt_install

SLURM = ROOT / "slurm"
LAUNCHERS = ["opus100_12L", "opus100_200L", "opus100_1000L", "multiun_1000L", "tiny_cpu"]
SCRIPTS = [SLURM / f"{n}.sh" for n in LAUNCHERS] + [
    SLURM / "common.sh",
    SLURM / "watch_bleu.sh",
    SLURM / "recipe.sh",
]


def sbatch_options(text: str) -> dict[str, str]:
    """``#SBATCH --key=value`` lines of a script (before its first command)."""
    opts = {}
    for line in text.splitlines():
        match = re.match(r"#SBATCH\s+--([\w-]+)(?:=(\S+))?", line)
        if match:
            opts[match.group(1)] = match.group(2) or ""
    return opts


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        reason = apt_install(("shellcheck",))
        if reason is not None or shutil.which("shellcheck") is None:
            pytest.skip(f"shellcheck cannot be installed: {reason}")
    proc = subprocess.run(
        ["shellcheck", "-x", *[str(s.relative_to(ROOT)) for s in SCRIPTS]],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", LAUNCHERS)
def test_launcher_directives(name):
    text = (SLURM / f"{name}.sh").read_text()
    opts = sbatch_options(text)
    # USR1 to the ranks (no "B:"), early enough to finish a step and save (docs/slurm.md)
    signal = re.fullmatch(r"USR1@(\d+)", opts.get("signal", ""))
    assert signal, opts.get("signal")
    assert int(signal.group(1)) >= (60 if name == "tiny_cpu" else 180)
    assert "requeue" in opts and opts.get("open-mode") == "append"
    assert "%j" in opts["output"]  # one log per job
    assert text.index("#SBATCH") < text.index("set -euo pipefail")
    assert 'source "$MB_ROOT/slurm/common.sh"' in text and text.rstrip().endswith("mb_launch")
    if name != "tiny_cpu":
        assert opts["ntasks-per-node"] == "8" and opts["gres"] == "gpu:8"


def test_common_uses_srun_and_requeues_on_the_trainer_code():
    text = (SLURM / "common.sh").read_text()
    assert f"MB_REQUEUE_EXIT_CODE={REQUEUE_EXIT_CODE}" in text
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1' in text
    assert "srun " in text and "deepspeed " not in text.replace("`deepspeed` launcher", "")
    for var in ("CONFIG", "DATA", "SAVE_DIR", "EXTRA_ARGS", "GPUS_PER_NODE", "DS_CONFIG", "VENV"):
        assert f"{var}" in text


@pytest.mark.parametrize("name", LAUNCHERS)
def test_named_config_and_ds_json_load(name):
    text = (SLURM / f"{name}.sh").read_text()
    config = re.search(r"CONFIG=\$\{CONFIG:-([\w.]+)\}", text).group(1)
    cfg = load_config(config)
    opts = sbatch_options(text)
    world = int(opts.get("nodes", "1")) * int(opts["ntasks-per-node"])
    stages = 2 if name == "tiny_cpu" else cfg.pipeline.stages  # tiny_cpu.sh sets 2 stages
    assert world % stages == 0, (world, stages)
    ds = load_ds_config(cfg, dp=world // stages)
    assert ds["train_batch_size"] == cfg.train.micro_batches * (world // stages)
    # a config that names the data-parallel size its micro-batches are for: its launcher's
    assert cfg.pipeline.data_parallel in (0, world // stages), cfg.pipeline.data_parallel


@pytest.mark.parametrize("path", sorted(DS_CONFIG_DIR.glob("*.json")), ids=lambda p: p.name)
def test_ds_configs_parse_and_are_documented(path):
    json.loads(path.read_text())
    assert path.name in (DS_CONFIG_DIR / "README.md").read_text()


def test_launcher_outside_slurm_refuses(tmp_path):
    """Run by hand (not by sbatch), a launcher says so instead of starting anything."""
    env = {"PATH": f"{ROOT / '.venv' / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(
        ["bash", str(SLURM / "tiny_cpu.sh")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "not inside a SLURM job" in proc.stderr
