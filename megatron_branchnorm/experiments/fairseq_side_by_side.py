"""fairseq 0.12.2 side by side with our Post-LN and BranchNorm: the same corpus, the same
vocabulary, the same model and schedule, the same wall-clock training budget; BLEU and chrF per
direction.

    python tools/fairseq_side_by_side.py --out runs/side --minutes 20
    python tools/fairseq_side_by_side.py --out runs/side --minutes 20 --reuse branchnorm=runs/demo
    python tools/fairseq_side_by_side.py --out runs/side --report-only

What runs, in order (each step is skipped when its result is already under OUT):

1. data: the demo's English-centric locale corpus and DATA_DIR (``OUT/corpus``, ``OUT/data``),
   built with the same commands as ``make demo`` or copied from ``--from-demo DIR``;
2. fairseq: our training pairs (the DATA_DIR's token ids, ``data.max_length`` filter applied)
   written as SentencePiece pieces with the ``<2xx>`` target tag in front of the source, one
   fairseq dictionary made of our SentencePiece vocabulary (so both sides use the same 4,000
   tokens), ``fairseq-preprocess``, then ``fairseq-train`` with fairseq's ``transformer`` (Post-LN)
   at the config's size and schedule (layers, width, heads, dropout, Adam betas, lr, inverse-sqrt
   warm-up, clipping, label smoothing, ``--max-tokens`` x ``--update-freq`` = our micro-batch
   tokens x micro-batches, validation every ``train.eval_interval`` updates on at most 64 batches,
   as ours) for ``--minutes`` of training (``--stop-time-hours``); then ``fairseq-interactive``
   (beam 4, length penalty 0.6, max length 1.2 x source + 10, as ours) on the first
   ``--eval-sentences`` test sentences of each direction, decoded with our SentencePiece model and
   scored by our scorer (sacreBLEU, the demo's signature);
3. ours: ``tools/run_demo.py --set model.residual=SCHEME`` for each of ``--schemes`` with the same
   budget (or an existing demo run via ``--reuse SCHEME=DIR``);
4. ``OUT/report.md`` and ``OUT/side_by_side.json``.

fairseq runs in the throwaway environment of ``bench_anchors.py`` (fairseq patched to
import on Python 3.11 there, never in this repository). What differs, on purpose or not:
fairseq concatenates the four directions (ours samples them with temperature 5: the two pairs are
close in size, so the mix is nearly the same); fairseq's init is its own (Xavier-uniform, Post-LN)
where our Post-LN is Xavier-normal; fairseq runs one process with 2 intra-op threads where ours is
a 2-stage pipeline on 2 ranks of 1 thread; fairseq's losses are in bits and are converted to nats
here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from megatron_branchnorm.cli import run_main
from megatron_branchnorm.errors import UserError
from megatron_branchnorm.formats.outputs import OutputError, claim_output_dir
from megatron_branchnorm.formats.records import metrics_path, read_metrics
from megatron_branchnorm.runner.launch import CHECKOUT, tool_command
from megatron_branchnorm.runner.steps import Status, prepare_data, run_logged
from megatron_branchnorm.tokens import lang_tag

SRC, TGT = "src", "tgt"  # the one fairseq "language pair": tagged source -> target
FAIRSEQ_SPECIALS = 4  # <pad> <unk> <s> </s>: ids 0-3 in our SentencePiece model, built into fairseq
LOG_RE = re.compile(r"\| (train_inner|valid|train) \| (\{.*\})\s*$")


class SideBySideError(UserError, RuntimeError):
    """A one-line error for the command line."""


# ---- data ----------------------------------------------------------------------------------


def write_dictionary(sp: Any, path: Path) -> int:
    """A fairseq dictionary holding our SentencePiece pieces (specials excluded: fairseq adds its
    own four), so a fairseq model has our vocabulary size; returns the number of entries."""
    pieces = [sp.id_to_piece(i) for i in range(FAIRSEQ_SPECIALS, sp.get_piece_size())]
    bad = [p for p in pieces if not p or any(c.isspace() for c in p)]
    if bad:
        raise SideBySideError(f"{path}: SentencePiece piece {bad[0]!r} cannot be a fairseq token")
    path.write_text("".join(f"{p} 1\n" for p in pieces), encoding="utf-8")
    return len(pieces)


def export_split(
    data_dir: Path, split: str, out_prefix: Path, max_length: int | None, sp: Any
) -> dict[str, int]:
    """Write ``out_prefix.src`` (``<2tgt> pieces``) and ``out_prefix.tgt`` (pieces) for every
    direction of one split of a DATA_DIR, in direction order; fairseq appends ``</s>``."""
    from megatron_branchnorm.data.dataset import TranslationData

    data = TranslationData(str(data_dir), split, max_length=max_length)
    counts: dict[str, int] = {}
    with (
        open(f"{out_prefix}.{SRC}", "w", encoding="utf-8") as fs,
        open(f"{out_prefix}.{TGT}", "w", encoding="utf-8") as ft,
    ):
        for g, name in enumerate(data.directions):
            tag = lang_tag(name.split("-", 1)[1])
            idx = data.group_indices(g)
            for i in idx:
                s, t = data.pair(g, int(i))
                fs.write(" ".join([tag, *map(sp.id_to_piece, s.tolist())]) + "\n")
                ft.write(" ".join(map(sp.id_to_piece, t.tolist())) + "\n")
            counts[name] = int(idx.size)
    return counts


def encode_sources(lines: list[str], tgt_lang: str, sp: Any, max_positions: int) -> list[str]:
    """Test sources as fairseq-interactive input, cut as our Translator cuts them (tag + pieces +
    ``</s>`` within the position table)."""
    from megatron_branchnorm.data.text import clean

    out = []
    for line in lines:
        pieces = sp.encode(clean(line), out_type=str)[: max_positions - 2]
        out.append(" ".join([lang_tag(tgt_lang), *pieces]))
    return out


def parse_interactive(stdout: str, n: int) -> list[list[str]]:
    """The best hypothesis (pieces) of each of ``n`` inputs from fairseq-interactive's output."""
    hyps: dict[int, list[str]] = {}
    for line in stdout.splitlines():
        if line.startswith("H-"):
            head, _score, *rest = line.split("\t")
            i = int(head[2:])
            if i not in hyps:  # nbest 1, but keep the first if more are printed
                hyps[i] = rest[0].split() if rest else []
    missing = [i for i in range(n) if i not in hyps]
    if missing:
        raise SideBySideError(
            f"fairseq-interactive returned {n - len(missing)} of {n} hypotheses "
            f"(first missing: input {missing[0]})"
        )
    return [hyps[i] for i in range(n)]


