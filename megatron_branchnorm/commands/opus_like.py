"""Write a synthetic corpus of OPUS-100's shape (20 English-centric pairs, own scripts, Zipf
words, pair sizes falling from the largest to the smallest as 1M to 15k) of N training pairs.

    python tools/make_opus_like_corpus.py --output /tmp/opus1m --pairs 1000000
    python tools/preprocess_data.py --format opus100 --input /tmp/opus1m \\
        --langs de,fr,ru,zh,ar,ja,ko,el,he,hi,th,vi,tr,cs,ka,hy,bn,ta,si,am \\
        --output /tmp/opus1m_data --vocab-size 64000
"""

from __future__ import annotations

import argparse
import sys
import time

from megatron_branchnorm.cli import ArgumentParser, int_flag, run_main

PROG = "make_opus_like_corpus.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (numbers range-checked)."""
    p = ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--output", required=True, help="corpus directory to create")
    p.add_argument("--pairs", type=int_flag(1), required=True, help="training pairs in all")
    p.add_argument("--n-pairs", type=int_flag(1, 20), default=20, help="language pairs (<= 20)")
    p.add_argument("--seed", type=int_flag(0), default=1, help="the same seed, the same bytes")
    p.add_argument("--dev-size", type=int_flag(1), default=2000, help="dev lines per pair")
    p.add_argument("--test-size", type=int_flag(1), default=2000, help="test lines per pair")
    p.add_argument(
        "--vocab-words", type=int_flag(100), default=50000, help="pseudo-words per language"
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --output that is a corpus this project wrote, nothing else",
    )
    return p.parse_args(argv)


def _make(argv: list[str] | None) -> int:
    from megatron_branchnorm.data.corpora import pair_name
    from megatron_branchnorm.data.synthetic_corpus import (
        language_codes,
        train_sizes,
        write_opus100_like,
    )

    args = parse_args(argv)
    start = time.monotonic()
    langs = language_codes(args.n_pairs)
    sizes = train_sizes(args.pairs, args.n_pairs)
    out = write_opus100_like(
        args.output,
        args.pairs,
        n_pairs=args.n_pairs,
        seed=args.seed,
        dev_size=args.dev_size,
        test_size=args.test_size,
        vocab_words=args.vocab_words,
        overwrite=args.overwrite,
    )
    for lang, size in zip(langs, sizes, strict=True):
        print(f"{pair_name('en', lang):6} {size:10,d} train")
    print(f"wrote {out} ({args.pairs:,} training pairs) in {time.monotonic() - start:.1f} s")
    print(f"--langs {','.join(langs)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Write the corpus and print its pair sizes. Bad input is one line ``error: ...`` and exit
    2; Ctrl-C exits 130 and leaves no output."""
    return run_main(_make, argv)


if __name__ == "__main__":
    sys.exit(main())
