"""Rehearse the loss of a node on a local SLURM cluster (workflows/local_slurm.py,
docs/reliability.md): submit a shipped launcher unchanged at its node x rank topology with a
save interval, SIGKILL every trainer rank on its last node once a checkpoint is complete and
another update is logged (no signal the trainer could act on), drain that node as an
administrator would, resubmit the same command on one node fewer with the same ``SAVE_DIR`` and
``EXTRA_ARGS`` (no config edit), and check that the new job resumes from the last complete
checkpoint in a layout that fits its ranks (``pipeline.fallback_stages``, training/layout.py)
with the whole training state re-laid (training/checkpointer.py), and finishes.

    spec = node_loss_spec("slurm/opus100_1000L.sh", nodes=4, ranks_per_node=8, stages=16)
    result = rehearse_node_loss(cluster, spec, work)
    print(format_node_loss(result))

:func:`main` is the command line (``tools/rehearse_node_loss.py``, :data:`USAGE`);
tests/slurm/test_node_loss.py a small case (2 nodes x 4 ranks, 8 stages -> 1 node).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_branchnorm.cli import run_main
from megatron_branchnorm.errors import UserError
from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.formats.outputs import check_scratch_dir
from megatron_branchnorm.training.exit_codes import PEER_LOST_EXIT_CODE
from megatron_branchnorm.workflows.local_slurm import (
    FINAL_STATES,
    Cluster,
)
from megatron_branchnorm.workflows.rehearse_slurm import (
    RehearsalSpec,
    _mem_used_gb,
    _per_update,
    _Watch,
    default_spec,
    launcher_stages,
    local_cluster,
    ranks_exited,
    rehearsal_parser,
    submit,
)

# srun's report of tasks ended by a signal: "srun: error: mbn4: tasks 24-31: Killed"
SRUN_KILLED = re.compile(r"srun: error: (\S+): tasks? ([\d,\-]+): Killed")
# the trainer's lines (training/checkpointer.py, training/layout.py); plan_memory's own
# "layout: ..." line, printed by the launcher before the ranks start, is told apart
RELAID = re.compile(r"resumed from (\S+) at step (\d+) in another layout \((.*?)\): ([^\n]*)")
CHOSEN = re.compile(
    r"(?<!layout: )layout (\d+) stages x (\d+) data-parallel, (\d+) micro-batches per replica"
)
CONFIG_LINE = re.compile(r"python: \S+; config: ([^\n]*)")
WHOLE_STATE = "weights, fp32 master weights, Adam's moments and step re-laid per parameter"


@dataclass
class NodeLossResult:
    """Both jobs (the one that lost a node, the resubmitted one), the checks and figures."""

    jobs: list[str]
    commands: list[str]
    logs: list[Path]
    states: list[str]
    checks: list[tuple[str, bool, str]]
    figures: dict[str, float | None]
    layout: str  # e.g. "16 stages x 2 -> 3 stages x 8 data-parallel, 2 micro-batches each"

    def failures(self) -> list[str]:
        return [f"{name}: {seen}" for name, ok, seen in self.checks if not ok]


def node_ranks(job_id: str, node_id: int, proc: Path = Path("/proc")) -> tuple[dict[int, int], str]:
    """The job's trainer processes on its ``node_id``-th node (``SLURM_NODEID``), found in
    ``/proc`` (every local node daemon runs on this host): {pid: rank}, and that node's name."""
    ranks, node = {}, ""
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        env = dict(item.decode(errors="replace").split("=", 1) for item in environ if b"=" in item)
        if (
            env.get("SLURM_JOB_ID") == job_id
            and env.get("SLURM_NODEID") == str(node_id)
            and env.get("SLURM_PROCID", "").isdigit()
            and b"megatron_branchnorm/train.py" in cmdline
        ):
            ranks[int(entry.name)] = int(env["SLURM_PROCID"])
            node = env.get("SLURMD_NODENAME", node)
    return ranks, node


