"""Rehearse a config at its real depth and topology, width shrunk, on gloo ranks on this machine.

    python tools/rehearse.py --config opus100_1000L --markdown rehearsal.md --json rehearsal.json
    python tools/rehearse.py --config tiny_cpu --stages 4 --world 4

Runs the config's pipeline stages x the data-parallel size of its SLURM launcher (or --world)
as plain processes, with d=16 and synthetic data, and checks: the first updates equal one
process's; SIGUSR1 saves and the same topology resumes exactly; another stage count resumes
at the step; the checkpoint converts to an export that translates. Prints one table with the
start-up time, time per update, peak memory per rank, save/resume times and checkpoint size.
Exit codes: 0 all checks passed, 1 a check failed, 2 bad input. Details: docs/rehearsal.md.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from megatron_branchnorm import rehearse


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    head, _, rest = __doc__.partition("\n\n")
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


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse, rehearse, check, print the table."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    workdir = Path(args.workdir or Path("runs") / "rehearse" / Path(args.config).stem)
    try:
        if not args.evaluate_only:
            plan = rehearse.make_plan(
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
            rehearse.rehearse(plan, workdir, overwrite=args.overwrite)
        report = rehearse.evaluate(workdir)
    except rehearse.RehearsalError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(rehearse.format_table(report), flush=True)
    rehearse.write_outputs(report, args.json, args.markdown)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
