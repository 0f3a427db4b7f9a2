"""Rehearse a shipped sbatch launcher on a local SLURM cluster (workflows/local_slurm.py):
submit it unchanged at its node x rank topology on CPU, send SIGUSR1 after a few updates, and
check what a GPU allocation would rely on: every rank checkpoints and exits 75, the job
requeues itself, resumes and finishes, and ``metrics.jsonl`` has every step exactly once.

    spec = RehearsalSpec("slurm/opus100_1000L.sh", nodes=4, ranks_per_node=8, stages=16, ...)
    result = rehearse(cluster, spec, work_dir)
    print(format_result(result))

The figures (job start to first update, time per update, signal to exit, save, requeue to
resume, total) come from polling the job's log and metrics file every ``poll`` seconds.
:func:`main` is the command line (``tools/rehearse_slurm.py``, :data:`USAGE`);
tests/slurm/test_multinode.py a small case.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from megatron_branchnorm.cli import run_main
from megatron_branchnorm.config import load_config
from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.formats.outputs import check_scratch_dir
from megatron_branchnorm.formats.records import read_rows
from megatron_branchnorm.runner.launch import CHECKOUT
from megatron_branchnorm.training.exit_codes import REQUEUE_EXIT_CODE
from megatron_branchnorm.workflows.local_slurm import (
    FINAL_STATES,
    Cluster,
    ClusterError,
    ensure_installed,
    start_cluster,
)

# the model shrunk in width only (depth, stages and topology stay the launcher's)
NARROW = (
    "model.vocab_size=64 model.hidden_size=16 model.ffn_hidden_size=32 "
    "model.num_attention_heads=2 data.max_tokens=128 data.max_length=24 model.max_positions=64"
).split()
# srun's report of ranks that exited non-zero: "srun: error: mbn1: tasks 0-7: Exited with ..."
SRUN_EXIT = re.compile(r"srun: error: (\S+): tasks? ([\d,\-]+): Exited with exit code (\d+)")
EVENTS = {
    "start": re.compile(r"job \d+ \(restart 0\)"),
    "exit75": re.compile(rf"trainer checkpointed and exited {REQUEUE_EXIT_CODE}"),
    "restart": re.compile(r"job \d+ \(restart 1\)"),
    "resumed": re.compile(r"resumed from \S+ at step (\d+)"),
}
SAVED = re.compile(r"saved checkpoint (\S+) in ([\d.]+)s")


@dataclass
class RehearsalSpec:
    """What to submit and when to signal it."""

    launcher: str  # e.g. slurm/opus100_1000L.sh, relative to the checkout
    nodes: int
    ranks_per_node: int
    stages: int  # expected in the log: "<stages> stages x <dp> data-parallel"
    steps: int  # train.max_steps
    signal_after: int  # send SIGUSR1 once this many updates are logged
    overrides: list[str] = field(default_factory=list)  # EXTRA_ARGS
    time_limit: str = "60"  # sbatch --time (above the launcher's signal lead)
    data: str = "synthetic"
    ds_config: str = "ds_configs/cpu_fp32.json"
    save_interval: int = 0  # train.save_interval (the node-loss rehearsal resumes from one)


@dataclass
class RehearsalResult:
    """What happened: the job, its log, the checks and the figures (seconds)."""

    job_id: str
    command: str
    log: Path
    state: str
    restarts: str
    checks: list[tuple[str, bool, str]]
    figures: dict[str, float | None]
    steps: list[int]

    def failures(self) -> list[str]:
        """The checks that failed, with what was seen."""
        return [f"{name}: {seen}" for name, ok, seen in self.checks if not ok]


def extra_args(spec: RehearsalSpec) -> list[str]:
    """EXTRA_ARGS for the job: the spec's overrides plus the run length and logging."""
    return [
        *spec.overrides,
        f"train.max_steps={spec.steps}",
        "train.log_interval=1",
        f"train.save_interval={spec.save_interval}",
        "train.eval_interval=0",
    ]


