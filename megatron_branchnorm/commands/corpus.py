"""Build the built-in English-centric corpus (OPUS-100 layout) from installed gettext catalogs.

    python tools/build_locale_corpus.py --output data/locale_raw --langs de,fr
    python tools/preprocess_data.py --format opus100 --input data/locale_raw --langs de,fr \\
        --output data/locale --vocab-size 8000
"""

from __future__ import annotations

import argparse
import sys

from megatron_branchnorm.cli import ArgumentParser, float_flag, int_flag, run_main

PROG = "build_locale_corpus.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (numbers range-checked and finite)."""
    from megatron_branchnorm.data.locale_corpus import DEFAULT_LANGS, DEFAULT_LOCALE_DIR

    p = ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--output", required=True, help="corpus directory to create")
    p.add_argument(
        "--langs",
        default=",".join(DEFAULT_LANGS),
        help=f"comma-separated locale names paired with English (default {','.join(DEFAULT_LANGS)})",
    )
    p.add_argument("--locale-dir", default=DEFAULT_LOCALE_DIR, help="where <lang>/LC_MESSAGES are")
    p.add_argument(
        "--min-pairs", type=int_flag(1), default=1000, help="fewest training pairs per language"
    )
    p.add_argument(
        "--eval-fraction",
        type=float_flag(0.001, 0.45),
        default=0.05,
        help="share of the installed catalogs (bytes) for each of dev and test",
    )
    p.add_argument("--max-chars", type=int_flag(1), default=400, help="drop longer messages")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --output that this tool wrote (a corpus), nothing else",
    )
    return p.parse_args(argv)


def _build(argv: list[str] | None) -> int:
    from megatron_branchnorm.data.locale_corpus import LocaleCorpusOptions, build_locale_corpus

    args = parse_args(argv)
    opts = LocaleCorpusOptions(
        output=args.output,
        langs=tuple(x.strip() for x in args.langs.split(",") if x.strip()),
        locale_dir=args.locale_dir,
        min_pairs=args.min_pairs,
        eval_fraction=args.eval_fraction,
        max_chars=args.max_chars,
        overwrite=args.overwrite,
    )
    summary = build_locale_corpus(opts)
    print(f"{'lang':8} {'packages':>8} {'train':>7} {'dev':>6} {'test':>6}")
    for lang, c in summary["languages"].items():
        print(f"{lang:8} {c['packages']:8d} {c['train']:7d} {c['dev']:6d} {c['test']:6d}")
    print(f"test packages: {', '.join(summary['families']['test'])}")
    print(f"dev packages: {', '.join(summary['families']['dev'])}")
    print(f"wrote {args.output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Build the corpus and print per-language counts. Bad input is one line ``error: ...``
    and exit 2; Ctrl-C exits 130 and leaves no output."""
    return run_main(_build, argv)


if __name__ == "__main__":
    sys.exit(main())