def parse_fairseq_log(path: Path) -> dict[str, Any]:
    """Training facts from fairseq-train's JSON log: updates, training seconds, the validation
    curve (label-smoothed loss and nll, converted from bits to nats) and the last words/s."""
    rows: dict[str, list[dict[str, Any]]] = {"train_inner": [], "valid": [], "train": []}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        m = LOG_RE.search(line)
        if not m:
            continue
        try:
            rows[m.group(1)].append(json.loads(m.group(2)))
        except json.JSONDecodeError:
            continue
    # train_inner: every --log-interval updates; train: the epoch's (or the run's) summary
    last = {k[len("train_") :]: v for k, v in rows["train"][-1].items()} if rows["train"] else {}
    if rows["train_inner"] and (
        not last or float(rows["train_inner"][-1]["num_updates"]) > float(last["num_updates"])
    ):
        last = rows["train_inner"][-1]
    if not last:
        raise SideBySideError(f"{path}: no training rows (fairseq-train failed? see the log)")
    ln2 = math.log(2.0)
    curve = [
        {
            "step": int(float(v["valid_num_updates"])),
            "valid_loss": float(v["valid_loss"]) * ln2,
            "valid_nll": float(v["valid_nll_loss"]) * ln2,
        }
        for v in rows["valid"]
        if "valid_num_updates" in v
    ]
    return {
        "updates": int(float(last["num_updates"])),
        "train_s": float(last.get("wall", "nan")),  # the trainer's clock, validation included
        "words_per_s": float(last.get("wps", "nan")),
        "valid": curve,
    }


# ---- running -------------------------------------------------------------------------------


def build_data(out: Path, langs: str, vocab_size: int, from_demo: Path | None) -> Path:
    """``OUT/data`` (and ``OUT/corpus``): copied from a demo run or built as ``make demo`` does."""
    if from_demo is not None and not (out / "data" / "manifest.json").is_file():
        for name in ("corpus", "data"):
            if not (from_demo / name).is_dir():
                raise SideBySideError(f"--from-demo {from_demo}: no {name}/ (run make demo first)")
            shutil.copytree(from_demo / name, out / name, dirs_exist_ok=True)
    return prepare_data(out, None, langs.split(","), vocab_size, Status(), {})


def run_step(
    cmd: list[str],
    log: Path,
    label: str,
    env: dict[str, str] | None = None,
    expected_s: float | None = None,
) -> None:
    """One subprocess with its output in ``log`` and a status line (the demo's runner);
    the time left is shown when ``expected_s`` is given, "?" otherwise."""
    run_logged(cmd, log, label, Status(), expected_s, env=env)