def submit_command(spec: RehearsalSpec, work: Path) -> tuple[dict, list[str]]:
    """The environment additions and the sbatch command line that submit the launcher."""
    env = {
        "DATA": spec.data,
        "DS_CONFIG": spec.ds_config,
        "SAVE_DIR": str(work / "run"),
        "EXTRA_ARGS": " ".join(extra_args(spec)),
    }
    if sys.prefix != sys.base_prefix:  # the ranks use this interpreter's virtualenv
        env["VENV"] = sys.prefix
    else:
        env["PYTHON"] = sys.executable
    cmd = [
        "sbatch",
        "--parsable",
        f"--nodes={spec.nodes}",
        f"--ntasks-per-node={spec.ranks_per_node}",
        "--gres=none",
        "--cpus-per-task=1",
        f"--time={spec.time_limit}",
        f"--chdir={work}",
        f"--output={work}/%x-%j.out",
        spec.launcher,
    ]
    return env, cmd


def submit(cluster: Cluster, spec: RehearsalSpec, work: Path) -> tuple[str, str, Path]:
    """Submit the launcher from the checkout: (job id, the command as a user would type it,
    the job's log)."""
    work.mkdir(parents=True, exist_ok=True)
    env_extra, cmd = submit_command(spec, work)
    command = " ".join(
        [*(f"{k}={shlex.quote(v)}" for k, v in env_extra.items()), shlex.join(cmd[:1] + cmd[2:])]
    )
    out = cluster.run(*cmd, env=dict(cluster.env, **env_extra), cwd=CHECKOUT).stdout
    job_id = out.strip().split(";")[0]
    name = cluster.job_field(job_id, "JobName")
    return job_id, command, work / f"{name}-{job_id}.out"


def ranks_exited(log_text: str, code: int) -> set[int]:
    """Ranks that srun reported as exited with ``code`` ("tasks 0-3,5")."""
    ranks: set[int] = set()
    for match in SRUN_EXIT.finditer(log_text):
        if int(match.group(3)) != code:
            continue
        for part in match.group(2).split(","):
            lo, _, hi = part.partition("-")
            ranks.update(range(int(lo), int(hi or lo) + 1))
    return ranks