def kill_node(job_id: str, node_id: int, settle: float = 10.0) -> tuple[dict[int, int], str]:
    """SIGKILL every trainer process of the job on that node, scanning ``/proc`` again until
    none is left (a rank one scan missed: seen once in 32, the 1000L rehearsal's rank 26);
    returns {pid: rank} of those killed and the node's name."""
    killed: dict[int, int] = {}
    node = ""
    deadline = time.time() + settle
    while time.time() < deadline:
        found, name = node_ranks(job_id, node_id)
        node = name or node
        if not found:
            break
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed.update(found)
        time.sleep(0.1)
    return killed, node


def peers_said_why(exited: set[int], world: int, ranks_per_node: int) -> bool:
    """Whether every rank off the lost (last) node ``exited`` with the peer-lost code, and no
    rank outside the job did. A rank of the lost node may be among them: :func:`kill_node`
    kills the ranks one scan at a time, 0.1 s apart, and a rank a scan missed can see its
    peers die and exit with that code before its own SIGKILL lands (seen once in a fresh-clone
    test run)."""
    off_node = set(range(world - ranks_per_node))
    return off_node <= exited <= set(range(world))


def node_loss_spec(
    launcher: str = "slurm/opus100_1000L.sh",
    nodes: int = 4,
    ranks_per_node: int = 8,
    stages: int = 16,
    steps: int = 6,
    save_interval: int = 2,
    kill_after: int = 3,
    micro_batches: int | None = 8,
    overrides: list[str] | None = None,
) -> RehearsalSpec:
    """The launcher at its topology and depth, only the width shrunk (rehearse_slurm's
    :func:`default_spec`); SIGKILL once ``kill_after`` updates are logged (``signal_after``),
    after a checkpoint at ``save_interval``. UserError when the kill could not come after a
    checkpoint, or there is no node to lose."""
    if nodes < 2 or kill_after <= save_interval or save_interval < 1:
        raise UserError(
            "need --nodes >= 2 and --kill-after > --save-interval >= 1 (the kill must come "
            "after a checkpoint)"
        )
    spec = default_spec(
        launcher, nodes, ranks_per_node, stages, steps, kill_after, micro_batches, overrides
    )
    return dataclasses.replace(spec, save_interval=save_interval)


def _set_node(cluster: Cluster, node: str, state: str, reason: str = "") -> None:
    args = ["scontrol", "update", f"NodeName={node}", f"State={state}"]
    cluster.run(*args, *([f"Reason={reason}"] if reason else []), check=False)


