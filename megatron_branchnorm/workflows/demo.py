"""The main job end to end on the built-in corpus (``make demo``; docs/demo.md): the workflow
and its command line (``tools/run_demo.py``, ``mbn-demo``).

    corpus (commands/corpus.py) -> preprocess (commands/preprocess.py)
      -> train, 2-stage DeepSpeed pipeline on 2 CPU ranks, in two legs of one run: the first
         ends at ``early_fraction`` of the time budget with a checkpoint (the "early" model),
         the second resumes it exactly and ends at the budget (the "final" model)
      -> convert both checkpoints (commands/convert.py)
      -> evaluate both with beam search and sacreBLEU, next to copy-the-source
      -> plots (plotting.py) and OUT/report.md

Every long step shows a status line with the elapsed time and an estimate of the time left
(``steps.py``, shared with the research harness); each step's output goes to
OUT/logs/<step>.log. The corpus and the preprocessed data are reused when OUT already holds them
for the same languages and vocabulary; training starts afresh.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from megatron_branchnorm.cli import run_main
from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.formats.outputs import OutputError, claim_output_dir, refuse_overlap
from megatron_branchnorm.formats.records import read_metrics, read_rows
from megatron_branchnorm.runner.launch import LaunchError, deepspeed_command
from megatron_branchnorm.runner.plotting import series
from megatron_branchnorm.runner.steps import (
    EXPECTED_S,
    DemoError,
    Status,
    fmt_time,
    prepare_data,
    run_logged,
)


@dataclass
class DemoOptions:
    """What ``tools/run_demo.py`` passes in (its flags, one for one)."""

    out: Path = Path("runs/demo")
    """Output directory: corpus/, data/, train/, export/, eval/, plots/, logs/, report.md."""
    langs: str = "de,fr"
    """Languages paired with English (both directions of each are trained and evaluated)."""
    config: str = "demo_cpu"
    """Training config (shipped name or YAML path)."""
    minutes: float = 20.0
    """Training time budget (wall clock, both legs together, launches excluded)."""
    early_fraction: float = 0.2
    """Share of the budget after which the early checkpoint is taken."""
    layers: str | None = None
    """Depth: N (N encoder + N decoder layers) or N-M; None keeps the config's depth."""
    vocab_size: int = 4000
    """Joint SentencePiece vocabulary of the preprocessed data."""
    eval_sentences: int = 200
    """Test sentences per direction (the first ones of each test set)."""
    beam: int = 4
    """Beam size of the evaluation."""
    ranks: int = 2
    """CPU ranks = pipeline stages."""
    corpus: Path | None = None
    """Use this OPUS-100-layout corpus instead of building the built-in one."""
    overrides: list[str] = field(default_factory=list)
    """Extra ``section.key=value`` training overrides."""


# --------------------------------------------------------------------------------------------
# Steps
# --------------------------------------------------------------------------------------------


def parse_layers(layers: str | None) -> list[str]:
    """Overrides for ``"N"`` or ``"N-M"`` (encoder-decoder depth)."""
    if not layers:
        return []
    parts = layers.split("-")
    if len(parts) > 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise DemoError(f"--layers {layers!r}: expected N or N-M with positive integers")
    enc, dec = parts[0], parts[-1]
    return [f"model.encoder_layers={enc}", f"model.decoder_layers={dec}"]


def latest_tag(save_dir: Path) -> str:
    """The tag in ``save_dir/latest`` (the checkpoint a leg ended with)."""
    tag = ckpt.read_latest(save_dir)
    if tag is None:
        raise DemoError(f"{save_dir / ckpt.LATEST}: missing after training")
    return tag


def copy_source_scores(data_dir: Path, max_sentences: int) -> dict[str, Any]:
    """The evaluation report of the identity "translation" (the source as hypothesis)."""
    from megatron_branchnorm.inference.evaluate import (
        averages,
        pivot_language,
        read_lines,
        references_from_manifest,
        score_direction,
    )

    results = {}
    for name, d in references_from_manifest(data_dir, "test").items():
        src, ref = read_lines(d.src_path)[:max_sentences], read_lines(d.ref_path)[:max_sentences]
        results[name] = score_direction(src, ref, d.tgt_lang)
    return {"directions": results, "averages": averages(results, pivot_language(data_dir))}


