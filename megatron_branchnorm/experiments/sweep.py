"""A depth-by-scheme sweep on SLURM, and its results as a table (the layout of the BranchNorm
paper's Tables 1-3: a row per residual scheme, a column per depth).

    python tools/sweep.py submit --launcher slurm/opus100_12L.sh --schemes postln,deepnorm,branchnorm \\
        --depths 6,18,50 --out runs/sweep_wmt17 --extra "data.dataset=data/wmt17"
    python tools/sweep.py table runs/sweep_wmt17 --markdown runs/sweep_wmt17/table.md
    python tools/sweep.py submit --task wmt17_en_de --schemes postln,deepnorm,branchnorm \\
        --depths 6,18,50 --out runs/wmt17 --extra "data.dataset=data/wmt17_en_de"
    python tools/sweep.py table runs/wmt17          # the paper's Table 1 column beside ours

``submit`` sends one job per cell through an sbatch launcher of slurm/ (its own SAVE_DIR,
``model.residual`` and N-N layers as overrides; each job requeues and resumes on its own),
and writes OUT/sweep.json. A set of jobs rather than a job array: each cell keeps its own job
id, log and requeue, and a failed cell is resubmitted alone (``submit`` again skips the cells
already in OUT/sweep.json; ``--resubmit CELL,...`` sends those again, e.g. after a failure).
With ``--task`` (one of the paper's tasks, megatron_branchnorm/paper.py) each cell runs the
task's recipe config of its depth (``CONFIG=<task>_<N>L``: its topology and batch) through
slurm/recipe.sh unless ``--launcher`` names another, and sweep.json records the task.

``table`` reads each cell's run: the best validation BLEU of the companion
(``valid_bleu.jsonl``, tools/watch_bleu.py) among the checkpoints on disk, each scored as it
is now (retention's rule: a score of a checkpoint that a resume rewrote never counts), or
with ``--metric valid_loss`` the last validation loss; "diverged" where the run diverged,
decided from its metrics.jsonl alone: a training loss that is not finite, or a run that stopped
on ``train.max_consecutive_skips`` non-finite updates in a row (its last row is a skipped
update).

The paper's published BLEU ship with the package (megatron_branchnorm/paper.py): a sweep
submitted with ``--task`` shows its task's column beside each depth of ours; ``--paper`` alone
does the same (an error when the sweep has no task), ``--paper TASK`` names a task, ``--paper
FILE`` reads figures from JSON ``{"scheme": {"depth": value}}``, ``--no-paper`` leaves them out.
A published cell prints as the paper prints it: ``28.1``, ``29.x`` where its decimals were lost
(never a number), ``diverged``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from megatron_branchnorm.cli import ArgumentParser, run_main
from megatron_branchnorm.config import CONFIG_DIR
from megatron_branchnorm.errors import UserError
from megatron_branchnorm.experiments.depth_study import SCHEMES, known_schemes
from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.formats import dirs
from megatron_branchnorm.formats.files import FileShapeError, quote, read_small_file
from megatron_branchnorm.formats.outputs import (
    check_output_file,
    check_parent_dir,
    read_report,
    refuse_inside_kind,
    write_text_output,
)
from megatron_branchnorm.formats.records import read_metrics
from megatron_branchnorm.paper import (
    MAX_PUBLISHED_BYTES,
    TASKS,
    PaperError,
    format_cell,
    get_task,
    published_rows,
    read_published,
)
from megatron_branchnorm.training import retention
from megatron_branchnorm.training.metrics import training_rows

SWEEP_FILE = "sweep.json"
RECIPE_LAUNCHER = Path(__file__).resolve().parents[2] / "slurm" / "recipe.sh"
MAX_DEPTH = 1000
"""Deepest N of an N-N cell: the paper's deepest models have 1,000 layers a side; a larger
``--depths`` is a typo, refused before anything is submitted."""
MAX_SWEEP_BYTES = 16 << 20
"""Largest sweep.json read (a registry of a few hundred cells is ~100 KB)."""


class SweepError(UserError, ValueError):
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
    task: str | None = None,
) -> dict[str, Any]:
    """Submit every cell not in sweep.json yet, and the cells named in ``resubmit``; returns
    sweep.json's data (written after each submission, so an interrupted submit loses none).
    With ``task`` each cell's job runs the recipe config ``<task>_<depth>L``."""
    check_sweep_out(out)
    if not launcher.is_file():
        raise SweepError(f"--launcher {launcher}: no such file")
    if task is not None:
        recipe_configs(task, depths)
    job_path = (os.environ if env is None else env).get("PATH", os.defpath)
    if shutil.which("sbatch", path=job_path) is None:
        raise SweepError(
            "sbatch: not found on PATH; submit runs on a SLURM login node (or with "
            "tools/local_slurm.py's cluster on PATH)"
        )
    path = out / SWEEP_FILE
    sweep = read_sweep(path) if path.is_file() else {"cells": {}}
    out.mkdir(parents=True, exist_ok=True)
    if task is not None and sweep.get("task", task) != task:
        raise SweepError(f"--task {task}: {path} is a sweep of task {sweep['task']}")
    if task is not None:
        sweep["task"] = task
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
            if task is not None:
                job_env["CONFIG"] = get_task(task).config_name(depth)
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
                **({"config": job_env["CONFIG"]} if task is not None else {}),
            }
            path.write_text(json.dumps(sweep, indent=1) + "\n")
            print(f"{name}: job {job}", flush=True)
    path.write_text(json.dumps(sweep, indent=1) + "\n")
    return sweep


