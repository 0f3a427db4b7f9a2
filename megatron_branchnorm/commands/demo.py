"""Run the main job end to end on the built-in corpus (what `make demo` does).

    python tools/run_demo.py --out runs/demo --langs de,fr --minutes 15
    python tools/run_demo.py --out runs/demo24 --layers 24 --minutes 20

Builds the English-centric locale corpus, preprocesses it, trains the demo_cpu config through
the 2-stage DeepSpeed pipeline on 2 CPU ranks for --minutes (with an early checkpoint), converts
and evaluates both checkpoints with beam search and sacreBLEU, and writes OUT/report.md and
OUT/plots/training.png. See docs/demo.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from megatron_branchnorm.demo import DemoError, DemoOptions, fmt_time, run_demo

PROG = "run_demo.py"


def parse_args(argv: list[str] | None = None) -> DemoOptions:
    d = DemoOptions()
    p = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
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


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    start = time.time()
    try:
        result = run_demo(opts)
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return 130
    except (DemoError, ValueError, OSError) as exc:
        print(f"\n{PROG}: error: {exc}", file=sys.stderr)
        return 1
    avg = {k: v["averages"]["all"] for k, v in result.reports.items()}
    print(
        f"demo done in {fmt_time(time.time() - start)}: average BLEU {avg['early']:.1f} (early) "
        f"-> {avg['final']:.1f} (final), copy-the-source {avg['copy-source']:.1f}; "
        f"report: {opts.out / 'report.md'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