def fairseq_train_args(cfg: Any, bin_dir: Path, save_dir: Path, minutes: float) -> list[str]:
    """fairseq-train's arguments for the same model, batches and schedule as ``cfg``."""
    m, d, t = cfg.model, cfg.data, cfg.train  # model.residual is ours: fairseq's is Post-LN
    args = [str(bin_dir), "--task", "translation", "--source-lang", SRC, "--target-lang", TGT]
    args += ["--arch", "transformer", "--share-all-embeddings"]
    for side, layers in (("encoder", m.encoder_layers), ("decoder", m.decoder_layers)):
        args += [f"--{side}-layers", str(layers), f"--{side}-embed-dim", str(m.hidden_size)]
        args += [f"--{side}-ffn-embed-dim", str(m.ffn_hidden_size)]
        args += [f"--{side}-attention-heads", str(m.num_attention_heads)]
    args += ["--dropout", str(m.dropout), "--attention-dropout", str(m.attention_dropout)]
    args += ["--activation-dropout", str(m.activation_dropout), "--activation-fn", m.activation]
    args += ["--max-source-positions", str(m.max_positions)]
    args += ["--max-target-positions", str(m.max_positions)]
    args += ["--optimizer", "adam", "--adam-betas", f"({t.adam_beta1},{t.adam_beta2})"]
    args += ["--adam-eps", str(t.adam_eps), "--weight-decay", str(t.weight_decay)]
    args += ["--lr", str(t.lr), "--lr-scheduler", "inverse_sqrt"]
    args += ["--warmup-updates", str(t.warmup_steps), "--warmup-init-lr", str(t.warmup_init_lr)]
    args += ["--clip-norm", str(t.clip_grad), "--criterion", "label_smoothed_cross_entropy"]
    args += ["--label-smoothing", str(t.label_smoothing)]
    args += ["--max-tokens", str(d.max_tokens), "--update-freq", str(t.micro_batches)]
    args += ["--required-batch-size-multiple", "1", "--max-update", str(t.max_steps)]
    args += ["--stop-time-hours", f"{minutes / 60:.6f}", "--seed", str(t.seed)]
    args += ["--validate-interval-updates", str(t.eval_interval), "--max-valid-steps", "64"]
    args += ["--cpu", "--num-workers", "0", "--save-dir", str(save_dir)]
    args += [
        "--no-epoch-checkpoints",
        "--log-format",
        "json",
        "--log-interval",
        str(t.log_interval),
    ]
    args += ["--skip-invalid-size-inputs-valid-test"]
    return args


