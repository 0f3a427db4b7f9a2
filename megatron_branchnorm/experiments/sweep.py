"""A depth-by-scheme sweep on SLURM, and its results as a table (the layout of the BranchNorm
paper's Tables 1-3: a row per residual scheme, a column per depth).

    python tools/sweep.py submit --launcher slurm/opus100_12L.sh --schemes postln,deepnorm,branchnorm \\
        --depths 6,18,50 --out runs/sweep_wmt17 --extra "data.dataset=data/wmt17"
    python tools/sweep.py table runs/sweep_wmt17 --markdown runs/sweep_wmt17/table.md

``submit`` sends one job per cell through an sbatch launcher of slurm/ (its own SAVE_DIR,
``model.residual`` and N-N layers as overrides; each job requeues and resumes on its own),
and writes OUT/sweep.json. A set of jobs rather than a job array: each cell keeps its own job
id, log and requeue, and a failed cell is resubmitted alone (``submit`` again skips the cells
already in OUT/sweep.json; ``--resubmit CELL,...`` sends those again, e.g. after a failure).

``table`` reads each cell's run: the best validation BLEU of the companion
(``valid_bleu.jsonl``, tools/watch_bleu.py), or with ``--metric valid_loss`` the last
validation loss; "diverged" where the run diverged, decided from its metrics.jsonl alone: a
training loss that is not finite, or a run that stopped on ``train.max_consecutive_skips``
non-finite updates in a row (its last row is a skipped update). ``--paper FILE`` puts published
figures (JSON ``{"scheme": {"depth": value}}``) beside ours; none ship with the project.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from megatron_branchnorm.training.metrics import read_metrics, training_rows, valid_bleus

SWEEP_FILE = "sweep.json"
SCHEMES = ("postln", "preln", "deepnorm", "branchnorm")


class SweepError(ValueError):
    """Bad input to the sweep: one line."""


def cell_name(scheme: str, depth: int) -> str:
    return f"{scheme}_{depth}L"


def cell_overrides(scheme: str, depth: int, extra: list[str]) -> list[str]:
    """The trainer's overrides of a cell: the scheme and an N-N model, then ``extra``."""
    return [
        f"model.residual={scheme}",
        f"model.encoder_layers={depth}",
        f"model.decoder_layers={depth}",
        *extra,
    ]


