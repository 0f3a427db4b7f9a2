"""Depth study: Post-LN, Pre-LN, DeepNorm and BranchNorm at increasing depth (BranchNorm paper,
Fig. 3), each cell a real 2-stage DeepSpeed pipeline training on the built-in corpus.

    python tools/depth_study.py --data runs/study/data --out runs/study/depth \\
        --schemes postln,preln,deepnorm,branchnorm --depths 6,50 --steps 100
    python tools/depth_study.py --data runs/study/data --out runs/study/depth \\
        --schemes branchnorm --depths 500 --steps 30        # the 1000-layer cell
    python tools/depth_study.py --out runs/study/depth --report-only   # table + PNG again

A cell (scheme, N) trains an N-layer encoder + N-layer decoder (tiny width, d=--width, FFN
4d) with `deepspeed --num_gpus 2 --module megatron_branchnorm.train --config tiny_cpu
pipeline.stages=2 ...` for --steps updates, by default at a large learning rate with no
warm-up (the stress setting) and no gradient clipping, logging every update. Without --data the
corpus (German-English, tools/build_locale_corpus.py) and DATA_DIR (vocabulary 2000) are built
under OUT once. BranchNorm's T (--branchnorm-steps) defaults to half of --steps, so alpha
reaches 1 (Post-LN) midway and the run shows the hand-over too.

Results: OUT/cells/<cell>/result.json per cell (settings, status, losses, the gradient-norm
series, wall time) next to the run's metrics.jsonl and train.log. A cell whose result.json
exists with the same settings is skipped (resume); an unfinished one is run again from scratch.
At the end: the table (stdout and OUT/table.md) and OUT/grad_norm.png (gradient norm and
training loss over the first --plot-steps updates, a panel per depth, a line per scheme).

Divergence (``judge``): a cell diverged when any of
  1. the trainer stopped on train.max_consecutive_skips consecutive non-finite updates (exit 3),
  2. an update was skipped for a non-finite gradient norm (fp32: a numerical blow-up),
  3. a logged training loss is not finite,
  4. the final training loss (mean of the last max(5, 10%) logged updates) is above the loss of
     update 1 (the loss at initialisation): training made the model worse than at the start.
A launch that fails for another reason is "failed" (its log's last line is kept).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from megatron_branchnorm.config import RESIDUAL_SCHEMES
from megatron_branchnorm.errors import UserError
from megatron_branchnorm.formats.outputs import OutputError, claim_output_dir
from megatron_branchnorm.formats.records import metrics_path, read_metrics
from megatron_branchnorm.runner.launch import (
    CHECKOUT,
    LaunchError,
    deepspeed_command,
    logged_group,
    tool_command,
)
from megatron_branchnorm.training.exit_codes import NONFINITE_EXIT_CODE

PROG = "depth_study.py"
SCHEMES = ("postln", "preln", "deepnorm", "branchnorm")
"""The paper's schemes, in its order: the default ``--schemes``."""


def known_schemes() -> tuple[str, ...]:
    """Every scheme ``--schemes`` takes: the paper's, then any other of config's registry
    (also the sweep's, experiments/sweep.py)."""
    return SCHEMES + tuple(sorted(set(RESIDUAL_SCHEMES) - set(SCHEMES)))


FULL_DEPTHS = (6, 24, 50, 100, 200, 500)

RESULT = "result.json"


class StudyError(UserError, ValueError):
    """Bad study input: a one-line message naming the option or file."""


# --------------------------------------------------------------------------------------------
# Cells and their commands
# --------------------------------------------------------------------------------------------