def rehearse_node_loss(
    cluster: Cluster,
    spec: RehearsalSpec,
    work: Path,
    timeout: float = 3600.0,
    stuck: float = 300.0,
    poll: float = 0.5,
    echo: bool = False,
) -> NodeLossResult:
    """Submit, SIGKILL the last node's ranks, resubmit on one node fewer, wait; returns the
    checks and figures (module docstring). Job A is cancelled when its other ranks have not
    ended ``stuck`` seconds after the kill (as SLURM would end a job whose node failed); both
    jobs are cancelled on ``timeout``, and the drained node is resumed in any case."""
    work = Path(work).resolve()
    run = work / "run"
    mem_before = _mem_used_gb()
    t_submit = time.time()
    deadline = t_submit + timeout

    def say(msg: str) -> None:
        if echo:
            print(f"[{time.time() - t_submit:7.1f}s] {msg}", flush=True)

    job_a, command_a, log_a = submit(cluster, spec, work)
    say(f"submitted job {job_a}: {command_a}")
    watch_a = _Watch(log_a, run / "metrics.jsonl")
    lost_node = ""
    killed: dict[int, int] = {}  # pid: rank
    t_kill = t_a_end = None
    kill_step = ckpt_step = None
    rows_a: list[dict] = []
    cancelled = False
    state_a = state_b = ""
    job_b, command_b, log_b = "", "", work / "none"
    watch_b = None
    try:
        while time.time() < deadline:
            watch_a.poll()
            complete, _ = ckpt.checkpoint_tags(run)
            if t_kill is None and complete and len(watch_a.step_times) >= spec.signal_after:
                # local reads only until the kill: updates of a small model take 0.2 s
                killed, lost_node = kill_node(job_a, spec.nodes - 1)
                t_kill = time.time()
                kill_step = watch_a.step_times[-1][0]
                if lost_node:
                    _set_node(cluster, lost_node, "DRAIN", "rehearsal: its ranks were killed")
                say(
                    f"update {kill_step} logged, checkpoint {complete[-1]} complete: SIGKILL to "
                    f"ranks {sorted(set(killed.values()))} on {lost_node} (pids "
                    f"{sorted(killed)}); {lost_node} drained"
                )
            state_a = cluster.job_field(job_a, "JobState")
            if state_a in FINAL_STATES:
                break
            if t_kill is not None and not cancelled and time.time() - t_kill > stuck:
                cluster.run("scancel", job_a, check=False)
                cancelled = True
                say(f"job {job_a} still {state_a} {stuck:.0f}s after the kill: scancel {job_a}")
            time.sleep(poll)
        t_a_end = time.time()
        watch_a.poll()
        rows_a = watch_a.rows()  # before a resubmitted job appends to the same file
        complete, _ = ckpt.checkpoint_tags(run)  # the last one complete is the one to resume
        ckpt_step = ckpt.tag_step(complete[-1]) if complete else None
        say(f"job {job_a} {state_a or 'timed out'}")

        if t_kill is not None and state_a in FINAL_STATES:
            spec_b = dataclasses.replace(spec, nodes=spec.nodes - 1)
            job_b, command_b, log_b = submit(cluster, spec_b, work)
            say(f"resubmitted as job {job_b}: {command_b}")
            watch_b = _Watch(log_b, run / "metrics.jsonl", skip_rows=len(rows_a))
            while time.time() < deadline:
                watch_b.poll()
                state_b = cluster.job_field(job_b, "JobState")
                if state_b in FINAL_STATES:
                    break
                time.sleep(poll)
            watch_b.poll()
            say(f"job {job_b} {state_b or 'timed out'}")
    finally:
        for job, state in ((job_a, state_a), (job_b, state_b)):
            if job and state not in FINAL_STATES:
                cluster.run("scancel", job, check=False)
        if lost_node:
            _set_node(cluster, lost_node, "RESUME")
    t_end = time.time()

    text_a = watch_a.text
    text_b = watch_b.text if watch_b is not None else ""
    world_a = spec.nodes * spec.ranks_per_node
    world_b = world_a - spec.ranks_per_node
    survivors = ranks_exited(text_a, PEER_LOST_EXIT_CODE)
    srun_killed = {m.group(1) for m in SRUN_KILLED.finditer(text_a)}
    relaid = RELAID.search(text_b)
    chosen = CHOSEN.search(text_b)
    resumed_step = int(relaid.group(2)) if relaid else None
    rows_b = [s for s, _, _ in watch_b.step_times] if watch_b is not None else []
    by_step = {r["step"] for r in rows_a} | set(rows_b)
    hash_b = {r["step"]: r.get("ids_hash") for r in watch_b.rows()} if watch_b is not None else {}
    redone = [  # updates the killed job logged after the checkpoint, done again
        (r["step"], r.get("ids_hash"), hash_b.get(r["step"]))
        for r in rows_a
        if resumed_step is not None and r["step"] > resumed_step
    ]
    complete, _ = ckpt.checkpoint_tags(run)
    configs = [m.group(1) for m in CONFIG_LINE.finditer(text_a + text_b)]
    layout = "-"
    if chosen:
        s, dp, micro = (int(g) for g in chosen.groups())
        layout = (
            f"{spec.stages} stages x {spec.nodes * spec.ranks_per_node // spec.stages} -> "
            f"{s} stages x {dp} data-parallel, {micro} micro-batches per replica"
        )
    last_a = max((r["step"] for r in rows_a), default=None)
    lost = None if last_a is None or resumed_step is None else last_a - resumed_step
    topology_b = (
        f"world {world_b} = {chosen.group(1)} stages x {chosen.group(2)} data-parallel"
        if chosen
        else "(no layout line)"
    )
    checks = [
        (
            f"SIGKILL to the {spec.ranks_per_node} ranks on the last node",
            set(killed.values()) == set(range(world_a - spec.ranks_per_node, world_a)),
            f"ranks {sorted(set(killed.values()))} ({len(killed)} pids) on {lost_node or '-'}",
        ),
        (
            "killed mid-run, after a complete checkpoint",
            last_a is not None and ckpt_step is not None and ckpt_step <= last_a < spec.steps,
            f"update {kill_step} logged at the kill, {last_a} in all; last complete "
            f"checkpoint {ckpt_step}",
        ),
        (
            "srun reported the node's tasks killed",
            lost_node in srun_killed,
            str(sorted(srun_killed)),
        ),
        (
            f"the other ranks said why in one line and exited {PEER_LOST_EXIT_CODE}",
            peers_said_why(survivors, world_a, spec.ranks_per_node) and "Traceback" not in text_a,
            f"ranks {sorted(survivors)} exited {PEER_LOST_EXIT_CODE}"
            + ("; a traceback in the log" if "Traceback" in text_a else ""),
        ),
        (
            "the job that lost a node ended without completing",
            state_a in FINAL_STATES and state_a != "COMPLETED",
            f"{state_a}{' (scancel)' if cancelled else ''}",
        ),
        (
            f"resubmitted on {spec.nodes - 1} nodes with the same config and overrides",
            len(configs) == 2
            and configs[0] == configs[1]
            and f"{spec.nodes - 1} node(s) x {spec.ranks_per_node} rank(s)" in text_b,
            f"{len(configs)} config lines",
        ),
        (
            "plan_memory planned the fallback layout before the ranks started",
            "layout: layout" in text_b and "the configuration is invalid" not in text_b,
            "",
        ),
        (f"a layout that fits {world_b} ranks", topology_b in text_b, topology_b),
        (
            "resumed from the last complete checkpoint in another layout",
            resumed_step is not None and resumed_step == ckpt_step,
            relaid.group(0)[:160] if relaid else "no 'in another layout' line",
        ),
        (
            "with the whole training state",
            relaid is not None and WHOLE_STATE in relaid.group(4),
            "",
        ),
        (
            "no optimizer state started afresh",
            "afresh" not in text_b and "start fresh" not in text_b,
            "",
        ),
        (
            f"steps lost at most the save interval ({spec.save_interval})",
            lost is not None and 0 <= lost <= spec.save_interval,
            f"{lost}",
        ),
        (
            "the resubmitted job completed",
            state_b == "COMPLETED" and cluster.job_field(job_b, "ExitCode") == "0:0",
            state_b,
        ),
        (
            "metrics: the resubmitted job logged each step after the checkpoint once",
            resumed_step is not None and rows_b == list(range(resumed_step + 1, spec.steps + 1)),
            str(rows_b),
        ),
        (
            "metrics: every step present",
            by_step == set(range(1, spec.steps + 1)),
            str(sorted(by_step)),
        ),
        (
            "the redone updates read the same samples (ids_hash)",
            all(a is not None and a == b for _, a, b in redone),
            ", ".join(f"step {st}: {a} {'=' if a == b else '!='} {b}" for st, a, b in redone)
            or "none redone",
        ),
        (
            "the last checkpoint is the last step's",
            bool(complete) and ckpt.tag_step(complete[-1]) == spec.steps,
            str(complete),
        ),
    ]

    def since(ta: float | None, tb: float | None) -> float | None:
        return None if ta is None or tb is None else tb - ta

    ev_b = watch_b.events if watch_b is not None else {}
    first_b = watch_b.step_times[0][1] if watch_b is not None and watch_b.step_times else None
    first_a = watch_a.step_times[0][1] if watch_a.step_times else None
    figures = {
        "submit to first update, s": since(t_submit, first_a),
        f"time per update, {spec.nodes} nodes, s": _per_update(watch_a.step_times),
        "kill to the job's end, s": since(t_kill, t_a_end),
        "resubmit to job start, s": since(t_a_end, ev_b.get("start")),
        "job start to resumed, s": since(ev_b.get("start"), ev_b.get("resumed")),
        "job start to first update, s": since(ev_b.get("start"), first_b),
        f"time per update, {spec.nodes - 1} nodes, s": (
            _per_update(watch_b.step_times) if watch_b is not None else None
        ),
        "updates redone (logged after the checkpoint, before the kill)": lost,
        "kill to the first new update, s": since(t_kill, first_b),
        "total (submit to completed), s": t_end - t_submit,
        "host memory in use at peak, above idle, GB": (
            max(w.mem_peak for w in (watch_a, watch_b) if w is not None and w.mem_peak) - mem_before
            if mem_before is not None and watch_a.mem_peak is not None
            else None
        ),
    }
    return NodeLossResult(
        [job_a, job_b],
        [command_a, command_b],
        [log_a, log_b],
        [state_a, state_b],
        checks,
        figures,
        layout,
    )