def _mem_used_gb() -> float | None:
    """Host memory in use (MemTotal - MemAvailable), GB; None off Linux."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    except OSError:
        return None
    kb = int(info["MemTotal"].split()[0]) - int(info["MemAvailable"].split()[0])
    return kb / 1024**2


class _Watch:
    """Polls the job log and metrics file; records when each event and step first appeared."""

    def __init__(self, log: Path, metrics: Path, skip_rows: int = 0) -> None:
        self.log, self.metrics = log, metrics
        self.skip = skip_rows  # training rows of an earlier job in the same run directory
        self.text = ""
        self.events: dict[str, float] = {}
        self.step_times: list[tuple[int, float, float | None]] = []  # step, seen, elapsed_s
        self.mem_peak: float | None = None

    def rows(self) -> list[dict]:
        """This job's training rows as written, in file order (redone steps included: the
        checks count them; a line being written is left out)."""
        rows = read_rows(self.metrics.parent, name=self.metrics.name)
        return [r for r in rows if "loss" in r][self.skip :]

    def poll(self) -> None:
        now = time.time()
        if self.log.is_file():
            with self.log.open(errors="replace") as fh:
                fh.seek(len(self.text))
                self.text += fh.read()
        for name, pattern in EVENTS.items():
            if name not in self.events and pattern.search(self.text):
                self.events[name] = now
        rows = self.rows()
        for row in rows[len(self.step_times) :]:
            self.step_times.append((row["step"], now, row.get("elapsed_s")))
        mem = _mem_used_gb()
        if mem is not None:
            self.mem_peak = mem if self.mem_peak is None else max(self.mem_peak, mem)


def _per_update(times: list[tuple[int, float, float | None]]) -> float | None:
    """Mean seconds per update over consecutive logged steps of one run segment."""
    gaps = []
    for (s0, t0, e0), (s1, t1, e1) in zip(times, times[1:], strict=False):
        if s1 == s0 + 1:
            gaps.append((e1 - e0) if (e0 is not None and e1 is not None and e1 > e0) else t1 - t0)
    return sum(gaps) / len(gaps) if gaps else None


def rehearse(
    cluster: Cluster,
    spec: RehearsalSpec,
    work: Path,
    timeout: float = 1800.0,
    poll: float = 0.5,
    echo: bool = False,
) -> RehearsalResult:
    """Submit ``spec.launcher``, signal it after ``spec.signal_after`` updates, wait for the
    requeued job to finish; returns the checks and figures. Cancels the job on timeout."""
    work = Path(work).resolve()
    mem_before = _mem_used_gb()
    t_submit = time.time()
    job_id, command, log = submit(cluster, spec, work)
    watch = _Watch(log, work / "run" / "metrics.jsonl")
    deadline = t_submit + timeout

    def say(msg: str) -> None:
        if echo:
            print(f"[{time.time() - t_submit:7.1f}s] {msg}", flush=True)

    say(f"submitted job {job_id}: {command}")
    t_signal = None
    state = ""
    while time.time() < deadline:
        watch.poll()
        state = cluster.job_field(job_id, "JobState")
        if t_signal is None and len(watch.step_times) >= spec.signal_after:
            cluster.run("scancel", "--signal=USR1", job_id)
            t_signal = time.time()
            say(f"{len(watch.step_times)} updates logged: scancel --signal=USR1 {job_id}")
        if state in FINAL_STATES:
            break
        if t_signal is None and state not in ("PENDING", "CONFIGURING", "RUNNING"):
            break  # it left the queue, or is requeued, before it could be signalled
        time.sleep(poll)
    else:
        cluster.run("scancel", job_id, check=False)
        state = f"TIMEOUT after {timeout:.0f}s ({state})"
    t_end = time.time()
    watch.poll()
    say(f"job {job_id} {state}")

    text, ev = watch.text, watch.events
    first_run = text.split("(restart 1)")[0]
    exited = ranks_exited(first_run, REQUEUE_EXIT_CODE)
    world = spec.nodes * spec.ranks_per_node
    topology = f"world {world} = {spec.stages} stages x {world // spec.stages} data-parallel"
    steps = [s for s, _, _ in watch.step_times]
    saves = [(m.group(1), float(m.group(2))) for m in SAVED.finditer(text)]
    complete, partial = ckpt.checkpoint_tags(work / "run")
    saved_steps = sorted(ckpt.tag_step(t) for t in complete + partial)
    restarts = cluster.job_field(job_id, "Restarts")
    checks = [
        ("job completed", state == "COMPLETED", state),
        ("exit code 0:0", cluster.job_field(job_id, "ExitCode") == "0:0", "ExitCode"),
        (f"'{topology}' in both runs", text.count(topology) == 2, f"{text.count(topology)}x"),
        ("signal sent", t_signal is not None, f"{len(steps)} updates logged"),
        (
            f"every rank exited {REQUEUE_EXIT_CODE}",
            exited == set(range(world)),
            f"ranks {sorted(exited)} of {world}",
        ),
        ("the trainer saved and exited 75", "signal received: checkpoint saved" in text, ""),
        ("the script requeued the job", f"requeueing job {job_id}" in text, ""),
        ("Restarts=1", restarts == "1", f"Restarts={restarts}"),
        ("resumed from the signal's checkpoint", "resumed" in ev, ""),
        ("metrics: every step once", steps == list(range(1, spec.steps + 1)), str(steps)),
        (
            "checkpoints: the signal's and the last",
            len(saved_steps) == 2 and saved_steps[1] == spec.steps,
            str(saved_steps),
        ),
    ]

    def since(a: str | float | None, b: str | float | None) -> float | None:
        ta = ev.get(a) if isinstance(a, str) else a
        tb = ev.get(b) if isinstance(b, str) else b
        return None if ta is None or tb is None else tb - ta

    resumed_at = int(EVENTS["resumed"].search(text).group(1)) if "resumed" in ev else None
    first = next(((t, e) for s, t, e in watch.step_times if s == 1), (None, None))
    after = next(
        ((t, e) for s, t, e in watch.step_times if resumed_at is not None and s == resumed_at + 1),
        (None, None),
    )

    def startup(run_start: str, update: tuple[float | None, float | None]) -> float | None:
        """Job (re)start to the training loop: to the update's arrival less its elapsed_s."""
        total = since(run_start, update[0])
        return None if total is None or update[1] is None else total - update[1]

    before = [x for x in watch.step_times if resumed_at is None or x[0] <= resumed_at]
    figures = {
        "submit to job start, s": since(t_submit, "start"),
        "job start to first update, s": since("start", first[0]),
        "of which start-up (job start to training loop), s": startup("start", first),
        "time per update, s": _per_update(before),
        "signal to all ranks exited 75, s": since(t_signal, "exit75"),
        "checkpoint save (trainer's figure), s": saves[0][1] if saves else None,
        "exit to requeued job start, s": since("exit75", "restart"),
        "requeued job start to resumed, s": since("restart", "resumed"),
        "requeued job start to first update, s": since("restart", after[0]),
        "of which start-up, s": startup("restart", after),
        "total (submit to completed), s": t_end - t_submit,
        "host memory in use at peak, above idle, GB": (
            watch.mem_peak - mem_before
            if watch.mem_peak is not None and mem_before is not None
            else None
        ),
    }
    return RehearsalResult(job_id, command, log, state, restarts, checks, figures, steps)