def run_fairseq(out: Path, data: Path, cfg: Any, opts: argparse.Namespace) -> dict[str, Any]:
    """Export, binarise, train and evaluate fairseq; returns its part of the report."""
    import sentencepiece as spm

    from megatron_branchnorm.experiments.bench_anchors import (
        ANCHOR_ENV,
        anchor_status,
        prepare_anchor_env,
    )
    from megatron_branchnorm.inference.evaluate import (
        averages,
        pivot_language,
        read_lines,
        references_from_manifest,
        score_direction,
    )

    fs = out / "fairseq"
    result_path = fs / "result.json"
    if result_path.is_file():
        return json.loads(result_path.read_text())
    py = prepare_anchor_env()
    if anchor_status().get("fairseq") != "ok":
        raise SideBySideError(f"fairseq did not install: {anchor_status().get('fairseq')}")
    env = {**os.environ, **ANCHOR_ENV, "OMP_NUM_THREADS": str(opts.threads)}
    env.pop("PYTHONPATH", None)
    sp = spm.SentencePieceProcessor(model_file=str(data / "spm.model"))
    text, bin_dir = fs / "text", fs / "bin"
    logs = fs / "logs"
    if not (bin_dir / "preprocess.done").is_file():
        text.mkdir(parents=True, exist_ok=True)
        write_dictionary(sp, text / "dict.txt")
        counts = {
            split: export_split(data, split, text / split, cfg.data.max_length, sp)
            for split in ("train", "dev")
        }
        (text / "counts.json").write_text(json.dumps(counts, indent=1))
        if bin_dir.exists():
            shutil.rmtree(bin_dir)
        run_step(
            [
                *(str(py), "-m", "fairseq_cli.preprocess", "--source-lang", SRC),
                *("--target-lang", TGT, "--trainpref", str(text / "train")),
                *("--validpref", str(text / "dev"), "--destdir", str(bin_dir)),
                *("--srcdict", str(text / "dict.txt"), "--joined-dictionary", "--workers", "1"),
            ],
            logs / "preprocess.log",
            "fairseq: preprocess",
            env,
        )
        (bin_dir / "preprocess.done").write_text("")
    ckpt = fs / "checkpoints"
    train_log = logs / "train.log"
    if not (ckpt / "checkpoint_last.pt").is_file():
        if train_log.exists():
            train_log.unlink()
        if ckpt.exists():
            shutil.rmtree(ckpt)
        args = fairseq_train_args(cfg, bin_dir, ckpt, opts.minutes)
        label = f"fairseq: train ({opts.minutes:g} minutes)"
        budget_s = opts.minutes * 60.0  # fairseq's --stop-time-hours (start-up not included)
        run_step([str(py), "-m", "fairseq_cli.train", *args], train_log, label, env, budget_s)
    training = parse_fairseq_log(train_log)
    # evaluation
    results = {}
    hyp_dir = fs / "hyp"
    hyp_dir.mkdir(parents=True, exist_ok=True)
    start = time.time()
    for name, d in references_from_manifest(data, "test").items():
        src = read_lines(d.src_path)[: opts.eval_sentences]
        ref = read_lines(d.ref_path)[: opts.eval_sentences]
        inp = fs / "eval" / f"{name}.{SRC}"
        inp.parent.mkdir(parents=True, exist_ok=True)
        inp.write_text(
            "".join(x + "\n" for x in encode_sources(src, d.tgt_lang, sp, cfg.model.max_positions)),
            encoding="utf-8",
        )
        cmd = [
            *(str(py), "-m", "fairseq_cli.interactive", str(bin_dir), "--path"),
            *(str(ckpt / "checkpoint_last.pt"), "--source-lang", SRC, "--target-lang", TGT),
            *("--beam", str(opts.beam), "--lenpen", "0.6", "--max-len-a", "1.2"),
            *("--max-len-b", "10", "--buffer-size", "1024", "--batch-size", "64", "--cpu"),
            *("--input", str(inp)),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=CHECKOUT)
        (logs / f"interactive.{name}.log").write_text(proc.stderr)
        if proc.returncode != 0:
            raise SideBySideError(
                f"fairseq-interactive ({name}) exited {proc.returncode}: see "
                f"{logs / f'interactive.{name}.log'}"
            )
        hyps = [sp.decode_pieces(p) for p in parse_interactive(proc.stdout, len(src))]
        (hyp_dir / f"{name}.txt").write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
        results[name] = score_direction(hyps, ref, d.tgt_lang)
        print(f"fairseq: {name} BLEU {results[name]['bleu']:.2f}", file=sys.stderr)
    report = {
        "system": "fairseq 0.12.2 transformer (Post-LN)",
        "training": training,
        "eval_s": round(time.time() - start, 1),
        "directions": results,
        "averages": averages(results, pivot_language(data)),
    }
    result_path.write_text(json.dumps(report, indent=1) + "\n")
    return report


def ours_result(run_dir: Path, scheme: str) -> dict[str, Any]:
    """Our part of the report from a run_demo output directory."""
    final = run_dir / "eval" / "final.json"
    metrics = metrics_path(run_dir / "train")
    if not final.is_file() or not metrics.is_file():
        raise SideBySideError(f"{run_dir}: no eval/final.json or train/metrics.jsonl")
    rows = read_metrics(metrics.parent, strict=True)
    train_rows = [r for r in rows if "loss" in r]
    valid = [{"step": r["step"], "valid_loss": r["valid_loss"]} for r in rows if "valid_loss" in r]
    report = json.loads(final.read_text())
    return {
        "system": f"megatron-branchnorm {scheme}",
        "training": {
            "updates": max(r["step"] for r in train_rows) if train_rows else 0,
            "tokens_per_s": train_rows[-1].get("tokens_per_sec") if train_rows else None,
            "valid": valid,
        },
        "directions": report["directions"],
        "averages": report["averages"],
        "run_dir": str(run_dir),
    }


def run_ours(out: Path, scheme: str, opts: argparse.Namespace) -> dict[str, Any]:
    run_dir = out / f"ours-{scheme}"
    if not (run_dir / "eval" / "final.json").is_file():
        run_dir.mkdir(parents=True, exist_ok=True)
        for name in ("corpus", "data"):  # run_demo reuses matching corpus and data
            if not (run_dir / name).exists():
                shutil.copytree(out / name, run_dir / name)
        run_step(
            [
                *tool_command("demo"),
                *("--out", str(run_dir), "--langs", opts.langs),
                *("--config", opts.config, "--minutes", str(opts.minutes)),
                *("--vocab-size", str(opts.vocab_size), "--beam", str(opts.beam)),
                *("--eval-sentences", str(opts.eval_sentences)),
                *("--set", f"model.residual={scheme}"),
            ],
            out / "logs" / f"ours-{scheme}.log",
            f"ours {scheme}: make demo ({opts.minutes:g} minutes of training)",
        )
    return ours_result(run_dir, scheme)


