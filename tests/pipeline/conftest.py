"""Shared launcher for the 2-rank gloo harness (started once per test run)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from megatron_branchnorm.formats import checkpoint as ckpt
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


def copy_at_checkpoint(src: Path, dst: Path, step: int) -> None:
    """``src`` (a run's save directory) copied to ``dst`` as it was right after its checkpoint
    at ``step``: later tags gone, ``latest`` at ``step``, the metrics rows of later updates
    dropped (a run resumed there appends its own)."""
    shutil.copytree(src, dst)
    for tag in dst.glob(f"{ckpt.TAG_PREFIX}*"):
        if tag.name != ckpt.tag_for(step):
            shutil.rmtree(tag)
    ckpt.write_latest(dst, ckpt.tag_for(step))
    rows = (dst / "metrics.jsonl").read_text().splitlines()
    keep = [r for r in rows if json.loads(r).get("step", 0) <= step]
    (dst / "metrics.jsonl").write_text("".join(f"{r}\n" for r in keep))
