"""The rehearsal's report (workflows/rehearse.py): the checks and figures of a finished work
directory (:func:`evaluate`), the table of figures (start-up, time per update, peak memory per
rank, save and resume times, checkpoint size, conversion) and its markdown and JSON outputs."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from megatron_branchnorm.formats.files import read_small_file
from megatron_branchnorm.formats.outputs import check_output_file, read_report, write_text_output
from megatron_branchnorm.workflows.rehearse_checks import (
    check_export,
    check_other_topology,
    check_parity,
    check_resume,
)
from megatron_branchnorm.workflows.rehearse_plan import RehearsalError, other_micro_batches
from megatron_branchnorm.workflows.rehearse_runs import RUNS_FILE


def _median_update_s(run: dict | None) -> float | None:
    if not run:
        return None
    t = {int(k): v for k, v in run.get("steps", {}).items()}
    gaps = [t[s] - t[s - 1] for s in sorted(t) if s - 1 in t]
    return statistics.median(gaps) if gaps else None


def evaluate(workdir: Path) -> dict[str, Any]:
    """Checks and figures of a finished (or failed) rehearsal in ``workdir``."""
    path = workdir / RUNS_FILE
    if not path.is_file():
        raise RehearsalError(f"{path}: missing (no rehearsal ran in {workdir})")
    record = json.loads(path.read_text(encoding="utf-8"))
    plan, runs = record["plan"], record["runs"]
    checks = [
        check_parity(plan, runs, workdir),
        check_resume(plan, runs, workdir),
        check_other_topology(plan, runs, workdir),
    ]
    export_check, export_fig = check_export(plan, runs, workdir)
    checks.append(export_check)
    return {
        "config": plan["config"],
        "command": plan["command"],
        "cpu": record["cpu"],
        "plan": plan,
        "checks": checks,
        "ok": all(c["ok"] for c in checks),
        "figures": figures(plan, runs, export_fig),
    }


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f} MB"


def figures(plan: dict, runs: dict, export_fig: dict) -> dict[str, Any]:
    """The figures of the table, by name (JSON-friendly values)."""
    out: dict[str, Any] = {}
    dp, other_dp = plan["world"] // plan["stages"], plan["world"] // plan["other_stages"]
    u = runs.get("uninterrupted")
    first = (u or {}).get("steps", {}).get("1")
    out["startup_s"] = first
    out["loop_start_s"] = (u or {}).get("t_loop")
    out["update_s"] = _median_update_s(u)
    out["reference_update_s"] = _median_update_s(runs.get("reference"))
    peaks = {}
    for name, run in runs.items():
        p = [x for x in run.get("peak_rss_mb", []) if x is not None]
        if p:
            peaks[name] = {
                "max_mb": max(p),
                "mean_mb": sum(p) / len(p),
                "sum_mb": sum(p),
                "machine_rise_mb": run["machine_mem_peak_mb"] - run["machine_mem_base_mb"],
            }
    out["peak_rss"] = peaks
    saves = (runs.get("interrupted") or {}).get("saves") or []
    out["save_signal_s"] = saves[-1]["seconds"] if saves else None
    end_saves = (u or {}).get("saves") or []
    out["save_end_s"] = end_saves[-1]["seconds"] if end_saves else None
    out["build_s"] = {
        name: run["t_loop"] - run["t_topology"]
        for name, run in runs.items()
        if run.get("t_loop") is not None and run.get("t_topology") is not None
    }
    out.update(export_fig)
    out["topology"] = f"{plan['stages']} stages x {dp} data-parallel = {plan['world']} ranks"
    out["other_topology"] = f"{plan['other_stages']} stages x {other_dp} = {plan['world']} ranks"
    return out


def _s(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.2f} s" if abs(x) < 10 else f"{x:,.0f} s"


def table_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """(figure, value) rows of the report's table, the checks last."""
    plan, f = report["plan"], report["figures"]
    dp = plan["world"] // plan["stages"]
    enc, dec = plan["layers"]
    mb = plan["micro_batches"]
    mb_note = (
        "the config's own"
        if mb == plan["config_micro_batches"]
        else f"**reduced** from the config's {plan['config_micro_batches']}, for time"
    )
    shrunk = [o.removeprefix("model.") for o in plan["overrides"] if o.startswith("model.")]
    build = f.get("build_s", {})
    rows = [
        ("model", f"{enc}L-{dec}L, width shrunk: " + ", ".join(shrunk)),
        ("topology", f"{f['topology']} ({plan['world_source']})"),
        ("micro-batches per update", f"{mb} per replica x {dp} = {mb * dp} ({mb_note})"),
        (
            "other topology (check 3)",
            f"{f['other_topology']}, {other_micro_batches(plan)} micro-batches per replica",
        ),
        (
            "start-up: launch to first update logged",
            _s(f.get("startup_s"))
            + f" (rank 0 entered the training loop at {_s(f.get('loop_start_s'))})",
        ),
        (
            "time per update (median)",
            _s(f.get("update_s"))
            + f"; one process, same global batch: {_s(f.get('reference_update_s'))}",
        ),
    ]
    for name, label in (
        ("uninterrupted", "peak RSS per rank (VmHWM), real topology"),
        ("other_topology", "peak RSS per rank, other topology"),
        ("reference", "peak RSS, one process"),
    ):
        p = f["peak_rss"].get(name)
        if p:
            rows.append(
                (
                    label,
                    f"max {_mb(p['max_mb'])}, mean {_mb(p['mean_mb'])}, sum over ranks "
                    f"{_mb(p['sum_mb'])}; the machine's memory in use rose by at most "
                    f"{_mb(p['machine_rise_mb'])} (other processes included)",
                )
            )
    rows += [
        (
            "save: SIGUSR1 checkpoint; end of run",
            f"{_s(f.get('save_signal_s'))}; {_s(f.get('save_end_s'))}",
        ),
        (
            "rank 0, 'Using topology' to training loop: build + initialize (+ load)",
            f"fresh {_s(build.get('uninterrupted'))}; resumed, same topology "
            f"{_s(build.get('resumed'))}; other topology, state re-laid "
            f"{_s(build.get('other_topology'))}",
        ),
    ]
    c = f.get("checkpoint")
    if c:
        rows.append(
            (
                "checkpoint",
                f"{c['files']:,} files ({c['layer_files']:,} layer files), "
                f"{c['bytes'] / 2**20:,.1f} MiB",
            )
        )
    if "load_s" in f:
        rows.append(
            ("checksums of the whole checkpoint (every rank verifies on resume)", _s(f["verify_s"]))
        )
        rows.append(
            (
                "convert (verify + read + build); export; translate one sentence",
                f"{_s(f['load_s'])}; {_s(f.get('export_s'))} "
                f"({f.get('export_bytes', 0) / 2**20:,.1f} MiB); {_s(f.get('translate_s'))}",
            )
        )
    for check in report["checks"]:
        rows.append((check["name"], ("PASS: " if check["ok"] else "**FAIL**: ") + check["detail"]))
    return rows


