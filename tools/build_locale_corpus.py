#!/usr/bin/env python
"""Build the built-in English-centric corpus (OPUS-100 layout) from installed gettext catalogs.

    python tools/build_locale_corpus.py --output data/locale_raw --langs de,fr
    python tools/preprocess_data.py --format opus100 --input data/locale_raw --langs de,fr \\
        --output data/locale --vocab-size 8000
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_branchnorm.data.errors import DataError  # noqa: E402
from megatron_branchnorm.data.locale_corpus import (  # noqa: E402
    DEFAULT_LANGS,
    DEFAULT_LOCALE_DIR,
    LocaleCorpusOptions,
    build_locale_corpus,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--output", required=True, help="corpus directory to create")
    p.add_argument(
        "--langs",
        default=",".join(DEFAULT_LANGS),
        help=f"comma-separated locale names paired with English (default {','.join(DEFAULT_LANGS)})",
    )
    p.add_argument("--locale-dir", default=DEFAULT_LOCALE_DIR, help="where <lang>/LC_MESSAGES are")
    p.add_argument("--min-pairs", type=int, default=1000, help="fewest training pairs per language")
    p.add_argument(
        "--eval-fraction",
        type=float,
        default=0.05,
        help="share of the installed catalogs (bytes) for each of dev and test",
    )
    p.add_argument("--max-chars", type=int, default=400, help="drop longer messages")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Build the corpus and print per-language counts; one-line error and exit 1 on bad input."""
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
    try:
        summary = build_locale_corpus(opts)
    except DataError as exc:
        print(f"build_locale_corpus: error: {exc}", file=sys.stderr)
        return 1
    print(f"{'lang':8} {'packages':>8} {'train':>7} {'dev':>6} {'test':>6}")
    for lang, c in summary["languages"].items():
        print(f"{lang:8} {c['packages']:8d} {c['train']:7d} {c['dev']:6d} {c['test']:6d}")
    print(f"test packages: {', '.join(summary['families']['test'])}")
    print(f"dev packages: {', '.join(summary['families']['dev'])}")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
