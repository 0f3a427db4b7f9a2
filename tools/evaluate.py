#!/usr/bin/env python
"""Evaluate an export on every direction of a preprocessed DATA_DIR: sacreBLEU BLEU and chrF
against the raw references, averages X->En / En->X / all, a table on stdout.

    python tools/evaluate.py --model exports/run1 --data data/opus100 --split test \\
        --json results/test.json --hyp-dir results/hyp
    python tools/evaluate.py --model exports/multiun --data data/multiun --split test --lowercase

Cased BLEU by default (OPUS-100); --lowercase for MultiUN. The BLEU tokenizer follows the target
language (zh; ja-mecab or char; 13a otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_branchnorm.inference.evaluate import (  # noqa: E402
    EvaluationError,
    evaluate,
    format_table,
    pivot_language,
    references_from_manifest,
    select_directions,
)
from megatron_branchnorm.inference.export import ExportError  # noqa: E402
from megatron_branchnorm.inference.translate import (  # noqa: E402
    SearchOptions,
    TranslateError,
    Translator,
)

PROG = "evaluate.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="export directory")
    p.add_argument("--data", required=True, help="preprocessed DATA_DIR (manifest.json)")
    p.add_argument("--split", default="test", help="dev or test (default test)")
    p.add_argument("--lowercase", action="store_true", help="case-insensitive BLEU and chrF")
    p.add_argument("--json", default=None, help="write the report as JSON to this file")
    p.add_argument("--hyp-dir", default=None, help="write hypotheses as DIR/<src>-<tgt>.txt")
    p.add_argument("--directions", default=None, help="comma-separated subset, e.g. de-en,en-de")
    p.add_argument(
        "--max-sentences", type=int, default=None, help="first N sentences per direction"
    )
    d = SearchOptions()
    p.add_argument("--beam", type=int, default=d.beam, help=f"beam size (default {d.beam})")
    p.add_argument(
        "--lenpen", type=float, default=d.lenpen, help=f"length penalty (default {d.lenpen})"
    )
    p.add_argument(
        "--max-len-a", type=float, default=d.max_len_a, help="output length limit a*src+b"
    )
    p.add_argument("--max-len-b", type=int, default=d.max_len_b, help="see --max-len-a")
    p.add_argument(
        "--batch-tokens", type=int, default=d.batch_tokens, help="source tokens per batch"
    )
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import torch

        if args.threads > 0:
            torch.set_num_threads(args.threads)
        if args.max_sentences is not None and args.max_sentences < 1:
            raise EvaluationError(f"--max-sentences must be >= 1, got {args.max_sentences}")
        opts = SearchOptions(
            args.beam, args.lenpen, args.max_len_a, args.max_len_b, 1, args.batch_tokens
        )
        opts.check()
        wanted = (
            [x.strip() for x in args.directions.split(",") if x.strip()]
            if args.directions
            else None
        )
        directions = select_directions(references_from_manifest(args.data, args.split), wanted)
        translator = Translator.from_export(args.model)
        for d in directions:
            translator.check_languages(d.src_lang, d.tgt_lang)

        def progress(name: str, total: int):
            if args.quiet:
                return None
            from tqdm import tqdm

            bar = tqdm(total=total, unit="sent", desc=name, file=sys.stderr, leave=False)
            return bar.update

        report = evaluate(
            translator,
            directions,
            opts,
            args.lowercase,
            args.hyp_dir,
            args.max_sentences,
            pivot_language(args.data),
            progress,
        )
        if args.json:
            out = Path(args.json)
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
            tmp.write_text(
                json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
            )
            os.replace(tmp, out)
        print(format_table(report))
    except (EvaluationError, ExportError, TranslateError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