def evaluate_export(
    export: Path,
    data_dir: Path,
    out_json: Path,
    hyp_dir: Path,
    opts: DemoOptions,
    label: str,
    status: Status,
) -> dict[str, Any]:
    """Beam-search every test direction (first ``eval_sentences``), score, write JSON."""
    import torch

    from megatron_branchnorm.inference.evaluate import (
        evaluate,
        pivot_language,
        references_from_manifest,
        select_directions,
    )
    from megatron_branchnorm.inference.translate import SearchOptions, Translator

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
    directions = select_directions(references_from_manifest(data_dir, "test"), None)
    translator = Translator.from_export(export)
    start = time.time()
    total = 0
    for d in directions:
        n = sum(1 for _ in open(d.src_path, encoding="utf-8", errors="replace"))
        total += min(n, opts.eval_sentences)
    done = [0]

    def progress(name: str, n: int) -> Callable[[int], None]:
        def step(k: int) -> None:
            done[0] += k
            elapsed = time.time() - start
            left = elapsed / done[0] * (total - done[0]) if done[0] else None
            status.update(label, start, left, f"{name} | {done[0]}/{total} sentences")

        step(0)
        return step

    search = SearchOptions(beam=opts.beam)
    report = evaluate(
        translator,
        directions,
        search,
        False,
        hyp_dir,
        opts.eval_sentences,
        pivot_language(data_dir),
        progress,
    )
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    status.done(label, start, f"average BLEU {report['averages']['all']:.2f}")
    return report


def source_use(export: Path, data_dir: Path, batches: int = 10) -> dict[str, float]:
    """Teacher-forced NLL per target token on the first dev batches (2048 tokens each) with the
    true source, the sources shuffled and an empty source (analysis.source_dependence)."""
    from megatron_branchnorm.data import BatchSampler, TranslationData
    from megatron_branchnorm.experiments.analysis import source_dependence
    from megatron_branchnorm.inference.export import load_export

    model, _, _ = load_export(export)
    dev = TranslationData(str(data_dir), "dev", max_length=None)
    return source_dependence(model, list(BatchSampler(dev, 2048, 1.0, 1, shuffle=False))[:batches])


@dataclass
class DemoResult:
    """What the report is made of."""

    opts: DemoOptions
    train_args: list[str]
    tags: dict[str, str]
    reports: dict[str, dict[str, Any]]
    timings: dict[str, float]
    plot: Path
    rows: list[dict[str, Any]]
    source: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per checkpoint: source_use()'s NLLs (empty when not measured)."""


def train_leg(
    opts: DemoOptions, args: list[str], minutes: float, label: str, status: Status
) -> float:
    """One ``deepspeed --num_gpus R`` launch of the trainer for ``minutes`` of training."""
    try:
        cmd, env = deepspeed_command(opts.ranks, [*args, f"train.max_time_minutes={minutes}"])
    except LaunchError as e:
        raise DemoError(str(e)) from None
    save_dir = opts.out / "train"
    budget = minutes * 60.0
    rows_before = len(read_rows(save_dir))
    train_start: list[float] = []

    def detail() -> tuple[float | None, str]:
        rows = read_rows(save_dir)[rows_before:]  # this leg's; a line being written is left out
        steps, losses = series(rows, "loss")
        if not steps:
            return None, "starting the ranks"
        if not train_start:  # elapsed_s counts from this leg's start of training
            last = next(r for r in reversed(rows) if "loss" in r)
            train_start.append(time.time() - float(last.get("elapsed_s", 0.0)))
        left = max(0.0, budget - (time.time() - train_start[0])) + 5.0  # + final save
        text = f"step {steps[-1]} | loss {losses[-1]:.3f}"
        _, vloss = series(rows, "valid_loss")
        if vloss:
            text += f" | valid loss {vloss[-1]:.3f}"
        return left, text

    return run_logged(
        cmd,
        opts.out / "logs" / "train.log",
        label,
        status,
        budget + EXPECTED_S["launch"],
        detail,
        env,
    )