def parse_list(text: str, option: str, kind: type = str) -> list:
    """Comma-separated values of ``option``; an empty or malformed list is a StudyError."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise StudyError(f"{option}: empty list")
    try:
        values = [kind(x) for x in items]
    except ValueError:
        raise StudyError(
            f"{option}: {text!r} is not a comma-separated list of {kind.__name__}"
        ) from None
    return values


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """The settings shared by every cell of one invocation (what a result must match)."""
    bn_steps = args.branchnorm_steps or max(1, args.steps // 2)
    return {
        "steps": args.steps,
        "lr": args.lr,
        "warmup": args.warmup,
        "clip": args.clip,
        "width": args.width,
        "ffn": 4 * args.width,
        "heads": args.heads,
        "max_tokens": args.max_tokens,
        "micro_batches": args.micro_batches,
        "branchnorm_steps": bn_steps,
        "max_length": args.max_length,
        "seed": args.seed,
        "ranks": args.ranks,
    }


def cell_name(scheme: str, layers: int, s: dict[str, Any]) -> str:
    """Directory name of a cell: scheme, depth and the settings that change its outcome."""
    return (
        f"{scheme}_{layers}L_d{s['width']}_lr{s['lr']:g}_wu{s['warmup']}_s{s['steps']}"
        f"_clip{s['clip']:g}_T{s['branchnorm_steps']}"
    )


def cell_overrides(
    scheme: str, layers: int, s: dict[str, Any], data: Path, save_dir: Path, minutes: float
) -> list[str]:
    """train.py arguments of one cell (config tiny_cpu, 2 stages, every update logged)."""
    return [
        "--config",
        "tiny_cpu",
        f"pipeline.stages={s['ranks']}",
        f"data.dataset={data}",
        "model.vocab_size=null",
        f"data.max_length={s['max_length']}",
        f"data.max_tokens={s['max_tokens']}",
        "model.max_positions=128",
        f"model.residual={scheme}",
        f"model.encoder_layers={layers}",
        f"model.decoder_layers={layers}",
        f"model.hidden_size={s['width']}",
        f"model.ffn_hidden_size={s['ffn']}",
        f"model.num_attention_heads={s['heads']}",
        f"model.branchnorm_steps={s['branchnorm_steps']}",
        "model.dropout=0.0",
        f"train.micro_batches={s['micro_batches']}",
        f"train.max_steps={s['steps']}",
        f"train.lr={s['lr']}",
        f"train.warmup_steps={s['warmup']}",
        f"train.clip_grad={s['clip']}",
        f"train.seed={s['seed']}",
        "train.log_interval=1",
        f"train.eval_interval={s['steps']}",
        "train.save_interval=0",
        f"train.max_time_minutes={minutes}",
        f"train.save_dir={save_dir}",
    ]


# --------------------------------------------------------------------------------------------
# Reading a finished run
# --------------------------------------------------------------------------------------------


def read_rows(metrics: Path) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl; a missing file gives none, a torn last line is ignored."""
    return read_metrics(metrics.parent, name=metrics.name)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def judge(rows: list[dict[str, Any]], returncode: int) -> tuple[str, str]:
    """(status, reason): "ok", "diverged" (the four criteria of the module docstring) or
    "failed" (the launch ended with an error other than the non-finite stop)."""
    train = [r for r in rows if "loss" in r]
    skipped = max([int(r.get("skipped_steps", 0) or 0) for r in rows] + [0])
    if returncode == NONFINITE_EXIT_CODE:
        return "diverged", f"stopped after consecutive non-finite updates ({skipped} skipped)"
    if returncode != 0:
        return "failed", f"exit code {returncode}"
    if skipped:
        return "diverged", f"{skipped} update(s) skipped for a non-finite gradient norm"
    bad = next((r for r in train if not _finite(r.get("loss"))), None)
    if bad is not None:
        return "diverged", f"non-finite loss at step {bad['step']}"
    if not train:
        return "failed", "no training step logged"
    first = float(train[0]["loss"])
    k = max(5, len(train) // 10)
    final = sum(float(r["loss"]) for r in train[-k:]) / len(train[-k:])
    if final > first:
        return "diverged", f"final loss {final:.3f} above the initial {first:.3f}"
    return "ok", ""


def summarize(rows: list[dict[str, Any]], returncode: int) -> dict[str, Any]:
    """The per-cell numbers: status, losses, validation loss, the loss and grad-norm series."""
    status, reason = judge(rows, returncode)
    train = [r for r in rows if "loss" in r]
    valid = [r for r in rows if "valid_loss" in r]
    losses = [float(r["loss"]) if _finite(r.get("loss")) else None for r in train]
    k = max(5, len(train) // 10)
    tail = [x for x in losses[-k:] if x is not None]
    return {
        "status": status,
        "reason": reason,
        "steps_done": int(train[-1]["step"]) if train else 0,
        "skipped": max([int(r.get("skipped_steps", 0) or 0) for r in rows] + [0]),
        "initial_loss": losses[0] if losses else None,
        "final_loss": sum(tail) / len(tail) if tail else None,
        "min_loss": min((x for x in losses if x is not None), default=None),
        "valid_loss": float(valid[-1]["valid_loss"]) if valid else None,
        "train_s": float(train[-1].get("elapsed_s", 0.0)) if train else None,
        "series": {
            "step": [int(r["step"]) for r in train],
            "loss": losses,
            "grad_norm": [
                float(r["grad_norm"]) if _finite(r.get("grad_norm")) else None for r in train
            ],
        },
    }


def last_line(log: Path) -> str:
    """The last non-empty line of a log that says something (for a failed cell)."""
    if not log.is_file():
        return ""
    lines = [x for x in log.read_text(encoding="utf-8", errors="replace").splitlines() if x.strip()]
    errors = [x for x in lines if "error" in x.lower()]
    return (errors or lines or [""])[-1][:300]


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


def ensure_data(out: Path) -> Path:
    """OUT/data, built (with OUT/corpus) when missing: German-English, vocabulary 2000."""
    from megatron_branchnorm.runner.steps import data_matches

    corpus, data = out / "corpus", out / "data"
    if data_matches(data, ["de"], 2000):
        return data
    if not (corpus / "locale_corpus.json").is_file():
        shutil.rmtree(corpus, ignore_errors=True)
        cmd = [*tool_command("corpus"), "--output", str(corpus)]
        subprocess.run([*cmd, "--langs", "de"], check=True, cwd=CHECKOUT)
    shutil.rmtree(data, ignore_errors=True)
    cmd = [*tool_command("preprocess"), "--format", "opus100", "--input"]
    cmd += [str(corpus), "--langs", "de", "--output", str(data), "--vocab-size", "2000"]
    subprocess.run([*cmd, "--workers", "1", "--no-progress"], check=True, cwd=CHECKOUT)
    return data


def run_cell(
    scheme: str,
    layers: int,
    s: dict[str, Any],
    data: Path,
    cell_dir: Path,
    minutes: float,
    keep_checkpoints: bool,
) -> dict[str, Any]:
    """Train one cell from scratch; write and return its result."""
    shutil.rmtree(cell_dir, ignore_errors=True)
    cell_dir.mkdir(parents=True)
    save_dir = cell_dir / "train"
    args = cell_overrides(scheme, layers, s, data, save_dir, minutes)
    try:
        cmd, env = deepspeed_command(s["ranks"], args)
    except LaunchError as e:
        raise StudyError(str(e)) from None
    log = cell_dir / "train.log"
    start = time.time()
    with logged_group(cmd, log, env=env, mode="w") as proc:
        # the trainer's own budget ends the run; this bound only catches a hung launch
        proc.wait(timeout=minutes * 60 + 900)
    wall = time.time() - start
    result = {"scheme": scheme, "layers": layers, "settings": s}
    result.update(summarize(read_rows(metrics_path(save_dir)), proc.returncode))
    result.update(
        {
            "returncode": proc.returncode,
            "wall_s": wall,
            "time_limited": result["steps_done"] < s["steps"] and proc.returncode == 0,
            "command": " ".join(["deepspeed", "--num_gpus", str(s["ranks"])] + cmd[5:]),
            "finished_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        }
    )
    if result["status"] == "failed":
        result["reason"] += f": {last_line(log)}"
    if not keep_checkpoints:
        for tag_dir in save_dir.glob("global_step*"):
            shutil.rmtree(tag_dir, ignore_errors=True)
    tmp = cell_dir / f".{RESULT}.tmp"
    tmp.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    tmp.replace(cell_dir / RESULT)
    return result


def load_result(cell_dir: Path, s: dict[str, Any] | None) -> dict[str, Any] | None:
    """A cell's result when it exists (and, given ``s``, was made with these settings)."""
    path = cell_dir / RESULT
    if not path.is_file():
        return None
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    if s is not None and result.get("settings") != s:
        return None
    return result


# --------------------------------------------------------------------------------------------
# Table and plot
# --------------------------------------------------------------------------------------------


def _num(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def max_grad_norm(result: dict[str, Any], first: int) -> float | None:
    """Largest finite gradient norm over the first ``first`` logged updates."""
    values = [g for g in result["series"]["grad_norm"][:first] if g is not None]
    return max(values) if values else None


SHORT = {"branchnorm_steps": "T", "warmup": "wu", "width": "d", "micro_batches": "mb"}


def setting_labels(results: list[dict[str, Any]]) -> list[str]:
    """Per result, the settings in which the results differ ("lr=0.02 wu=50"); all empty when
    they share one setting (one invocation's cells)."""
    settings = [r.get("settings", {}) for r in results]
    keys = sorted({k for s in settings for k in s})
    varying = [k for k in keys if len({repr(s.get(k)) for s in settings}) > 1]

    def show(v: Any) -> str:
        return f"{v:g}" if isinstance(v, float) else str("?" if v is None else v)

    return [" ".join(f"{SHORT.get(k, k)}={show(s.get(k))}" for k in varying) for s in settings]


def table(results: list[dict[str, Any]], first: int) -> str:
    """Markdown table: one row per cell (with a settings column when the cells differ in more
    than scheme and depth, as under one --out after several invocations)."""
    labels = setting_labels(results)
    extra = any(labels)
    lines = [
        f"| scheme | layers |{' settings |' if extra else ''} status | steps | loss @1 "
        f"| final loss | valid loss | max grad norm (first {first}) | train s | wall s | note |",
        "|---|---|" + ("---|" if extra else "") + "---|---|---|---|---|---|---|---|---|",
    ]
    for r, label in zip(results, labels, strict=True):
        lines.append(
            f"| {r['scheme']} | {r['layers']}L-{r['layers']}L |{f' {label} |' if extra else ''}"
            f" {r['status']} | {r['steps_done']} "
            f"| {_num(r['initial_loss'])} | {_num(r['final_loss'])} | {_num(r['valid_loss'])} "
            f"| {_num(max_grad_norm(r, first), 2)} | {_num(r['train_s'], 0)} "
            f"| {_num(r['wall_s'], 0)} | {r['reason'] or ('time limit' if r['time_limited'] else '')} |"
        )
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], output: Path, first: int) -> Path:
    """PNG: per depth a column; gradient norm (log y) and training loss over the first updates,
    a line per scheme; a diverged cell ends with an x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = sorted({r["layers"] for r in results})
    fig, axes = plt.subplots(
        2, len(depths), figsize=(4.2 * len(depths), 6.5), squeeze=False, constrained_layout=True
    )
    colours = dict(
        zip(known_schemes(), plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False)
    )
    labels = setting_labels(results)
    styles = {lab: ("-", "--", ":", "-.")[i % 4] for i, lab in enumerate(dict.fromkeys(labels))}
    for col, depth in enumerate(depths):
        for row, key in enumerate(("grad_norm", "loss")):
            ax = axes[row][col]
            for r, setting in (
                (r, lab) for r, lab in zip(results, labels, strict=True) if r["layers"] == depth
            ):
                pts = [
                    (s, v)
                    for s, v in zip(r["series"]["step"], r["series"][key], strict=True)
                    if v is not None and s <= first
                ]
                if not pts:
                    continue
                xs, ys = zip(*pts, strict=True)
                label = " ".join(x for x in (r["scheme"], setting) if x)
                label += " (diverged)" if r["status"] == "diverged" else ""
                ax.plot(
                    xs, ys, styles[setting], color=colours.get(r["scheme"]), linewidth=1.2,
                    label=label,
                )  # fmt: skip
                if r["status"] == "diverged":
                    ax.plot(xs[-1], ys[-1], "x", color=colours.get(r["scheme"]), markersize=8)
            if key == "grad_norm":
                ax.set_yscale("log")
                ax.set_title(f"{depth}L-{depth}L: gradient norm")
            else:
                ax.set_title(f"{depth}L-{depth}L: training loss")
            ax.set_xlabel("update")
            ax.grid(True, alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.stem}.tmp{output.suffix}")
    fig.savefig(tmp, dpi=80)
    plt.close(fig)
    tmp.replace(output)
    return output


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(
        prog=PROG,
        description=doc.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(doc.split("\n\n")[1:]),
    )
    p.add_argument("--data", type=Path, default=None, help="DATA_DIR (default: built in OUT)")
    p.add_argument("--out", type=Path, default=Path("runs/study/depth"), help="study directory")
    p.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated schemes")
    p.add_argument(
        "--depths",
        default=",".join(map(str, FULL_DEPTHS)),
        help="comma-separated N (N encoder + N decoder layers); default the full grid",
    )
    p.add_argument("--steps", type=int, default=100, help="updates per cell (default 100)")
    p.add_argument("--lr", type=float, default=5e-3, help="peak learning rate (default 5e-3)")
    p.add_argument("--warmup", type=int, default=0, help="warm-up updates (default 0)")
    p.add_argument("--clip", type=float, default=0.0, help="gradient clipping (default 0: none)")
    p.add_argument("--width", type=int, default=32, help="hidden size d; FFN 4d (default 32)")
    p.add_argument("--heads", type=int, default=2, help="attention heads (default 2)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per micro-batch")
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per update")
    p.add_argument("--max-length", type=int, default=48, help="longest training sentence")
    p.add_argument(
        "--branchnorm-steps", type=int, default=0, help="BranchNorm T (default: --steps / 2)"
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--ranks", type=int, default=2, help="CPU ranks = pipeline stages")
    p.add_argument(
        "--max-minutes",
        type=float,
        default=30.0,
        help="training-time budget per cell (the trainer stops and saves; default 30)",
    )
    p.add_argument("--plot-steps", type=int, default=100, help="updates shown in the PNG/table")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep each cell's checkpoint")
    p.add_argument("--report-only", action="store_true", help="table and PNG of finished cells")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        schemes = parse_list(args.schemes, "--schemes")
        known = known_schemes()
        unknown = [x for x in schemes if x not in known]
        if unknown:
            raise StudyError(f"--schemes: unknown {unknown[0]!r} (known: {', '.join(known)})")
        depths = parse_list(args.depths, "--depths", int)
        if any(d < 1 for d in depths):
            raise StudyError(f"--depths: every depth must be >= 1, got {args.depths}")
        for name in ("steps", "width", "heads", "max_tokens", "micro_batches", "ranks"):
            if getattr(args, name) < 1:
                raise StudyError(f"--{name.replace('_', '-')}: must be >= 1")
        if args.width % args.heads:
            raise StudyError(f"--width {args.width} is not a multiple of --heads {args.heads}")
        if args.data is not None and not (args.data / "manifest.json").is_file():
            raise StudyError(f"{args.data / 'manifest.json'}: missing (--data is not a DATA_DIR)")
        s = settings_of(args)
        cells_dir = args.out / "cells"
        if args.report_only:
            results = [
                r
                for p in sorted(cells_dir.glob(f"*/{RESULT}"))
                if (r := load_result(p.parent, None)) is not None
                and r["scheme"] in schemes
                and r["layers"] in depths
            ]
            if not results:
                raise StudyError(f"{cells_dir}: no finished cells for these schemes and depths")
        else:
            try:  # it replaces its corpus, data and cells on reruns: never a user's directory
                parts = ("cells", "corpus", "data", "table.md")
                claim_output_dir(
                    args.out, "depth_study", "depth_study", parts, ("cells", "table.md")
                )
            except OutputError as exc:
                raise StudyError(str(exc)) from None
            data = (args.data or ensure_data(args.out)).resolve()
            results = []
            grid = [(d, sc) for d in depths for sc in schemes]
            for i, (depth, scheme) in enumerate(grid, 1):
                cell_dir = (cells_dir / cell_name(scheme, depth, s)).resolve()
                label = f"[{i}/{len(grid)}] {scheme} {depth}L-{depth}L"
                done = load_result(cell_dir, s)
                if done is not None:
                    print(f"{label}: done before ({done['status']}), skipped", flush=True)
                    results.append(done)
                    continue
                print(f"{label}: running ({cell_dir})", flush=True)
                r = run_cell(
                    scheme, depth, s, data, cell_dir, args.max_minutes, args.keep_checkpoints
                )
                print(
                    f"{label}: {r['status']} {r['reason']} | {r['steps_done']} steps | final loss "
                    f"{_num(r['final_loss'])} | valid {_num(r['valid_loss'])} | {r['wall_s']:.0f} s",
                    flush=True,
                )
                results.append(r)
        results.sort(key=lambda r: (r["layers"], known.index(r["scheme"])))
        text = table(results, args.plot_steps)
        print(text)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "table.md").write_text(text + "\n", encoding="utf-8")
        png = plot(results, args.out / "grad_norm.png", args.plot_steps)
        print(f"wrote {args.out / 'table.md'} and {png}")
    except StudyError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as exc:
        print(f"{PROG}: error: building the data failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