def check_sweep_out(out: Path) -> None:
    """Refuse, before anything is submitted, an --out that is a file or lies under one, lies
    inside a directory of a known kind (a run, a DATA_DIR...), or is a non-empty directory
    that is not a sweep's (no sweep.json): the cells' runs are created inside it."""
    if out.exists() and not out.is_dir():
        raise SweepError(f"--out {out}: is not a directory (the sweep's directory is expected)")
    check_parent_dir(out, "--out")
    refuse_inside_kind(out, "--out", "a sweep's directory")
    if out.is_dir() and any(out.iterdir()) and not (out / SWEEP_FILE).is_file():
        found = dirs.recognise(out)
        what = f"it is {dirs.describe(found[0])} ({found[1]})" if found else f"no {SWEEP_FILE}"
        raise SweepError(
            f"--out {out}: exists, is not empty and is not a sweep's directory ({what}); "
            "choose a new or empty --out"
        )


TABLE_HEAD = re.compile(r"^\| valid_(bleu|loss) \|( \d+L-\d+L \|( paper \|)?)* *$")
"""The first line of a table of ours (:func:`format_table`)."""


def is_our_table(path: Path) -> bool:
    """Whether ``path`` holds a --markdown table of ours (its first line)."""
    try:
        head = read_small_file(path, 1 << 20).decode("utf-8").split("\n", 1)[0]
    except (OSError, ValueError):  # FileShapeError, UnicodeDecodeError too
        return False
    return TABLE_HEAD.match(head) is not None


RESULT_KEYS = frozenset({"metric", "task", "schemes", "depths", "cells"})
"""The keys of a --json result of ours (:func:`collect`)."""


def is_our_result(path: Path) -> bool:
    """Whether ``path`` holds a --json result of ours (exactly :data:`RESULT_KEYS`)."""
    data = read_report(path)
    return isinstance(data, dict) and set(data) == RESULT_KEYS


def read_sweep(path: Path) -> dict[str, Any]:
    """OUT/sweep.json, the job registry: ``{"cells": {name: {"scheme", "depth", "save_dir",
    ...}}, "task"?}``; a damaged or foreign file is a one-line SweepError naming it."""

    def damaged(why: str) -> SweepError:
        return SweepError(f"{path}: not a sweep registry ({why}); restore it or submit anew")

    try:
        data = json.loads(read_small_file(path, MAX_SWEEP_BYTES))
    except FileShapeError as exc:  # a FIFO, a device, a larger file: never read whole
        raise damaged(str(exc).removeprefix(f"{path}: ")) from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise damaged(f"invalid JSON: {' '.join(str(exc).split())[:200]}") from None
    if not isinstance(data, dict) or not isinstance(data.get("cells"), dict):
        raise damaged('expected an object with "cells"')
    if data.get("task") is not None and not isinstance(data["task"], str):
        raise damaged(f'"task" is {quote(data["task"])}')
    for name, cell in data["cells"].items():
        if not isinstance(cell, dict):
            raise damaged(f"cell {quote(name)} is not an object")
        for key, kind in (("scheme", str), ("save_dir", str), ("depth", int)):
            value = cell.get(key)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise damaged(f"cell {quote(name)}: {key} is {quote(value)}")
    return data