DEMO_KIND = "demo"
"""The marker kind of a demo's --out (outputs.MARKER)."""
DEMO_PARTS = ("report.md", "corpus", "data", "train", "export", "eval", "logs", "plots")
"""What the demo writes (and replaces) inside --out."""


def check_demo_out(out: Path, corpus: Path | None) -> None:
    """The demo replaces its own parts of ``out`` on every run (cli.claim_output_dir: ``out``
    must be new, empty or an earlier demo's), and a given ``--corpus`` must not lie in what it
    replaces."""
    try:
        if corpus is not None:
            replaced = [("--out", out / part) for part in ("data", "train", "export", "eval")]
            refuse_overlap(corpus, replaced, "--corpus")
        claim_output_dir(out, "run_demo", DEMO_KIND, DEMO_PARTS, legacy="report.md")
    except OutputError as exc:
        raise DemoError(str(exc)) from None


def run_demo(opts: DemoOptions, status: Status | None = None) -> DemoResult:
    """Run every step into ``opts.out``; returns what went into ``opts.out/report.md``."""
    status = status or Status()
    # Absolute paths: the logs and the report name them whole, wherever the demo was started.
    opts = replace(
        opts, out=opts.out.resolve(), corpus=opts.corpus.resolve() if opts.corpus else None
    )
    out = opts.out
    langs = [x.strip() for x in opts.langs.split(",") if x.strip()]
    if not langs:
        raise DemoError("--langs is empty")
    if not 0.0 < opts.early_fraction < 1.0:
        raise DemoError(f"--early-fraction must be in (0, 1), got {opts.early_fraction}")
    if opts.minutes <= 0:
        raise DemoError(f"--minutes must be > 0, got {opts.minutes}")
    depth = parse_layers(opts.layers)
    check_demo_out(out, opts.corpus)
    logs = out / "logs"
    py = sys.executable
    timings: dict[str, float] = {}
    t_all = time.time()

    # 1-2. corpus and DATA_DIR
    data = prepare_data(out, opts.corpus, langs, opts.vocab_size, status, timings)
    # 3-4. train, two legs of one run
    save_dir = out / "train"
    for stale in (save_dir, out / "export", out / "eval", logs / "train.log"):
        if stale.is_dir():
            shutil.rmtree(stale)
        elif stale.exists():
            stale.unlink()
    train_args = [
        "--config",
        opts.config,
        f"pipeline.stages={opts.ranks}",
        f"data.dataset={data}",
        "model.vocab_size=null",
        f"train.save_dir={save_dir}",
        "train.save_interval=0",
        *depth,
        *opts.overrides,
    ]
    early_min = round(opts.minutes * opts.early_fraction, 4)
    timings["train_early"] = train_leg(
        opts,
        train_args,
        early_min,
        f"[3/7] train to the early checkpoint ({early_min:g} min)",
        status,
    )
    tags = {"early": latest_tag(save_dir)}
    final_min = round(opts.minutes - early_min, 4)
    timings["train_final"] = train_leg(
        opts,
        train_args,
        final_min,
        f"[4/7] train on to the final checkpoint ({final_min:g} min)",
        status,
    )
    tags["final"] = latest_tag(save_dir)
    # 5. convert
    t0 = time.time()
    for i, (name, tag) in enumerate(tags.items()):
        run_logged(
            [
                py,
                "-m",
                "megatron_branchnorm.commands.convert",
                "--checkpoint",
                str(save_dir),
                "--tag",
                tag,
                "--output",
                str(out / "export" / name),
            ],
            logs / f"convert_{name}.log",
            f"[5/7] convert {tag} ({i + 1}/{len(tags)})",
            status,
            EXPECTED_S["convert"],
        )
    timings["convert"] = time.time() - t0
    # 6. evaluate
    t0 = time.time()
    reports = {"copy-source": copy_source_scores(data, opts.eval_sentences)}
    for name in tags:
        reports[name] = evaluate_export(
            out / "export" / name,
            data,
            out / "eval" / f"{name}.json",
            out / "eval" / f"hyp_{name}",
            opts,
            f"[6/7] evaluate {name} ({tags[name]}, beam {opts.beam})",
            status,
        )
    source = {name: source_use(out / "export" / name, data) for name in tags}
    (out / "eval" / "source-use.json").write_text(json.dumps(source, indent=2) + "\n")
    (out / "eval" / "copy-source.json").write_text(
        json.dumps(reports["copy-source"], indent=2) + "\n", encoding="utf-8"
    )
    timings["evaluate"] = time.time() - t0
    # 7. plots and report
    from megatron_branchnorm.runner.plotting import plot_runs

    t0 = time.time()
    plot = plot_runs([save_dir], out / "plots" / "training.png", ["demo"])
    status.done("[7/7] plots", t0, str(plot))
    timings["total"] = time.time() - t_all
    result = DemoResult(
        opts, train_args, tags, reports, timings, plot, read_metrics(save_dir), source
    )
    write_report(result, out / "report.md")
    return result


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def _arrow(name: str) -> str:
    return name.replace("-", "->")


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def bleu_table(reports: dict[str, dict[str, Any]], tags: dict[str, str]) -> list[str]:
    """Markdown rows: a row per direction, then X->En, En->X and the average."""
    cols = list(reports)
    heads = [("copy the source" if c == "copy-source" else f"{c} ({tags[c]})") for c in cols]
    lines = [
        "| direction | "
        + " | ".join(f"BLEU {h}" for h in heads)
        + " | "
        + " | ".join(f"chrF {h}" for h in heads)
        + " |",
        "|---" * (1 + 2 * len(cols)) + "|",
    ]
    names = list(reports[cols[-1]]["directions"])
    for n in names:
        bleu = [_num(reports[c]["directions"][n]["bleu"]) for c in cols]
        chrf = [_num(reports[c]["directions"][n]["chrf"]) for c in cols]
        lines.append(f"| {_arrow(n)} | " + " | ".join(bleu) + " | " + " | ".join(chrf) + " |")
    for key, label in (("x-en", "X->En"), ("en-x", "En->X"), ("all", "average")):
        bleu = [_num(reports[c]["averages"].get(key)) for c in cols]
        chrf = []
        for c in cols:
            d = reports[c]["directions"]
            sel = [
                v["chrf"]
                for k, v in d.items()
                if key == "all" or (key == "x-en") == k.endswith("-en")
            ]
            chrf.append(_num(sum(sel) / len(sel)) if sel else "-")
        lines.append(f"| **{label}** | " + " | ".join(bleu) + " | " + " | ".join(chrf) + " |")
    return lines


