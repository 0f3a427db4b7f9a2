"""Preprocess an English-centric parallel corpus into a DATA_DIR for training.

    python tools/preprocess_data.py --format opus100 --input RAW --langs de,fr \\
        --output DATA_DIR --vocab-size 64000 --workers 8
    python tools/preprocess_data.py --format plain --input wmt17 --langs de --directions en-de \\
        --output data/wmt17_en_de --vocab-size 32000          # a bilingual task: En->De only

Validates the input, trains one joint SentencePiece model (with <2xx> tags), encodes, and
writes indexed datasets for both directions of every pair (or only --directions), the raw
dev/test references and manifest.json (see docs/data.md). The corpus streams through in
bounded memory (--stats FILE records each phase's time and peak memory). The output appears
only when complete.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

from megatron_branchnorm.cli import ArgumentParser, float_flag, int_flag, run_main

PROG = "preprocess_data.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (numbers range-checked and finite)."""
    from megatron_branchnorm.data.corpora import FORMATS
    from megatron_branchnorm.data.spm import MODEL_TYPES
    from megatron_branchnorm.data.text import BAD_UTF8_MODES

    p = ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--format", required=True, choices=FORMATS, help="input layout")
    p.add_argument("--input", required=True, help="raw corpus directory")
    p.add_argument("--langs", required=True, help="comma-separated languages paired with --pivot")
    p.add_argument("--output", required=True, help="DATA_DIR to create")
    p.add_argument("--pivot", default="en", help="the language of every pair (default en)")
    p.add_argument(
        "--directions",
        default=None,
        help="only these directions, e.g. en-de for a bilingual task (default: both ways)",
    )
    p.add_argument(
        "--vocab-size",
        type=int_flag(8, 1 << 24),
        default=64000,
        help="SentencePiece vocabulary size",
    )
    p.add_argument("--model-type", default="unigram", choices=MODEL_TYPES)
    p.add_argument(
        "--character-coverage",
        type=float_flag(0.5, 1.0),
        default=0.9995,
        help="share of characters SentencePiece covers, in [0.5, 1]",
    )
    p.add_argument(
        "--spm-sample-size",
        type=int_flag(1),
        default=2_000_000,
        help="sentences in the SentencePiece training mix",
    )
    p.add_argument(
        "--spm-temperature",
        type=float_flag(0.01, 1000.0),
        default=5.0,
        help="language-mix temperature of the SentencePiece training sample",
    )
    p.add_argument(
        "--seed", type=int_flag(0), default=1, help="seed of sampling and held-out splits"
    )
    p.add_argument(
        "--max-len",
        type=int_flag(1),
        default=256,
        help="drop training pairs with a side longer than this many tokens",
    )
    p.add_argument(
        "--on-bad-utf8",
        default="error",
        choices=BAD_UTF8_MODES,
        help="invalid UTF-8: error (default), skip the pair, or replace bad bytes",
    )
    p.add_argument(
        "--workers",
        type=int_flag(1, 1024),
        default=min(8, os.cpu_count() or 1),
        help="encoding processes (the output does not depend on it)",
    )
    p.add_argument(
        "--dev-size",
        type=int_flag(0),
        default=2000,
        help="moses format without dev/test files: lines held out for dev",
    )
    p.add_argument(
        "--test-size",
        type=int_flag(0),
        default=2000,
        help="moses format without dev/test files: lines held out for test",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --output that this tool wrote (a DATA_DIR), nothing else",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--stats",
        default=None,
        metavar="FILE",
        help="write each phase's seconds and peak memory (RSS of this process and its\n"
        "workers, summed) to FILE as JSON: a new file or one an earlier --stats wrote,\n"
        "never inside --input, --output or another tool's directory (checked first)",
    )
    return p.parse_args(argv)


def _preprocess(argv: list[str] | None) -> int:
    from megatron_branchnorm.data.preprocess import PreprocessOptions, preprocess
    from megatron_branchnorm.data.spm import SpmOptions

    args = parse_args(argv)
    argv_used = sys.argv[1:] if argv is None else argv
    opts = PreprocessOptions(
        fmt=args.format,
        input_dir=args.input,
        langs=args.langs.split(","),
        output=args.output,
        pivot=args.pivot,
        directions=None if args.directions is None else args.directions.split(","),
        spm=SpmOptions(
            vocab_size=args.vocab_size,
            model_type=args.model_type,
            character_coverage=args.character_coverage,
            sample_size=args.spm_sample_size,
            temperature=args.spm_temperature,
            seed=args.seed,
        ),
        max_len=args.max_len,
        on_bad_utf8=args.on_bad_utf8,
        workers=args.workers,
        dev_size=args.dev_size,
        test_size=args.test_size,
        overwrite=args.overwrite,
        progress=False if args.no_progress else None,
        stats=args.stats,
        command=shlex.join(["tools/preprocess_data.py", *argv_used]),
    )
    start = time.perf_counter()
    m = preprocess(opts)
    elapsed = max(time.perf_counter() - start, 1e-9)
    raw = sum(p["raw_sentences"] for s in m["splits"].values() for p in s["pairs"].values())
    for split, info in m["splits"].items():
        print(f"{split}: {info['sentences']} pairs kept, filtered {json.dumps(info['filters'])}")
    print(f"vocab_size {m['vocab_size']}, directions {', '.join(m['directions'])}")
    print(
        f"{raw} sentence pairs in {elapsed:.1f}s ({raw / elapsed:.0f} pairs/s); wrote {args.output}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run preprocessing and print a summary. Bad input (a flag, a file, an output over the
    input) and a worker process that died (killed, out of memory) are one line ``error: ...``
    and exit 2; Ctrl-C exits 130; neither leaves output."""
    return run_main(_preprocess, argv)


if __name__ == "__main__":
    sys.exit(main())