# ---- report --------------------------------------------------------------------------------


def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def report_lines(systems: dict[str, dict[str, Any]], minutes: float) -> list[str]:
    """Markdown: one row per system (updates, last validation loss, BLEU and chrF per direction
    and on average)."""
    directions = sorted({d for s in systems.values() for d in s["directions"]})
    head = ["system", "updates", "valid loss (nats)"]
    head += [f"BLEU {d}" for d in directions] + ["BLEU avg"]
    head += [f"chrF {d}" for d in directions] + ["chrF avg"]
    lines = [
        f"Training budget {minutes:g} minutes each; valid loss = label-smoothed, last validation.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + " --- |" * len(head),
    ]
    for name, s in systems.items():
        tr = s["training"]
        last_valid = tr["valid"][-1]["valid_loss"] if tr.get("valid") else None
        bleu = [s["directions"].get(d, {}).get("bleu") for d in directions]
        chrf = [s["directions"].get(d, {}).get("chrf") for d in directions]
        known = [c for c in chrf if c is not None]
        chrf_avg = sum(known) / len(known) if known else None
        row = [name, str(tr["updates"]), _f(last_valid, 2)]
        row += [_f(b) for b in bleu] + [_f(s["averages"].get("all"))]
        row += [_f(c) for c in chrf] + [_f(chrf_avg)]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _side_by_side(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/side"))
    parser.add_argument("--minutes", type=float, default=20.0, help="training budget (20)")
    parser.add_argument("--langs", default="de,fr")
    parser.add_argument("--config", default="demo_cpu")
    parser.add_argument("--vocab-size", type=int, default=4000)
    parser.add_argument("--schemes", default="postln,branchnorm", help="ours to run ('' none)")
    parser.add_argument(
        "--reuse",
        action="append",
        default=[],
        metavar="SCHEME=DIR",
        help="take SCHEME's result from an existing run_demo output",
    )
    parser.add_argument("--from-demo", type=Path, help="copy corpus/ and data/ from a demo run")
    parser.add_argument("--no-fairseq", action="store_true")
    parser.add_argument("--eval-sentences", type=int, default=200)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="fairseq's intra-op threads (default: all cores)",
    )
    parser.add_argument("--report-only", action="store_true", help="only rebuild the report")
    args = parser.parse_args(argv)
    if args.minutes <= 0:
        raise SideBySideError(f"--minutes must be > 0, got {args.minutes}")
    reuse = {}
    for item in args.reuse:
        scheme, sep, path = item.partition("=")
        if not sep or not scheme or not path:
            raise SideBySideError(f"--reuse {item!r}: expected SCHEME=DIR")
        reuse[scheme] = Path(path)
    from megatron_branchnorm.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, [])
    except ConfigError as exc:
        raise SideBySideError(str(exc)) from None
    out = args.out.resolve()
    parts = ("fairseq", "corpus", "data", "logs", "side_by_side.json", "report.md")
    try:  # it replaces these on reruns: never a user's directory
        claim_output_dir(out, "fairseq_side_by_side", "side_by_side", parts, "side_by_side.json")
    except OutputError as exc:
        raise SideBySideError(str(exc)) from None
    systems: dict[str, dict[str, Any]] = {}
    if not args.report_only:
        data = build_data(out, args.langs, args.vocab_size, args.from_demo)
        if not args.no_fairseq:
            systems["fairseq postln"] = run_fairseq(out, data, cfg, args)
        for scheme in [s for s in args.schemes.split(",") if s]:
            if scheme in reuse:
                systems[f"ours {scheme}"] = ours_result(reuse[scheme], scheme)
            else:
                systems[f"ours {scheme}"] = run_ours(out, scheme, args)
        saved = {"minutes": args.minutes, "config": args.config, "systems": systems}
        (out / "side_by_side.json").write_text(json.dumps(saved, indent=1) + "\n")
    else:
        path = out / "side_by_side.json"
        if not path.is_file():
            raise SideBySideError(f"{path}: missing (run without --report-only first)")
        saved = json.loads(path.read_text())
        systems, args.minutes = saved["systems"], saved["minutes"]
    lines = report_lines(systems, args.minutes)
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Bad input or a failed step is one line ``error: ...`` and exit 2."""
    return run_main(_side_by_side, argv)


if __name__ == "__main__":
    raise SystemExit(main())