def format_node_loss(result: NodeLossResult) -> str:
    """The checks and figures as Markdown tables, the layout and both commands."""
    lines = ["| check | ok | seen |", "| --- | --- | --- |"]
    lines += [f"| {n} | {'yes' if ok else 'NO'} | {s} |" for n, ok, s in result.checks]
    lines += ["", "| figure | value |", "| --- | ---: |"]
    for name, value in result.figures.items():
        lines.append(f"| {name} | {'-' if value is None else f'{value:.1f}'} |")
    lines += ["", f"layout: {result.layout}"]
    for job, log, command in zip(result.jobs, result.logs, result.commands, strict=True):
        lines += ["", f"job {job or '-'}, log {log}", command]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

USAGE = """Rehearse losing a node of a shipped sbatch launcher's job on a local CPU SLURM cluster:
start K local nodes, submit the launcher unchanged (only the model's width shrunk) with a save
interval, SIGKILL every rank on the last node after a checkpoint and one more update, drain the
node, resubmit the same command on K-1 nodes (same SAVE_DIR, same EXTRA_ARGS: no config edit),
and check that the new job resumes from the last complete checkpoint in a layout that fits its
ranks, with the whole training state, and finishes. Prints the checks, the figures (steps lost,
layout chosen, time) and both sbatch commands; exit 0 when every check passed.

    python tools/rehearse_node_loss.py                      # opus100_1000L: 4 x 8 -> 3 x 8 ranks
    python tools/rehearse_node_loss.py --launcher slurm/opus100_200L.sh --nodes 2
    python tools/rehearse_node_loss.py --cluster /tmp/mbslurm   # a cluster already started

The 1000-layer case needs ~10-11 GB of memory for its 32 ranks and 9 minutes (fp32) to 15
(bf16) on 2 cores (docs/slurm.md): run it alone. Bad input or a cluster that does not start: one line ``error: ...``, exit 2.
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see :data:`USAGE`)."""
    parser = rehearsal_parser(USAGE)
    parser.add_argument("--steps", type=int, default=6, help="train.max_steps")
    parser.add_argument("--save-interval", type=int, default=2, help="train.save_interval")
    parser.add_argument("--kill-after", type=int, default=3, help="updates logged before SIGKILL")
    parser.add_argument(
        "--micro-batches", type=int, default=8, help="train.micro_batches (0: the config's)"
    )
    parser.add_argument(
        "--ds-config",
        default="ds_configs/cpu_fp32.json",
        help="DS_CONFIG for the job (ds_configs/zero1_bf16.json: the 1000L config's own)",
    )
    parser.add_argument("--time", default="120", help="sbatch --time (above the signal lead)")
    parser.add_argument("--timeout", type=float, default=5400.0, help="seconds for both jobs")
    return parser.parse_args(argv)


def _rehearse(argv: list[str] | None) -> int:
    args = parse_args(argv)
    if args.work is not None:  # before a cluster starts: its job's files are created there
        check_scratch_dir(args.work, "--work", "rehearse_node_loss", ())
    spec = node_loss_spec(
        args.launcher,
        args.nodes,
        args.ranks_per_node,
        launcher_stages(args.launcher),
        args.steps,
        args.save_interval,
        args.kill_after,
        args.micro_batches or None,
    )
    spec.time_limit = args.time
    spec.ds_config = args.ds_config
    work = args.work or Path(tempfile.mkdtemp(prefix="node_loss_"))
    with local_cluster(args.cluster, work / "slurm", args.nodes, args.ranks_per_node) as cluster:
        result = rehearse_node_loss(cluster, spec, work / "job", timeout=args.timeout, echo=True)
    print(format_node_loss(result))
    for failure in result.failures():
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if result.failures() else 0


def main(argv: list[str] | None = None) -> int:
    """``tools/rehearse_node_loss.py``: exit 0 when every check passed, 1 when one failed, 2 on
    bad input or a cluster that cannot start."""
    return run_main(_rehearse, argv)


if __name__ == "__main__":
    sys.exit(main())