def format_result(result: RehearsalResult) -> str:
    """The checks and the figures as Markdown tables, and the command."""
    lines = ["| check | ok | seen |", "| --- | --- | --- |"]
    lines += [f"| {n} | {'yes' if ok else 'NO'} | {s} |" for n, ok, s in result.checks]
    lines += ["", "| figure | value |", "| --- | ---: |"]
    for name, value in result.figures.items():
        lines.append(f"| {name} | {'-' if value is None else f'{value:.1f}'} |")
    lines += ["", f"job {result.job_id}, log {result.log}", "", result.command]
    return "\n".join(lines)


def default_spec(
    launcher: str = "slurm/opus100_1000L.sh",
    nodes: int = 4,
    ranks_per_node: int = 8,
    stages: int = 16,
    steps: int = 4,
    signal_after: int = 2,
    micro_batches: int | None = None,
    overrides: list[str] | None = None,
) -> RehearsalSpec:
    """The launcher at its real topology and depth, only the width shrunk (NARROW; more
    ``overrides`` after it)."""
    overrides = list(NARROW) + list(overrides or [])
    if micro_batches is not None:  # per replica, whatever the config's pipeline.data_parallel
        overrides += [f"train.micro_batches={micro_batches}", "pipeline.data_parallel=0"]
    return RehearsalSpec(
        launcher, nodes, ranks_per_node, stages, steps, signal_after, overrides=overrides
    )


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

