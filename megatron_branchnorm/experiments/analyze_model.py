"""Layer-wise analyses of exported models (BranchNorm paper, Figs. 8 and 9): the cosine
similarity between adjacent layers' representations and the sparsity of the FFN activations,
per encoder and decoder layer, on a DATA_DIR's held-out sentences (teacher-forced).

    python tools/analyze_model.py runs/study/export/branchnorm runs/study/export/deepnorm \\
        --data runs/study/data --split test --output analysis.png --json analysis.json

Prints a Markdown table (every layer for shallow models, about 12 rows per stack for deep
ones; --every K to choose) with the mean over layers and each model's teacher-forced nll, and
writes a PNG (2x2: cosine and sparsity, encoder and decoder, one line per model). Definitions:
megatron_branchnorm/experiments/analysis.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_branchnorm.cli import run_main
from megatron_branchnorm.formats.outputs import check_output_file, read_report, write_text_output

PROG = "analyze_model.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(
        prog=PROG,
        description=doc.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(doc.split("\n\n")[1:]),
    )
    p.add_argument(
        "exports", nargs="+", metavar="EXPORT_DIR", help="tools/convert_checkpoint.py output"
    )
    p.add_argument("--data", required=True, help="preprocessed DATA_DIR (its raw dev/test text)")
    p.add_argument("--split", default="test", help="held-out split (default test)")
    p.add_argument("--max-sentences", type=int, default=200, help="pairs per direction")
    p.add_argument("--batch-tokens", type=int, default=2048, help="padded tokens per batch")
    p.add_argument("--labels", default=None, help="comma-separated names, one per export")
    p.add_argument("--output", default="analysis.png", help="PNG to write")
    p.add_argument("--json", default=None, help="also write the numbers as JSON")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --output (a figure cannot be told from another PNG), or an "
        "existing --json that is not a report of ours",
    )
    p.add_argument("--every", type=int, default=None, help="table row every K layers")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    return p.parse_args(argv)


def is_our_report(path: Path) -> bool:
    """Whether ``path`` holds a --json report of ours: an object of one entry per model,
    each with the ``export`` and ``sentences`` this tool writes."""
    data = read_report(path)
    return (
        isinstance(data, dict)
        and bool(data)
        and all(isinstance(r, dict) and {"export", "sentences"} <= set(r) for r in data.values())
    )


def check_outputs(args: argparse.Namespace) -> None:
    """Before any export is loaded: neither output over, inside or around an export or the
    DATA_DIR, nor inside a directory of a known kind; an existing --output only with
    --overwrite, an existing --json when it is a report of ours (or with --overwrite)."""
    inputs = [("--data", args.data), *(("EXPORT_DIR", e) for e in args.exports)]
    check_output_file(
        args.output,
        "--output",
        inputs,
        lambda _: False,
        "a figure of analyze_model",
        args.overwrite,
    )
    if args.json is not None:
        inputs.append(("--output", args.output))
        check_output_file(
            args.json, "--json", inputs, is_our_report, "a report of analyze_model", args.overwrite
        )


def _analyze(argv: list[str] | None) -> int:
    args = parse_args(argv)
    check_outputs(args)
    import torch

    from megatron_branchnorm.experiments.analysis import (
        AnalysisError,
        analyze,
        format_table,
        heldout_batches,
        plot_analysis,
    )
    from megatron_branchnorm.inference.export import load_export

    torch.set_num_threads(max(1, args.threads))
    labels = args.labels.split(",") if args.labels else None
    if labels is not None and len(labels) != len(args.exports):
        raise AnalysisError(f"--labels: {len(labels)} names for {len(args.exports)} exports")
    if args.every is not None and args.every < 1:
        raise AnalysisError(f"--every must be >= 1, got {args.every}")
    results = []
    for i, export in enumerate(args.exports):
        model, sp, meta = load_export(export)
        label = labels[i] if labels else f"{meta.get('scheme', '?')}:{Path(export).name}"
        batches, counts = heldout_batches(
            model, sp, args.data, args.split, args.max_sentences, args.batch_tokens
        )
        stats = analyze(model, batches)
        stats.update(
            {
                "export": str(export),
                "scheme": meta.get("scheme"),
                "step": meta.get("step"),
                "sentences": counts,
            }
        )
        results.append((label, stats))
    print(
        f"{args.split} split of {args.data}: "
        + ", ".join(f"{k} {v}" for k, v in results[0][1]["sentences"].items())
        + " sentence pairs"
    )
    print(format_table(results, args.every))
    out = plot_analysis(results, args.output)
    if args.json:
        write_text_output(
            args.json, json.dumps({label: r for label, r in results}, indent=1) + "\n"
        )
    print(f"wrote {out}" + (f" and {args.json}" if args.json else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Analyse, tabulate, plot. Bad input (an export, the data, a flag) is one line
    ``error: ...`` and exit 2."""
    return run_main(_analyze, argv)


if __name__ == "__main__":
    sys.exit(main())