def recipe_configs(task: str, depths: list[int]) -> list[str]:
    """The shipped recipe configs of ``task`` at ``depths``; a depth without one is an error."""
    try:
        t = get_task(task)
    except PaperError as exc:
        raise SweepError(f"--task: {exc}") from None
    names = [t.config_name(d) for d in depths]
    missing = [n for n in names if not (CONFIG_DIR / f"{n}.yaml").is_file()]
    if missing:
        known = ", ".join(str(d) for d in t.depths)
        raise SweepError(f"--task {task}: no recipe config {', '.join(missing)} (depths: {known})")
    return names


def diverged(save_dir: Path) -> bool:
    """A training loss that is not finite, or a last row that is a skipped (non-finite) update:
    the run stopped on train.max_consecutive_skips."""
    rows = read_metrics(save_dir)
    losses = [r["loss"] for r in training_rows(rows)]
    if any(not isinstance(x, (int, float)) or not math.isfinite(x) for x in losses):
        return True
    return bool(rows) and bool(rows[-1].get("skipped"))


def ranked_bleus(save_dir: Path) -> dict[int, float]:
    """Validation BLEU by step of the checkpoints now in ``save_dir``, by the rule that ranks
    them for retention (:func:`retention.read_scores`): only a dev-split row that scored the
    checkpoint now at its step (its checkpoint id), under one scoring. A score of a checkpoint
    that a resume rewrote since, or that retention removed, never counts (keep_best keeps the
    best on disk)."""
    complete, _ = ckpt.checkpoint_tags(save_dir)
    return retention.read_scores(
        save_dir, "valid_bleu", retention.checkpoint_ids(save_dir, complete)
    )


def cell_result(save_dir: Path, metric: str) -> dict[str, Any]:
    """{"status": "diverged" | "no result" | "ok", "value", "step"} of one run."""
    if diverged(save_dir):
        return {"status": "diverged", "value": None, "step": None}
    if metric == "valid_bleu":
        scores = ranked_bleus(save_dir)
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
    sweep = read_sweep(path)
    cells = {}
    for name, cell in sweep["cells"].items():
        cells[name] = {**cell, **cell_result(Path(cell["save_dir"]), metric)}
    schemes = [s for s in SCHEMES if any(c["scheme"] == s for c in cells.values())]
    schemes += sorted({c["scheme"] for c in cells.values()} - set(schemes))
    depths = sorted({int(c["depth"]) for c in cells.values()})
    return {
        "metric": metric,
        "task": sweep.get("task"),
        "schemes": schemes,
        "depths": depths,
        "cells": cells,
    }


def format_table(
    result: dict[str, Any], paper: dict[str, dict[str, Any]] | None = None, source: str = ""
) -> str:
    """Markdown in the paper's layout: a row per scheme, a column per depth; with ``paper``
    (``{"scheme": {"depth": cell}}``) each depth's column of ours is followed by the published
    one, and a last line names ``source``."""
    digits = 2 if result["metric"] == "valid_bleu" else 3
    head = [result["metric"]]
    for d in result["depths"]:
        head += [f"{d}L-{d}L"] + (["paper"] if paper is not None else [])
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for scheme in result["schemes"]:
        row = [scheme]
        for depth in result["depths"]:
            cell = result["cells"].get(cell_name(scheme, depth))
            if cell is None:
                text = ""
            elif cell["status"] == "ok":
                text = f"{cell['value']:.{digits}f}"
            else:
                text = cell["status"]
            row.append(text)
            if paper is not None:
                row.append(format_cell_or_blank(paper.get(scheme, {}).get(str(depth))))
        lines.append("| " + " | ".join(row) + " |")
    if paper is not None and source:
        lines += ["", source]
    return "\n".join(lines)


def format_cell_or_blank(value: Any) -> str:
    """A published cell as printed, or "" where the paper has none."""
    return "" if value is None else format_cell(value)