def format_table(report: dict[str, Any]) -> str:
    """The report as one markdown table, the command and the CPU above it."""
    verdict = "all checks passed" if report["ok"] else "**a check failed**"
    head = [
        f"`{report['command']}`" if report["command"] else f"config {report['config']}",
        "",
        f"CPU: {report['cpu']}; {verdict}.",
        "",
        "| figure | value |",
        "| --- | --- |",
    ]
    rows = [f"| {a} | {b.replace('|', '/')} |" for a, b in table_rows(report)]
    return "\n".join(head + rows) + "\n"


REPORT_KEYS = frozenset({"config", "command", "cpu", "plan", "checks", "ok", "figures"})
"""The keys of a --json report (:func:`evaluate`): how one of ours is recognised."""


def is_our_report(path: Path) -> bool:
    """Whether ``path`` holds a --json report of ours (exactly :data:`REPORT_KEYS`)."""
    data = read_report(path)
    return isinstance(data, dict) and set(data) == REPORT_KEYS


def is_our_table(path: Path) -> bool:
    """Whether ``path`` holds a --markdown table of ours (:func:`format_table`'s head)."""
    try:
        lines = read_small_file(path, 1 << 20).decode("utf-8").splitlines()
    except (OSError, ValueError):  # FileShapeError, UnicodeDecodeError too
        return False
    return len(lines) >= 6 and lines[2].startswith("CPU: ") and lines[4] == "| figure | value |"


def check_outputs(workdir: Path, json_path: str | None, md_path: str | None) -> None:
    """Refuse, before anything runs, a --json or --markdown over, inside or around --workdir
    or each other, inside a directory of a known kind, or over an existing file that is not a
    report of ours (outputs.check_output_file: such a file is never replaced)."""
    inputs: list[tuple[str, str | Path | None]] = [("--workdir", workdir)]
    if json_path:
        check_output_file(json_path, "--json", inputs, is_our_report, "a report of rehearse")
        inputs.append(("--json", json_path))
    if md_path:
        check_output_file(md_path, "--markdown", inputs, is_our_table, "a table of rehearse")


def write_outputs(report: dict[str, Any], json_path: str | None, md_path: str | None) -> None:
    """Write the report as JSON and/or markdown, each through a temporary file renamed when
    complete."""
    if json_path:
        write_text_output(json_path, json.dumps(report, indent=1) + "\n")
    if md_path:
        write_text_output(md_path, format_table(report))
