#!/usr/bin/env python
"""Translate text with an export directory (tools/convert_checkpoint.py): beam search with the
key/value cache, length penalty as in fairseq, SentencePiece detokenisation.

    python tools/translate.py --model exports/run1 --src-lang de --tgt-lang en < in.de > out.en
    python tools/translate.py --model exports/run1 --src-lang en --tgt-lang fr \\
        --input test.en --output test.fr --beam 5 --lenpen 1.0

One output line per input line (an empty input line gives an empty output line). With
``--nbest K`` (K > 1) each input line gives K lines ``index<TAB>rank<TAB>score<TAB>text``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_branchnorm.inference.export import ExportError  # noqa: E402
from megatron_branchnorm.inference.translate import (  # noqa: E402
    SearchOptions,
    TranslateError,
    Translator,
    format_nbest,
    read_lines,
    warn,
)

PROG = "translate.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="export directory (model.safetensors, ...)")
    p.add_argument("--src-lang", required=True, help="source language code, e.g. de")
    p.add_argument("--tgt-lang", required=True, help="target language code, e.g. en")
    p.add_argument("--input", default=None, help="input text file (default: stdin)")
    p.add_argument("--output", default=None, help="output file (default: stdout)")
    d = SearchOptions()
    p.add_argument("--beam", type=int, default=d.beam, help=f"beam size (default {d.beam})")
    p.add_argument(
        "--lenpen", type=float, default=d.lenpen, help=f"length penalty (default {d.lenpen})"
    )
    p.add_argument(
        "--max-len-a",
        type=float,
        default=d.max_len_a,
        help=f"output length limit a * source length + b (default a={d.max_len_a})",
    )
    p.add_argument(
        "--max-len-b",
        type=int,
        default=d.max_len_b,
        help=f"see --max-len-a (default b={d.max_len_b})",
    )
    p.add_argument(
        "--batch-tokens",
        type=int,
        default=d.batch_tokens,
        help=f"source tokens per batch, padding included (default {d.batch_tokens})",
    )
    p.add_argument(
        "--nbest", type=int, default=d.nbest, help="hypotheses per input line (default 1)"
    )
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def write_output(path: str | None, lines: list[str]) -> None:
    """Write to ``path`` through a temporary file renamed at the end, or to stdout."""
    text = "".join(line + "\n" for line in lines)
    if path is None or path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    out = Path(path)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, out)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise TranslateError(f"{path}: cannot write: {exc.strerror or exc}") from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import torch

        if args.threads > 0:
            torch.set_num_threads(args.threads)
        opts = SearchOptions(
            args.beam, args.lenpen, args.max_len_a, args.max_len_b, args.nbest, args.batch_tokens
        )
        opts.check()
        translator = Translator.from_export(args.model)
        translator.check_languages(args.src_lang, args.tgt_lang)
        lines = read_lines(args.input)
        bar = None
        if args.input not in (None, "-") and not args.quiet:
            from tqdm import tqdm

            bar = tqdm(total=len(lines), unit="sent", desc="translate", file=sys.stderr)
        hyps = translator.translate_hypotheses(
            lines, args.src_lang, args.tgt_lang, opts, bar.update if bar is not None else None
        )
        if bar is not None:
            bar.close()
        if translator.truncated:
            warn(
                f"{translator.truncated} input line(s) longer than the model's "
                f"{translator.model.cfg.max_positions} positions were cut"
            )
        if args.nbest == 1:
            out = [translator.decode(h[0].tokens) if h else "" for h in hyps]
        else:
            out = [x for i, h in enumerate(hyps) for x in format_nbest(i, h, translator.decode)]
        write_output(args.output, out)
    except (ExportError, TranslateError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
