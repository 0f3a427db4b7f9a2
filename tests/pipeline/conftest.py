"""Shared launcher for the 2-rank gloo harness (started once per session)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from megatron_branchnorm.runner.launch import rank_env  # the environment srun + common.sh give
from megatron_branchnorm.runner.ranks import start_ranks

__all__ = ["ROOT", "launch_ranks", "rank_env"]

ROOT = Path(__file__).resolve().parents[2]


def launch_ranks(
    args: list[str], world: int, log_dir: Path, cwd: Path = ROOT, env: dict | None = None
) -> list[subprocess.Popen]:
    """Start ``world`` processes of ``python ARGS`` as gloo ranks (as srun would), with
    ``env`` added to each rank's environment and rank R's output in ``log_dir/rank<R>.log``
    (:func:`megatron_branchnorm.runner.ranks.start_ranks`)."""
    return start_ranks(world, args, log_dir, module=None, env=env, cwd=cwd).procs


@pytest.fixture(scope="session")
def harness(tmp_path_factory):
    out = tmp_path_factory.mktemp("harness")
    procs = launch_ranks([str(ROOT / "tests/pipeline/harness.py"), str(out)], 2, out)
    codes = [p.wait(timeout=600) for p in procs]
    if codes != [0, 0]:
        log = (out / "rank0.log").read_text()[-3000:] + (out / "rank1.log").read_text()[-3000:]
        pytest.fail(f"harness ranks exited {codes}:\n{log}")
    return out
