"""Session fixtures of the fault suite: each starts its gloo ranks once and many tests read
the result (docs/design.md §4: one shared harness, fault suite <= 6 minutes)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from megatron_branchnorm.formats import checkpoint as ckpt
from tests.faults.common import (
    DP_RUN,
    DP_STEPS,
    DP_WORLD,
    STEPS,
    kill_hard_when,
    last_by_step,
    launch,
    records,
    signal_at_handler,
    wait_all,
)
from tests.pipeline.conftest import ROOT, launch_ranks


def _fail(codes, log_dir: Path, what: str) -> None:
    logs = "".join(p.read_text()[-2500:] for p in sorted(log_dir.glob("rank*.log")))
    pytest.fail(f"{what}: ranks exited {codes}:\n{logs}")


@pytest.fixture(scope="session")
def fault_harness(tmp_path_factory) -> Path:
    """tests/faults/harness.py on 2 ranks: ref, resume, skip and stop runs."""
    out = tmp_path_factory.mktemp("faults_harness")
    procs = launch_ranks([str(ROOT / "tests/faults/harness.py"), str(out)], 2, out)
    codes = wait_all(procs, timeout=600)
    if codes != [0, 0]:
        _fail(codes, out, "fault harness")
    return out


SAVE_KILLS = {
    # point: (rank that exits, checkpoint a restart must load)
    "engine_file": (1, "global_step2"),
    "after_rng": (0, "global_step2"),
    "after_manifest": (0, "global_step4"),
}
RESTARTED = ("engine_file", "after_manifest")


@pytest.fixture(scope="session")
def save_kills(tmp_path_factory) -> dict:
    """A run per kill point, cut inside the save at step 4 (checkpoints every 2 updates);
    two of them restarted to the end. Returns {point: {dir, codes, seconds, restart_codes}}."""
    base = tmp_path_factory.mktemp("save_kills")
    result = {}
    for point, (rank, _) in SAVE_KILLS.items():
        run = base / point
        t0 = time.time()
        procs = launch(
            run,
            [f"train.max_steps={STEPS}", "train.save_interval=2"],
            base / f"{point}_logs",
            fault=f"save_exit@{point}:rank{rank}:step4",
        )
        codes = wait_all(procs, timeout=300)
        result[point] = {"dir": run, "codes": codes, "seconds": time.time() - t0}
        result[point]["resume_tag"] = ckpt.resume_tag(run)[0]
    for point in RESTARTED:
        run = result[point]["dir"]
        procs = launch(run, [f"train.max_steps={STEPS}", "train.save_interval=2"], base / "r")
        result[point]["restart_codes"] = wait_all(procs, timeout=300)
        if result[point]["restart_codes"] != [0, 0]:
            _fail(result[point]["restart_codes"], base / "r", f"restart after {point}")
    return result


@pytest.fixture(scope="session")
def hard_kills(tmp_path_factory) -> dict:
    """kill -9 of the first stage, restart, kill -9 of the last stage, restart to the end.
    Returns the seconds until the surviving rank exited and the exit codes."""
    base = tmp_path_factory.mktemp("hard_kills")
    run = base / "run"
    overrides = [f"train.max_steps={STEPS}", "train.save_interval=2"]
    out: dict = {"dir": run}
    procs = launch(run, overrides, base / "l1", fault="slow@0.3")
    out["first"] = kill_hard_when(procs, run, victim=0, min_rows=3)
    out["first_survivor_log"] = (base / "l1" / "rank1.log").read_text()
    rows = len(records(run))
    procs = launch(run, overrides, base / "l2", fault="slow@0.3")
    out["last"] = kill_hard_when(procs, run, victim=1, min_rows=rows + 3)
    out["last_survivor_log"] = (base / "l2" / "rank0.log").read_text()
    out["resumed_from"] = [
        line for line in (base / "l2" / "rank0.log").read_text().splitlines() if "resumed" in line
    ]
    procs = launch(run, overrides, base / "l3")
    out["final_codes"] = wait_all(procs, timeout=300)
    if out["final_codes"] != [0, 0]:
        _fail(out["final_codes"], base / "l3", "restart after kill -9")
    (base / "hard_kills.json").write_text(json.dumps({k: str(v) for k, v in out.items()}))
    return out


@pytest.fixture(scope="session")
def one_rank_signals(tmp_path_factory) -> dict:
    """SIGUSR1 to the last stage only, restart, SIGTERM to the first stage only, restart to
    the end (fault 5 with one rank signalled; tools/fault_sweep.py soak does many).
    Returns, per signal, the exit codes, the last step logged before the exit and the tag a
    restart loads."""
    base = tmp_path_factory.mktemp("one_rank_signals")
    run = base / "run"
    overrides = [f"train.max_steps={STEPS}", "train.save_interval=0"]
    out: dict = {"dir": run}
    for name, victim, sig in (("usr1_last", 1, signal.SIGUSR1), ("term_first", 0, signal.SIGTERM)):
        before = len(records(run))
        procs = launch(run, overrides, base / name, fault="slow@0.3")
        _, codes = kill_hard_when(procs, run, victim, before + 3, timeout=600, sig=sig)
        out[name] = {
            "codes": codes,
            "last_step": max(r["step"] for r in records(run)),
            "tag": ckpt.resume_tag(run)[0],
        }
    procs = launch(run, overrides, base / "end")
    out["final_codes"] = wait_all(procs, timeout=300)
    if out["final_codes"] != [0, 0]:
        _fail(out["final_codes"], base / "end", "restart after the signals")
    return out


@pytest.fixture(scope="session")
def dp2_runs(tmp_path_factory) -> tuple[Path, dict]:
    """pp2 x dp2 on 4 ranks: tests/faults/harness.py (``ref``, ``dp_equiv``), then the reference
    run launched again and stopped by SIGUSR1 to rank 3 alone after 2 updates (``usr1``), then
    restarted to the end. Returns the output directory and, for the signalled launch, the exit
    codes, the seconds until every rank exited, the last step logged and the tag a restart
    loads (also in dp2.json)."""
    out = tmp_path_factory.mktemp("faults_dp2")
    procs = launch_ranks([str(ROOT / "tests/faults/harness.py"), str(out)], DP_WORLD, out)
    codes = wait_all(procs, timeout=600)
    if codes != [0] * DP_WORLD:
        _fail(codes, out, "4-rank fault harness")
    run, overrides = out / "usr1", [f"train.max_steps={DP_STEPS}", *DP_RUN]
    procs = launch(run, overrides, out / "usr1_logs", fault="slow@0.3", world=DP_WORLD)
    seconds, codes = kill_hard_when(procs, run, 3, min_rows=2, timeout=300, sig=signal.SIGUSR1)
    result = {
        "codes": codes,
        "exit_s": seconds,
        "logged": max(last_by_step(run), default=0),
        "tag": ckpt.resume_tag(run)[0],
    }
    procs = launch(run, overrides, out / "restart_logs", world=DP_WORLD)
    result["restart_codes"] = wait_all(procs, timeout=300)
    if result["restart_codes"] != [0] * DP_WORLD:
        _fail(result["restart_codes"], out / "restart_logs", "4-rank restart after SIGUSR1")
    (out / "dp2.json").write_text(json.dumps(result, indent=1))
    return out, result


@pytest.fixture(scope="session")
def early_signals(tmp_path_factory) -> dict:
    """SIGUSR1 to one rank the moment its handler exists, long before the Trainer is built:
    on a fresh save_dir (``fresh``), and after a completed 3-update run when the restart to 6
    is still starting (``resumed``). Per launch: exit codes and seconds from spawn to signal."""
    base = tmp_path_factory.mktemp("early_signals")
    run = base / "run"
    out: dict = {"dir": run}
    overrides = ["train.save_interval=0"]
    for name, steps, victim in (("fresh", 3, 1), ("complete", 3, None), ("resumed", 6, 0)):
        procs = launch(run, [f"train.max_steps={steps}", *overrides], base / name)
        seconds = None if victim is None else signal_at_handler(procs, victim, signal.SIGUSR1)
        out[name] = {"codes": wait_all(procs, timeout=300), "signal_s": seconds}
        out[name]["latest"] = ckpt.read_latest(run)
        out[name]["steps"] = [r["step"] for r in records(run)]
    return out