def loss_summary(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines summarising the loss curve (a few points, validation loss, speed)."""
    steps, losses = series(rows, "loss")
    if not steps:
        return ["No training loss was logged."]
    picks = sorted(
        {steps[min(len(steps) - 1, round(f * (len(steps) - 1)))] for f in (0, 0.25, 0.5, 0.75, 1)}
    )
    by_step = dict(zip(steps, losses, strict=True))
    lines = [
        "| step | " + " | ".join(str(s) for s in picks) + " |",
        "|---" * (len(picks) + 1) + "|",
        "| train loss | " + " | ".join(f"{by_step[s]:.2f}" for s in picks) + " |",
    ]
    vsteps, vlosses = series(rows, "valid_loss")
    lines.append("")
    if vsteps:
        points = ", ".join(f"{v:.2f} (step {s})" for s, v in zip(vsteps, vlosses, strict=True))
        lines.append(f"Validation loss: {points}.")
    _, tps = series(rows, "tokens_per_sec")
    _, alpha = series(rows, "alpha")
    if tps:
        lines.append(
            f"Throughput: {sum(tps) / len(tps):.0f} tokens/s (source + target, mean of "
            f"logged intervals); BranchNorm alpha at the end: {alpha[-1]:.3f}."
        )
    return lines


def examples(out: Path, data: Path, n: int = 2) -> list[str]:
    """A few source / reference / final-hypothesis triples per direction."""
    from megatron_branchnorm.inference.evaluate import read_lines, references_from_manifest

    lines = []
    for name, d in references_from_manifest(data, "test").items():
        hyp_file = out / "eval" / "hyp_final" / f"{name}.txt"
        if not hyp_file.is_file():
            continue
        hyps = read_lines(hyp_file)
        src, ref = read_lines(d.src_path), read_lines(d.ref_path)
        lines.append(f"**{_arrow(name)}**")
        lines.append("")
        for i in range(min(n, len(hyps))):
            lines += [
                f"- source: `{src[i]}`",
                f"  - reference: `{ref[i]}`",
                f"  - model: `{hyps[i]}`" if hyps[i] else "  - model: (empty)",
            ]
        lines.append("")
    return lines


def source_lines(source: dict[str, dict[str, float]], tags: dict[str, str]) -> list[str]:
    """Markdown section: how much each checkpoint reads its source (empty when unmeasured)."""
    if not source:
        return []
    lines = [
        "## Does the model read its source?",
        "",
        "Teacher-forced NLL per target token (nats) on the first 10 dev batches: with the true "
        "source, with the sources shuffled across the batch, and with only the language tag. "
        "A model that has learnt only a target-side language model scores the three alike.",
        "",
        "| checkpoint | true source | shuffled | empty | source worth (shuffled - true) |",
        "|---|---|---|---|---|",
    ]
    for name, v in source.items():
        lines.append(
            f"| {name} ({tags[name]}) | {v['true']:.2f} | {v['shuffled']:.2f} | {v['empty']:.2f}"
            f" | {v['shuffled'] - v['true']:.2f} |"
        )
    return [*lines, ""]


def write_report(r: DemoResult, path: Path) -> None:
    """Write ``report.md`` (BLEU table, signature, loss summary, plots, timings)."""
    o = r.opts
    out = path.parent
    final = r.reports["final"]
    sigs = sorted(
        {v["signature"] for rep in r.reports.values() for v in rep["directions"].values()}
    )
    cfg_path = out / "train" / "config.yaml"
    model_line = ""
    if cfg_path.is_file():
        import yaml

        c = yaml.safe_load(cfg_path.read_text(encoding="utf-8"))
        m, t, dd = c["model"], c["train"], c["data"]
        model_line = (
            f"{m['encoder_layers']}L-{m['decoder_layers']}L {m['residual']} "
            f"(d={m['hidden_size']}, FFN {m['ffn_hidden_size']}, {m['num_attention_heads']} heads, "
            f"vocabulary {m['vocab_size']}, BranchNorm T={m['branchnorm_steps']}); "
            f"lr {t['lr']} with {t['warmup_steps']} warm-up updates, {t['micro_batches']} "
            f"micro-batches of {dd['max_tokens']} tokens, max length {dd['max_length']}"
        )
    steps = {k: ckpt.tag_step(v) for k, v in r.tags.items()}
    tm = r.timings
    lines = [
        "# BranchNorm demo report",
        "",
        f"Built-in locale corpus, English <-> {o.langs}; {model_line}.",
        f"Trained {o.minutes:g} min through the {o.ranks}-stage DeepSpeed pipeline on "
        f"{o.ranks} CPU ranks: early checkpoint after {o.minutes * o.early_fraction:g} min "
        f"(step {steps['early']}), final at step {steps['final']}.",
        "",
        f"## BLEU on the test sets (first {o.eval_sentences} sentences per direction, "
        f"beam {o.beam})",
        "",
        *bleu_table(r.reports, r.tags),
        "",
        "The copy-the-source row scores the untranslated source as the hypothesis: GNOME/KDE "
        "messages share placeholders, option names and product names with their translations, "
        "so it is far from zero.",
        "",
        "sacreBLEU signature" + ("s" if len(sigs) > 1 else "") + ":",
        "",
        *[f"- `{s}`" for s in sigs],
        "",
        f"Average BLEU: early {r.reports['early']['averages']['all']:.2f} -> final "
        f"{final['averages']['all']:.2f} (copy the source: "
        f"{r.reports['copy-source']['averages']['all']:.2f}).",
        "",
        *source_lines(r.source, r.tags),
        "## Training curve",
        "",
        *loss_summary(r.rows),
        "",
        f"![training curves]({r.plot.relative_to(out)})",
        "",
        "## Examples (final model)",
        "",
        *examples(out, out / "data"),
        "## Time",
        "",
        "| step | time |",
        "|---|---|",
        *[f"| {k} | {fmt_time(v)} |" for k, v in tm.items()],
        "",
        "Training command (each leg adds `train.max_time_minutes=...`):",
        "",
        "```",
        f"deepspeed --num_gpus {o.ranks} megatron_branchnorm/train.py " + " ".join(r.train_args),
        "```",
        "",
    ]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("\n".join(lines), encoding="utf-8")
    tmp.replace(path)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

PROG = "run_demo.py"
USAGE = """Run the main job end to end on the built-in corpus (what `make demo` does).

    python tools/run_demo.py --out runs/demo --langs de,fr --minutes 15
    python tools/run_demo.py --out runs/demo24 --layers 24 --minutes 20

Builds the English-centric locale corpus, preprocesses it, trains the demo_cpu config through
the 2-stage DeepSpeed pipeline on 2 CPU ranks for --minutes (with an early checkpoint), converts
and evaluates both checkpoints with beam search and sacreBLEU, and writes OUT/report.md and
OUT/plots/training.png. Bad input or a failed step: one line ``error: ...`` and exit 2. See
docs/demo.md.
"""


def parse_args(argv: list[str] | None = None) -> DemoOptions:
    d = DemoOptions()
    p = argparse.ArgumentParser(
        prog=PROG,
        description=USAGE.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(USAGE.split("\n\n")[1:]),
    )
    p.add_argument("--out", default=str(d.out), help=f"output directory (default {d.out})")
    p.add_argument("--langs", default=d.langs, help=f"languages paired with English ({d.langs})")
    p.add_argument("--config", default=d.config, help=f"training config (default {d.config})")
    p.add_argument(
        "--minutes",
        type=float,
        default=d.minutes,
        help=f"training time budget (default {d.minutes:g})",
    )
    p.add_argument(
        "--early-fraction",
        type=float,
        default=d.early_fraction,
        help=f"share of the budget before the early checkpoint ({d.early_fraction})",
    )
    p.add_argument(
        "--layers", default=None, help="N or N-M encoder-decoder depth (default: config)"
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=d.vocab_size,
        help=f"SentencePiece vocabulary (default {d.vocab_size})",
    )
    p.add_argument(
        "--eval-sentences",
        type=int,
        default=d.eval_sentences,
        help=f"test sentences per direction (default {d.eval_sentences})",
    )
    p.add_argument("--beam", type=int, default=d.beam, help=f"beam size (default {d.beam})")
    p.add_argument(
        "--corpus",
        default=None,
        help="an existing OPUS-100-layout corpus instead of the built-in one",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra training override (repeatable)",
    )
    a = p.parse_args(argv)
    if a.eval_sentences < 1:
        p.error(f"--eval-sentences must be >= 1, got {a.eval_sentences}")
    if a.vocab_size < 16:
        p.error(f"--vocab-size must be >= 16, got {a.vocab_size}")
    if a.beam < 1:
        p.error(f"--beam must be >= 1, got {a.beam}")
    return DemoOptions(
        out=Path(a.out),
        langs=a.langs,
        config=a.config,
        minutes=a.minutes,
        early_fraction=a.early_fraction,
        layers=a.layers,
        vocab_size=a.vocab_size,
        eval_sentences=a.eval_sentences,
        beam=a.beam,
        corpus=Path(a.corpus) if a.corpus else None,
        overrides=a.overrides,
    )


def _demo(argv: list[str] | None) -> int:
    opts = parse_args(argv)
    start = time.time()
    result = run_demo(opts)
    avg = {k: v["averages"]["all"] for k, v in result.reports.items()}
    print(
        f"demo done in {fmt_time(time.time() - start)}: average BLEU {avg['early']:.1f} (early) "
        f"-> {avg['final']:.1f} (final), copy-the-source {avg['copy-source']:.1f}; "
        f"report: {opts.out / 'report.md'}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the demo and print its BLEU summary (``tools/run_demo.py``, ``mbn-demo``)."""
    return run_main(_demo, argv)


if __name__ == "__main__":
    sys.exit(main())
