"""A non-editable ``pip install`` of the project works away from the checkout: the console
scripts train and plan with the shipped configs and DeepSpeed JSONs, found inside the installed
package, and ``deepspeed --module megatron_branchnorm.train`` launches the installed trainer.

The fresh virtualenv sees this interpreter's site-packages (torch, DeepSpeed, ...) through a
``.pth`` line. A directory added that way does not get its own ``.pth`` files processed, so an
editable install of the project there (its import finder) is invisible in the new venv.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from megatron_branchnorm.commands import FRONT_DOORS
from megatron_branchnorm.runner.launch import quiet_ports

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    """The environment without anything that would put the checkout on sys.path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONWARNINGS"] = "ignore"
    return env


def _run(cmd: list, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A venv holding a plain (non-editable) install of this checkout, and nothing else."""
    work = tmp_path_factory.mktemp("install")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            env=_env(),
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    ours = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    (site / "_mbn_dependencies.pth").write_text("".join(f"{p}\n" for p in sorted(ours)))
    probe = _run([python, "-c", "import megatron_branchnorm"], cwd=work)
    assert probe.returncode != 0 and "No module named 'megatron_branchnorm'" in probe.stderr, (
        "the new venv must not see the checkout or its editable install"
    )
    # A copy of what the build needs: building in the checkout would leave build/ and
    # *.egg-info there.
    src = work / "src"
    shutil.copytree(
        ROOT / "megatron_branchnorm",
        src / "megatron_branchnorm",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
    )
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy2(ROOT / name, src / name)
    pip = _run(
        [python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--ignore-installed",
         "--no-input", "--disable-pip-version-check", "--quiet", src],
        cwd=work,
    )  # fmt: skip
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    return venv


def test_installed_copy_is_used_and_holds_the_shipped_files(venv, tmp_path):
    where = _run([venv / "bin" / "python", "-c", "import megatron_branchnorm as m; print(m.__file__)"],
                 cwd=tmp_path)  # fmt: skip
    assert where.returncode == 0, where.stderr
    package = Path(where.stdout.strip()).parent
    assert package.is_relative_to(venv) and not package.is_relative_to(ROOT)
    for name in ("ds_configs/cpu_fp32.json", "ds_configs/zero1_bf16.json", "configs/tiny_cpu.yaml"):
        assert (package / name).is_file(), name
    for name in ("train", "preprocess", "convert", "translate", "evaluate", "plan", "rehearse"):
        assert (venv / "bin" / f"mbn-{name}").is_file(), name
    for door in FRONT_DOORS:  # and every console script the registry of front doors names
        if door.console:
            assert (venv / "bin" / door.console).is_file(), door.console


def test_console_scripts_train_and_plan_outside_the_checkout(venv, tmp_path):
    run_dir = tmp_path / "run"
    train = _run(
        [venv / "bin" / "mbn-train", "--config", "tiny_cpu", "train.max_steps=2",
         f"train.save_dir={run_dir}", "train.log_interval=1", "train.save_interval=2",
         "train.eval_interval=0"],
        cwd=tmp_path,
    )  # fmt: skip
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert (run_dir / "latest").read_text().strip() == "global_step2"
    assert (run_dir / "global_step2").is_dir()

    plan = _run([venv / "bin" / "mbn-plan", "--config", "opus100_1000L", "--gpus", "32",
                 "--gpu-memory", "40GB"], cwd=tmp_path)  # fmt: skip
    assert plan.returncode in (0, 1), plan.stderr  # 0 fits, 1 does not; 2 would be bad input
    assert "total parameters:" in plan.stdout
    usage = _run([venv / "bin" / "mbn-plan", "--help"], cwd=tmp_path)
    assert usage.returncode == 0 and "usage: plan_memory.py" in usage.stdout


@pytest.mark.distributed
def test_deepspeed_launches_the_installed_trainer_as_a_module(venv, tmp_path):
    """``deepspeed --num_gpus 2 --module megatron_branchnorm.train`` (README): 2 CPU ranks."""
    run_dir = tmp_path / "run"
    launch = _run(
        [venv / "bin" / "python", "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
         "--master_port", quiet_ports(1), "--module", "megatron_branchnorm.train",
         "--config", "tiny_cpu", "pipeline.stages=2", "train.max_steps=2",
         f"train.save_dir={run_dir}", "train.save_interval=2", "train.eval_interval=0"],
        cwd=tmp_path,
    )  # fmt: skip
    assert launch.returncode == 0, launch.stdout[-3000:] + launch.stderr[-3000:]
    assert (run_dir / "latest").read_text().strip() == "global_step2"
