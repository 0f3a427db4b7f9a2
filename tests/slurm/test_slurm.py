"""slurm/tiny_cpu.sh on one node of a real SLURM: a job runs to completion, and a job signalled
with SIGUSR1 checkpoints, requeues itself and finishes with a continuous metrics log that
equals the uninterrupted run's (docs/design.md §3, §12, §5)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.slurm.conftest import ROOT, Cluster

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS = 24
RUN_ARGS = (
    f"train.max_steps={STEPS} train.log_interval=1 train.eval_interval=0 train.save_interval=0"
)


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


def submit(cluster: Cluster, work: Path, env_extra: dict, *options: str) -> str:
    """sbatch slurm/tiny_cpu.sh from the checkout, its log and cwd in ``work``."""
    work.mkdir(parents=True, exist_ok=True)
    env = dict(cluster.env, **env_extra)
    proc = cluster.run(
        "sbatch",
        "--parsable",
        f"--chdir={work}",
        f"--output={work}/%x-%j.out",
        *options,
        str(ROOT / "slurm" / "tiny_cpu.sh"),
        env=env,
        cwd=ROOT,
    )
    return proc.stdout.strip().split(";")[0]


def wait_done(cluster: Cluster, job_id: str, timeout: float, log: Path) -> str:
    """Wait until the job leaves the queue for good; returns its final state."""
    state = cluster.wait_job(job_id, timeout)
    if state:
        return state
    cluster.run("scancel", job_id, check=False)
    text = log.read_text()[-3000:] if log.is_file() else "(no job log)"
    pytest.fail(f"job {job_id} still running after {timeout:.0f}s\n{text}\n{cluster.logs()}")


@pytest.fixture(scope="module")
def completed_job(slurm_cluster, tmp_path_factory):
    """slurm/tiny_cpu.sh run to completion, the interpreter from $VENV."""
    work = tmp_path_factory.mktemp("job_complete")
    env = {"VENV": str(ROOT / ".venv"), "SAVE_DIR": str(work / "run"), "EXTRA_ARGS": RUN_ARGS}
    job_id = submit(slurm_cluster, work, env)
    log = work / f"tiny_cpu-{job_id}.out"
    state = wait_done(slurm_cluster, job_id, 480, log)
    return job_id, state, work, log


def test_job_completes_with_metrics_and_checkpoint(completed_job, slurm_cluster):
    job_id, state, work, log = completed_job
    text = log.read_text()
    assert state == "COMPLETED", text[-3000:]
    assert slurm_cluster.job_field(job_id, "ExitCode") == "0:0"
    assert "2 stages x 1 data-parallel" in text  # 2 srun ranks, 2 pipeline stages
    assert "total parameters:" in text  # the start-up plan
    run = work / "run"
    assert [r["step"] for r in metrics(run)] == list(range(1, STEPS + 1))
    assert (run / "latest").read_text() == f"global_step{STEPS}"
    assert (run / f"global_step{STEPS}" / "checksums.json").is_file()


def test_sigusr1_checkpoints_requeues_and_resumes(completed_job, slurm_cluster, tmp_path):
    """scancel --signal=USR1 mid-run: checkpoint, exit 75, scontrol requeue, resume; the
    metrics log is continuous and equals the uninterrupted job's step for step."""
    work = tmp_path / "job_requeue"
    run = work / "run"
    bin_dir = str(ROOT / ".venv" / "bin")  # this job finds python on PATH instead of $VENV
    env = {
        "PATH": f"{bin_dir}:{slurm_cluster.env['PATH']}",
        "SAVE_DIR": str(run),
        "EXTRA_ARGS": RUN_ARGS,
    }
    job_id = submit(slurm_cluster, work, env)
    log = work / f"tiny_cpu-{job_id}.out"
    deadline = time.time() + 480
    while len(metrics(run)) < 2:
        state = slurm_cluster.job_field(job_id, "JobState")
        if time.time() > deadline or state not in ("PENDING", "RUNNING", "CONFIGURING"):
            text = log.read_text()[-3000:] if log.is_file() else ""
            pytest.fail(f"job {job_id} {state}: no metrics to interrupt\n{text}")
        time.sleep(0.2)
    slurm_cluster.run("scancel", "--signal=USR1", job_id)

    state = wait_done(slurm_cluster, job_id, 480, log)
    text = log.read_text()
    assert state == "COMPLETED", text[-3000:]
    assert slurm_cluster.job_field(job_id, "Restarts") == "1", text[-3000:]
    assert "signal received: checkpoint saved, exiting 75" in text
    assert f"requeueing job {job_id}" in text
    assert "resumed from" in text
    saved = sorted(int(p.name.removeprefix("global_step")) for p in run.glob("global_step*"))
    assert len(saved) == 2 and saved[0] < STEPS == saved[1]  # the USR1 checkpoint, the last

    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # none missing or repeated
    reference = {r["step"]: r for r in metrics(completed_job[2] / "run")}
    for r in rows:
        for key in ("loss", "nll_loss", "lr", "alpha", "grad_norm"):
            assert r[key] == reference[r["step"]][key], (r["step"], key)


@pytest.mark.parametrize(
    "time_limit,env_extra,lead",
    [
        ("1", {}, "60 s (#SBATCH --signal=USR1@60)"),  # the script's own lead
        ("2", {"SBATCH_SIGNAL": "USR1@150"}, "150 s (SBATCH_SIGNAL=USR1@150)"),
    ],
)
def test_time_limit_at_or_below_the_signal_lead_is_refused(
    slurm_cluster, tmp_path, time_limit, env_extra, lead
):
    """--time not above the --signal lead: one clear line and exit 2 before srun starts
    (SLURM would otherwise signal the ranks while they import, and they would die)."""
    env = dict(env_extra, VENV=str(ROOT / ".venv"), SAVE_DIR=str(tmp_path / "run"))
    job_id = submit(slurm_cluster, tmp_path, env, f"--time={time_limit}")
    log = tmp_path / f"tiny_cpu-{job_id}.out"
    assert wait_done(slurm_cluster, job_id, 60, log) == "FAILED"
    assert slurm_cluster.job_field(job_id, "ExitCode") == "2:0"
    assert slurm_cluster.job_field(job_id, "Restarts") == "0"
    errors = [line for line in log.read_text().splitlines() if "error:" in line]
    assert len(errors) == 1, errors
    assert f"is at or below the SIGUSR1 lead of {lead}" in errors[0]
    assert not (tmp_path / "run").exists()  # no rank started
