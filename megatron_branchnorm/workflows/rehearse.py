"""Rehearse a config at its real depth and topology, width shrunk, on gloo ranks on one machine.

    python tools/rehearse.py --config opus100_1000L            # 16 stages x 2 = 32 ranks
    python tools/rehearse.py --config tiny_cpu --stages 4 --world 4

The pipeline stage count comes from the config, the world size from the config's SLURM
launcher (``#SBATCH --nodes`` x ``--ntasks-per-node`` of ``slurm/<config>.sh``) or ``--world``;
only the width is shrunk (:data:`SHRINK`: d=16, vocabulary 64, synthetic data, fp32, dropout 0).
Every rank is a plain ``python -m megatron_branchnorm.train`` process with RANK/WORLD_SIZE/...
in its environment, as under ``srun``. Five runs:

- ``uninterrupted``: the real topology, ``steps`` updates;
- ``interrupted``: the same, SIGUSR1 to every rank once rank 0 logged update ``signal_after``
  (checkpoint, exit 75), then ``resumed``: the same command again, to ``steps``;
- ``other_topology``: the interrupted run's save_dir continued with ``other_stages`` stages
  (weights, fp32 master weights and Adam's state re-laid per parameter: docs/design.md §17)
  for ``other_steps`` more updates, the global batch
  (micro-batches x data-parallel) kept;
- ``reference``: one process (1 stage) with the whole global batch as its micro-batches.

Then the checks (each pass or fail; the tool exits 1 when one fails):

1. parity: the uninterrupted run's updates equal the reference's (docs/design.md §5: 1e-4
   relative loss per step; lr and alpha exactly);
2. exact resume: the interrupted + resumed run's loss, nll, lr, alpha and grad norm equal the
   uninterrupted run's bit for bit; its metrics.jsonl has every step once;
3. other topology: it resumes at the step, every step once, and its first update equals the
   reference's (1e-4 loss; lr and alpha exactly);
4. export: the real-topology checkpoint (one file per layer) converts, with its checksums
   verified, to an export that computes what the checkpoint does and translates a sentence.

Figures: start-up (launch to the first update logged), time per update, peak RSS of every
rank (``VmHWM``) and the machine's memory in use, checkpoint save and load times, checkpoint
files and bytes, conversion and translation times. ``evaluate``
computes the checks and figures from a finished work directory again (``--evaluate-only``).

This module is the job and its command line; its parts: the plan (``rehearse_plan.py``), one
run on its ranks (``rehearse_runs.py``), the checks (``rehearse_checks.py``) and the report
(``rehearse_report.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

from megatron_branchnorm.cli import run_main
from megatron_branchnorm.formats.outputs import OutputError, prepare_output, write_marker
from megatron_branchnorm.training.exit_codes import REQUEUE_EXIT_CODE
from megatron_branchnorm.workflows.rehearse_plan import (
    Plan,
    RehearsalError,
    make_plan,
    run_world,
)
from megatron_branchnorm.workflows.rehearse_report import (
    check_outputs,
    evaluate,
    format_table,
    write_outputs,
)
from megatron_branchnorm.workflows.rehearse_runs import (
    RUNS_FILE,
    cpu_description,
    launch,
    run_ok,
)

__all__ = ["RUNS_FILE", "Plan", "RehearsalError", "evaluate", "main", "make_plan", "rehearse"]

REHEARSAL_KIND = "rehearsal"
"""The marker kind of a rehearsal's --workdir (outputs.MARKER)."""


def check_workdir(workdir: Path, overwrite: bool) -> bool:
    """Whether ``workdir`` is to be replaced: new or empty, or (with ``overwrite``) a
    rehearsal's workdir holding only its own entries (its marker, or runs.json from before
    markers); never inside a directory of a known kind (outputs.prepare_output). A
    RehearsalError, one line, otherwise."""
    try:  # --overwrite removes only a workdir a rehearsal wrote (its marker, or runs.json)
        return prepare_output(
            workdir,
            REHEARSAL_KIND,
            overwrite,
            "--workdir",
            legacy=lambda p: (p / "runs.json").is_file(),
        )
    except OutputError as exc:
        raise RehearsalError(str(exc)) from None