USAGE = """Rehearse a shipped sbatch launcher at its real topology on a local CPU SLURM cluster before
spending GPU hours: start K local nodes, submit the launcher unchanged (only the model's width
shrunk), send SIGUSR1 after a few updates, and check that every rank checkpoints and exits 75,
the job requeues, resumes and finishes, and metrics.jsonl has every step once. Prints the checks,
the figures (start-up, time per update, signal to exit, save, requeue to resume, total) and the
exact sbatch command; exit 0 when every check passed.

    python tools/rehearse_slurm.py                                     # opus100_1000L, 4 x 8 ranks
    python tools/rehearse_slurm.py --launcher slurm/opus100_200L.sh --nodes 2
    python tools/rehearse_slurm.py --cluster /tmp/mbslurm              # a cluster already started

The 1000-layer case needs ~10-13 GB of memory for its 32 ranks and ~13 minutes on 2 cores: run
it alone. Bad input or a cluster that does not start: one line
``error: ...`` and exit 2.
"""
"""The command line's help (``tools/rehearse_slurm.py --help``)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see :data:`USAGE`)."""
    parser = rehearsal_parser(USAGE)
    parser.add_argument("--steps", type=int, default=4, help="train.max_steps")
    parser.add_argument("--signal-after", type=int, default=2, help="updates before SIGUSR1")
    parser.add_argument(
        "--micro-batches", type=int, default=None, help="train.micro_batches (default: config's)"
    )
    parser.add_argument("--time", default="60", help="sbatch --time (above the signal lead)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds for the job")
    return parser.parse_args(argv)


def rehearsal_parser(usage: str) -> argparse.ArgumentParser:
    """The options the rehearsals share: the launcher, its topology, where the job's files go
    and which cluster runs it (``usage``: the first paragraph is the description)."""
    parser = argparse.ArgumentParser(
        description=usage.split("\n\n")[0],
        epilog="\n\n".join(usage.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--launcher", default="slurm/opus100_1000L.sh")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--work", type=Path, default=None, help="job logs and run directory")
    parser.add_argument(
        "--cluster", type=Path, default=None, help="use the cluster in this directory"
    )
    return parser


def launcher_stages(launcher: str) -> int:
    """pipeline.stages of the config a launcher runs by default (CONFIG=${CONFIG:-name})."""
    text = (CHECKOUT / launcher).read_text()
    name = re.search(r"CONFIG=\$\{CONFIG:-([\w./-]+)\}", text).group(1)
    return load_config(name).pipeline.stages


@contextlib.contextmanager
def local_cluster(existing: Path | None, root: Path, nodes: int, cpus: int) -> Iterator[Cluster]:
    """The cluster already started in ``existing``, or one of ``nodes`` x ``cpus`` started in
    ``root`` (installing SLURM when missing) and stopped at the end."""
    if existing is not None:
        yield Cluster.from_dir(existing)
        return
    reason = ensure_installed()
    if reason is not None:
        raise ClusterError(f"SLURM cannot be installed: {reason}")
    cluster = start_cluster(root, nodes, cpus)
    if cluster.hosts_added:
        print(f"added to /etc/hosts as 127.0.0.1: {' '.join(cluster.hosts_added)}")
    try:
        yield cluster
    finally:
        cluster.stop()


def _rehearse(argv: list[str] | None) -> int:
    """Parse, start a cluster (unless given one), rehearse, print the tables."""
    args = parse_args(argv)
    if args.work is not None:  # before a cluster starts: its job's files are created there
        check_scratch_dir(args.work, "--work", "rehearse_slurm", ())
    spec = default_spec(
        args.launcher,
        args.nodes,
        args.ranks_per_node,
        launcher_stages(args.launcher),
        args.steps,
        args.signal_after,
        args.micro_batches,
    )
    spec.time_limit = args.time
    work = args.work or Path(tempfile.mkdtemp(prefix="rehearse_"))
    with local_cluster(args.cluster, work / "slurm", args.nodes, args.ranks_per_node) as cluster:
        result = rehearse(cluster, spec, work / "job", timeout=args.timeout, echo=True)
    print(format_result(result))
    failures = result.failures()
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    """``tools/rehearse_slurm.py``: exit 0 when every check passed, 1 when one failed, 2 on bad
    input or a cluster that cannot start."""
    return run_main(_rehearse, argv)


if __name__ == "__main__":
    sys.exit(main())