def submit(
    launcher: Path,
    schemes: list[str],
    depths: list[int],
    out: Path,
    extra: list[str],
    sbatch: list[str],
    env: dict[str, str] | None = None,
    resubmit: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Submit every cell not in sweep.json yet, and the cells named in ``resubmit``; returns
    sweep.json's data (written after each submission, so an interrupted submit loses none)."""
    if not launcher.is_file():
        raise SweepError(f"--launcher {launcher}: no such file")
    out.mkdir(parents=True, exist_ok=True)
    path = out / SWEEP_FILE
    sweep = json.loads(path.read_text()) if path.is_file() else {"cells": {}}
    for scheme in schemes:
        for depth in depths:
            name = cell_name(scheme, depth)
            cell = out / name
            save_dir = cell / "run"
            if name in sweep["cells"] and name not in resubmit:
                continue
            cell.mkdir(exist_ok=True)
            job_env = dict(os.environ if env is None else env)
            job_env["SAVE_DIR"] = str(save_dir.resolve())
            job_env["EXTRA_ARGS"] = " ".join(cell_overrides(scheme, depth, extra))
            cmd = [
                "sbatch",
                "--parsable",
                f"--job-name=sweep_{name}",
                f"--chdir={cell.resolve()}",
                f"--output={cell.resolve()}/%x-%j.out",
                *sbatch,
                str(launcher.resolve()),
            ]
            proc = subprocess.run(cmd, env=job_env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SweepError(f"sbatch for {name} failed: {proc.stderr.strip()[:300]}")
            job = proc.stdout.strip().split(";")[0]
            sweep["cells"][name] = {
                "scheme": scheme,
                "depth": depth,
                "save_dir": str(save_dir.resolve()),
                "job_id": job,
                "launcher": str(launcher),
                "overrides": cell_overrides(scheme, depth, extra),
            }
            path.write_text(json.dumps(sweep, indent=1) + "\n")
            print(f"{name}: job {job}", flush=True)
    path.write_text(json.dumps(sweep, indent=1) + "\n")
    return sweep


def diverged(save_dir: Path) -> bool:
    """A training loss that is not finite, or a last row that is a skipped (non-finite) update:
    the run stopped on train.max_consecutive_skips."""
    rows = read_metrics(save_dir)
    losses = [r["loss"] for r in training_rows(rows)]
    if any(not isinstance(x, (int, float)) or not math.isfinite(x) for x in losses):
        return True
    return bool(rows) and bool(rows[-1].get("skipped"))


def cell_result(save_dir: Path, metric: str) -> dict[str, Any]:
    """{"status": "diverged" | "no result" | "ok", "value", "step"} of one run."""
    if diverged(save_dir):
        return {"status": "diverged", "value": None, "step": None}
    if metric == "valid_bleu":
        scores = valid_bleus(save_dir)
        if scores:
            step = max(scores, key=lambda s: (scores[s], -s))
            return {"status": "ok", "value": scores[step], "step": step}
    else:
        rows = [r for r in read_metrics(save_dir) if "valid_loss" in r]
        if rows:
            return {"status": "ok", "value": rows[-1]["valid_loss"], "step": rows[-1]["step"]}
    return {"status": "no result", "value": None, "step": None}


def collect(out: Path, metric: str) -> dict[str, Any]:
    """Every cell's result: {"metric", "schemes", "depths", "cells": {name: {...}}}."""
    path = out / SWEEP_FILE
    if not path.is_file():
        raise SweepError(f"{path}: missing (run `sweep.py submit` first)")
    sweep = json.loads(path.read_text())
    cells = {}
    for name, cell in sweep["cells"].items():
        cells[name] = {**cell, **cell_result(Path(cell["save_dir"]), metric)}
    schemes = [s for s in SCHEMES if any(c["scheme"] == s for c in cells.values())]
    schemes += sorted({c["scheme"] for c in cells.values()} - set(schemes))
    depths = sorted({int(c["depth"]) for c in cells.values()})
    return {"metric": metric, "schemes": schemes, "depths": depths, "cells": cells}


def format_table(result: dict[str, Any], paper: dict[str, dict[str, float]] | None = None) -> str:
    """Markdown: a row per scheme, a column per depth; ``ours (paper)`` with ``paper``."""
    digits = 2 if result["metric"] == "valid_bleu" else 3
    head = f"| {result['metric']} | " + " | ".join(f"{d}L-{d}L" for d in result["depths"]) + " |"
    lines = [head, "| --- |" + " ---: |" * len(result["depths"])]
    for scheme in result["schemes"]:
        row = []
        for depth in result["depths"]:
            cell = result["cells"].get(cell_name(scheme, depth))
            if cell is None:
                text = ""
            elif cell["status"] == "ok":
                text = f"{cell['value']:.{digits}f}"
            else:
                text = cell["status"]
            published = (paper or {}).get(scheme, {}).get(str(depth))
            if published is not None:
                text = f"{text} ({published})"
            row.append(text)
        lines.append(f"| {scheme} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("submit", help="submit one job per (scheme, depth)")
    s.add_argument("--launcher", required=True, help="an sbatch launcher of slurm/")
    s.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated")
    s.add_argument("--depths", required=True, help="comma-separated N of N-N models")
    s.add_argument("--out", required=True, help="the sweep's directory (one subdirectory a cell)")
    s.add_argument("--extra", default="", help="more section.key=value overrides, space-separated")
    s.add_argument("--sbatch", default="", help="more sbatch options, space-separated")
    s.add_argument("--resubmit", default="", help="cells to submit again, e.g. postln_50L")
    t = sub.add_parser("table", help="collect the cells' results into one table")
    t.add_argument("out", help="the sweep's directory")
    t.add_argument("--metric", choices=("valid_bleu", "valid_loss"), default="valid_bleu")
    t.add_argument("--paper", default=None, help='published figures: {"scheme": {"depth": x}}')
    t.add_argument("--markdown", default=None, help="also write the table here")
    t.add_argument("--json", default=None, help="also write every cell's result here")
    return p.parse_args(argv)


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SweepError(f"{flag} {text!r}: expected comma-separated integers") from None
    if not values or min(values) < 1:
        raise SweepError(f"{flag} {text!r}: expected depths >= 1")
    return values


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "submit":
            schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
            unknown = [s for s in schemes if s not in SCHEMES]
            if unknown or not schemes:
                raise SweepError(f"--schemes: unknown {', '.join(unknown)} ({', '.join(SCHEMES)})")
            depths = _int_list(args.depths, "--depths")
            submit(
                Path(args.launcher),
                schemes,
                depths,
                Path(args.out),
                args.extra.split(),
                args.sbatch.split(),
                resubmit=tuple(x.strip() for x in args.resubmit.split(",") if x.strip()),
            )
            return 0
        paper = None
        if args.paper:
            try:
                paper = json.loads(Path(args.paper).read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise SweepError(f"--paper {args.paper}: {exc}") from None
        result = collect(Path(args.out), args.metric)
        table = format_table(result, paper)
        print(table)
        if args.markdown:
            Path(args.markdown).write_text(table + "\n", encoding="utf-8")
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        return 0
    except SweepError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