def rehearse(plan: Plan, workdir: Path, overwrite: bool = False, echo=print) -> dict[str, Any]:
    """Run the five runs into ``workdir`` (stopping at the first that fails); writes and
    returns the runs record (``runs.json``)."""
    replace = check_workdir(workdir, overwrite)
    if replace:
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    write_marker(workdir, "rehearse", REHEARSAL_KIND)
    record: dict[str, Any] = {"plan": dataclasses.asdict(plan), "cpu": cpu_description()}
    record["runs"] = {}
    order = [
        ("uninterrupted", None, 0),
        ("interrupted", plan.signal_after, REQUEUE_EXIT_CODE),
        ("resumed", None, 0),
        ("other_topology", None, 0),
        ("reference", None, 0),
    ]
    for name, signal_after, expect in order:
        w = run_world(plan, name)
        echo(f"[rehearse] {name}: {w} rank(s) ...", flush=True)
        run = launch(plan, name, workdir, signal_after)
        record["runs"][name] = run
        (workdir / RUNS_FILE).write_text(json.dumps(record, indent=1), encoding="utf-8")
        echo(
            f"[rehearse] {name}: exit codes {sorted(set(run['exit_codes']))} in "
            f"{run['wall_s']:.0f}s",
            flush=True,
        )
        if not run_ok(run, expect):
            echo("\n".join(run["tail"]), flush=True)
            break
    return record


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

USAGE = """Rehearse a config at its real depth and topology, width shrunk, on gloo ranks on this machine.

    python tools/rehearse.py --config opus100_1000L --markdown rehearsal.md --json rehearsal.json
    python tools/rehearse.py --config tiny_cpu --stages 4 --world 4

Runs the config's pipeline stages x the data-parallel size of its SLURM launcher (or --world)
as plain processes, with d=16 and synthetic data, and checks: the first updates equal one
process's; SIGUSR1 saves and the same topology resumes exactly; another stage count resumes
at the step; the checkpoint converts to an export that translates. Prints one table with the
start-up time, time per update, peak memory per rank, save/resume times and checkpoint size.
Exit codes: 0 all checks passed, 1 a check failed, 2 bad input. Details: docs/rehearsal.md.
"""
"""The command line's help (``tools/rehearse.py --help``)."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line (see :data:`USAGE`)."""
    head, _, rest = USAGE.partition("\n\n")
    p = argparse.ArgumentParser(
        prog="rehearse.py",
        description=head,
        epilog=rest,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, help="shipped config name or YAML path")
    p.add_argument(
        "--world", type=int, default=None, help="ranks (default: from slurm/<config>.sh)"
    )
    p.add_argument("--stages", type=int, default=None, help="pipeline stages (default: config's)")
    p.add_argument(
        "--other-stages",
        type=int,
        default=None,
        help="stages of the resume on another topology (default: half the stages)",
    )
    p.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        help="micro-batches per update and replica (default: the config's; the table says so "
        "when reduced)",
    )
    p.add_argument("--steps", type=int, default=4, help="updates compared (default 4)")
    p.add_argument(
        "--other-steps", type=int, default=1, help="updates on the other topology (default 1)"
    )
    p.add_argument(
        "--signal-after", type=int, default=1, help="SIGUSR1 once update N is logged (default 1)"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra config override for every run (after the width-shrinking ones)",
    )
    p.add_argument("--workdir", default=None, help="default: runs/rehearse/<config>")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --workdir")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run (default 3600)")
    p.add_argument("--json", default=None, help="write the report as JSON")
    p.add_argument("--markdown", default=None, help="write the table as markdown")
    p.add_argument(
        "--evaluate-only",
        action="store_true",
        help="run no training: check and tabulate the finished rehearsal in --workdir again",
    )
    return p.parse_args(argv)


def _rehearse(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    workdir = Path(args.workdir or Path("runs") / "rehearse" / Path(args.config).stem)
    if not args.evaluate_only:  # before any work; rehearse() replaces it only once planned
        check_workdir(workdir, args.overwrite)
    check_outputs(workdir, args.json, args.markdown)
    if not args.evaluate_only:
        plan = make_plan(
            args.config,
            args.set,
            world=args.world,
            stages=args.stages,
            other_stages=args.other_stages,
            micro_batches=args.micro_batches,
            steps=args.steps,
            other_steps=args.other_steps,
            signal_after=args.signal_after,
            timeout_s=args.timeout,
        )
        plan.command = shlex.join(["python", "tools/rehearse.py", *argv])
        rehearse(plan, workdir, overwrite=args.overwrite)
    report = evaluate(workdir)
    print(format_table(report), flush=True)
    write_outputs(report, args.json, args.markdown)
    return 0 if report["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point (``tools/rehearse.py``, ``mbn-rehearse``): parse, rehearse, check, print the
    table. Bad input is one line ``error: ...`` and exit 2."""
    return run_main(_rehearse, argv)


if __name__ == "__main__":
    sys.exit(main())