def paper_figures(
    choice: str | None, task: str | None
) -> tuple[dict[str, dict[str, str]] | None, str]:
    """(published figures, a line naming their source) for ``table``: ``choice`` is None (the
    sweep's task when it has one), "" (``--paper`` alone: the sweep's task), a task name or a
    JSON file; "-" (``--no-paper``) is none."""
    if choice == "-" or (choice is None and task is None):
        return None, ""
    name = choice or task
    if name is None:
        raise SweepError(
            f"--paper: the sweep has no task (submit --task ...): name one "
            f"({', '.join(TASKS)}) or a JSON file"
        )
    if name in TASKS:
        t = TASKS[name]
        rows = ", ".join(f"{s} = {r}" for s, r in t.row_names.items())
        where = f"{t.table} of the BranchNorm paper" if t.table else "the BranchNorm paper"
        source = (
            f"paper: {t.title}, {where}, {t.scoring} ({rows}); x = a digit lost in the only "
            "copy available (megatron_branchnorm/paper.py)"
        )
        return published_rows(name), source
    if not Path(name).is_file():
        raise SweepError(f"--paper {name}: neither a task ({', '.join(TASKS)}) nor a file")
    try:
        figures = read_published(name)
        raw = json.loads(read_small_file(name, MAX_PUBLISHED_BYTES))
    except PaperError as exc:
        raise SweepError(f"--paper {exc}") from None
    except (OSError, ValueError) as exc:
        raise SweepError(f"--paper {name}: {exc}") from None
    for scheme, row in raw.items():
        for depth, value in row.items():
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise SweepError(
                    f"--paper {name}: {scheme} at depth {depth} is {quote(value)}; expected "
                    'a number or a string such as "29.x" or "diverged"'
                )
    return figures, f"paper: {name}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("submit", help="submit one job per (scheme, depth)")
    s.add_argument(
        "--launcher",
        default=None,
        help="an sbatch launcher of slurm/ (default with --task: slurm/recipe.sh)",
    )
    s.add_argument(
        "--task",
        default=None,
        choices=[t for t in TASKS if TASKS[t].directions],
        help="one of the paper's bilingual tasks: each cell runs its recipe <task>_<N>L",
    )
    s.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated")
    s.add_argument("--depths", required=True, help="comma-separated N of N-N models")
    s.add_argument("--out", required=True, help="the sweep's directory (one subdirectory a cell)")
    s.add_argument("--extra", default="", help="more section.key=value overrides, space-separated")
    s.add_argument("--sbatch", default="", help="more sbatch options, space-separated")
    s.add_argument("--resubmit", default="", help="cells to submit again, e.g. postln_50L")
    t = sub.add_parser("table", help="collect the cells' results into one table")
    t.add_argument("out", help="the sweep's directory")
    t.add_argument("--metric", choices=("valid_bleu", "valid_loss"), default="valid_bleu")
    t.add_argument(
        "--paper",
        nargs="?",
        const="",
        default=None,
        help="the paper's figures beside ours: alone, the sweep's task; or a task name "
        f'({", ".join(TASKS)}); or a JSON file {{"scheme": {{"depth": x}}}}',
    )
    t.add_argument(
        "--no-paper", dest="paper", action="store_const", const="-", help="no published column"
    )
    t.add_argument("--markdown", default=None, help="also write the table here")
    t.add_argument("--json", default=None, help="also write every cell's result here")
    return p.parse_args(argv)


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SweepError(f"{flag} {text!r}: expected comma-separated integers") from None
    if not values or min(values) < 1 or max(values) > MAX_DEPTH:
        raise SweepError(f"{flag} {quote(text)}: expected depths in [1, {MAX_DEPTH}]")
    return values


def main(argv: list[str] | None = None) -> int:
    """tools/sweep.py: its errors one line and exit 2 (:func:`cli.run_main`)."""
    return run_main(_main, argv)


def _main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "submit":
        schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
        known = known_schemes()
        unknown = [s for s in schemes if s not in known]
        if unknown or not schemes:
            raise SweepError(f"--schemes: unknown {', '.join(unknown)} ({', '.join(known)})")
        depths = _int_list(args.depths, "--depths")
        if args.launcher is None and args.task is None:
            raise SweepError("--launcher: required without --task")
        submit(
            Path(args.launcher) if args.launcher else RECIPE_LAUNCHER,
            schemes,
            depths,
            Path(args.out),
            args.extra.split(),
            args.sbatch.split(),
            resubmit=tuple(x.strip() for x in args.resubmit.split(",") if x.strip()),
            task=args.task,
        )
        return 0
    result = collect(Path(args.out), args.metric)
    paper, source = paper_figures(args.paper, result["task"])
    # The outputs must not replace the job registry, a cell's run, or each other.
    inputs = [("the registry", Path(args.out) / SWEEP_FILE)]
    inputs += [(f"cell {n}", c["save_dir"]) for n, c in result["cells"].items()]
    if args.markdown:
        check_output_file(args.markdown, "--markdown", inputs, is_our_table, "a table of sweep")
    if args.json:
        inputs.append(("--markdown", args.markdown))
        check_output_file(args.json, "--json", inputs, is_our_result, "a result of sweep table")
    table = format_table(result, paper, source)
    print(table)
    if args.markdown:
        write_text_output(args.markdown, table + "\n")
    if args.json:
        write_text_output(args.json, json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
