"""Shared launcher for the 2-rank gloo harness (started once per session)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_branchnorm.runner.launch import (
    free_port,
    rank_env,  # the environment srun + common.sh give
)

__all__ = ["ROOT", "free_port", "launch_ranks", "rank_env"]

ROOT = Path(__file__).resolve().parents[2]


def launch_ranks(
    args: list[str], world: int, log_dir: Path, cwd: Path = ROOT, env: dict | None = None
) -> list:
    """Start ``world`` processes of ``python ARGS`` as gloo ranks (as srun would), with
    ``env`` added to each rank's environment."""
    port = free_port()
    procs = []
    for r in range(world):
        log = open(log_dir / f"rank{r}.log", "w")
        procs.append(
            subprocess.Popen(
                [sys.executable, *args],
                env={**rank_env(r, world, port), **(env or {})},
                cwd=cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    return procs


@pytest.fixture(scope="session")
def harness(tmp_path_factory):
    out = tmp_path_factory.mktemp("harness")
    procs = launch_ranks([str(ROOT / "tests/pipeline/harness.py"), str(out)], 2, out)
    codes = [p.wait(timeout=600) for p in procs]
    if codes != [0, 0]:
        log = (out / "rank0.log").read_text()[-3000:] + (out / "rank1.log").read_text()[-3000:]
        pytest.fail(f"harness ranks exited {codes}:\n{log}")
    return out
