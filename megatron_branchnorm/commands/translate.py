"""Translate text with an export directory (tools/convert_checkpoint.py): beam search with the
key/value cache, length penalty as in fairseq, SentencePiece detokenisation.

    python tools/translate.py --model exports/run1 --src-lang de --tgt-lang en < in.de > out.en
    python tools/translate.py --model exports/run1 --src-lang en --tgt-lang fr \\
        --input test.en --output test.fr --beam 5 --lenpen 1.0

One output line per input line (an empty input line gives an empty output line). With
``--nbest K`` (K > 1) each input line gives K lines ``index<TAB>rank<TAB>score<TAB>text``.
A direction the model was not trained on (export.json ``directions``; a language into itself
when they are not recorded) is refused unless ``--zero-shot`` is given.

``--model`` may also be a CTranslate2 export (``convert_checkpoint.py --format ctranslate2``):
the same options, mapped to CTranslate2's search (inference/ct2.py), and ``--compute-type``
(CTranslate2's only); stderr's last line names the engine that ran (``engine: pytorch``,
``engine: ctranslate2 int8``) unless ``--quiet``.

``--output`` is checked before the model is loaded: never over the input or the export, never
inside a run (or its checkpoints), a DATA_DIR, an export or another tool's directory, and never
over an existing file without ``--overwrite``: a translation is plain text, so an earlier one
cannot be told from a user's file. Stdout (no ``--output``, or ``-``) and a device such as
/dev/null are written as they are.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from megatron_branchnorm.cli import ArgumentParser, UsageError, float_flag, int_flag, run_main
from megatron_branchnorm.formats.outputs import (
    OutputError,
    check_output_file,
    stdin_is,
    write_stdout,
    write_text_output,
)

PROG = "translate.py"

if TYPE_CHECKING:
    from megatron_branchnorm.inference.translate import Translator


def add_search_args(p: argparse.ArgumentParser, nbest: bool = True) -> None:
    """--beam, --lenpen, --max-len-a/-b, --batch-tokens (and --nbest), range-checked (the
    search's defaults and limits come from inference/translate.py, imported here so that
    ``--help`` stays light)."""
    from megatron_branchnorm.inference.ct2 import COMPUTE_TYPES
    from megatron_branchnorm.inference.translate import (
        MAX_BEAM,
        MAX_LEN_A,
        MAX_THREADS,
        SearchOptions,
    )

    d = SearchOptions()
    p.add_argument(
        "--beam", type=int_flag(1, MAX_BEAM), default=d.beam, help=f"beam size (default {d.beam})"
    )
    p.add_argument(
        "--lenpen", type=float_flag(), default=d.lenpen, help=f"length penalty (default {d.lenpen})"
    )
    p.add_argument(
        "--max-len-a",
        type=float_flag(0.0, MAX_LEN_A),
        default=d.max_len_a,
        help=f"output length limit a * source length + b (default a={d.max_len_a})",
    )
    p.add_argument(
        "--max-len-b",
        type=int_flag(0),
        default=d.max_len_b,
        help=f"see --max-len-a (default b={d.max_len_b})",
    )
    p.add_argument(
        "--batch-tokens",
        type=int_flag(1),
        default=d.batch_tokens,
        help=f"source tokens per batch, padding included (default {d.batch_tokens})",
    )
    if nbest:
        p.add_argument(
            "--nbest",
            type=int_flag(1, MAX_BEAM),
            default=d.nbest,
            help="hypotheses per input line (default 1)",
        )
    p.add_argument(
        "--threads",
        type=int_flag(0, MAX_THREADS),
        default=0,
        help="CPU threads of torch or of CTranslate2 (default 0: the engine's)",
    )
    p.add_argument(
        "--compute-type",
        choices=COMPUTE_TYPES,
        default=None,
        help="a CTranslate2 export's compute type (default: its quantization); a PyTorch "
        "export refuses it",
    )


def load_translator(args: argparse.Namespace) -> Translator:
    """The translator of ``--model``: CTranslate2's for a CTranslate2 export (detected from
    the directory), ours otherwise; ``--threads`` applied to the engine that runs, and an
    option only the other engine has refused in one line."""
    from megatron_branchnorm.inference.ct2 import CT2Translator, is_ct2_export
    from megatron_branchnorm.inference.translate import Translator

    if is_ct2_export(args.model):
        return CT2Translator(args.model, args.compute_type or "default", args.threads)
    if args.compute_type is not None:
        raise UsageError(
            f"--compute-type applies to a CTranslate2 export only ({args.model} is not one)"
        )
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    return Translator.from_export(args.model)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="export directory (model.safetensors, ...)")
    p.add_argument("--src-lang", required=True, help="source language code, e.g. de")
    p.add_argument("--tgt-lang", required=True, help="target language code, e.g. en")
    p.add_argument("--input", default=None, help="input text file (default: stdin)")
    p.add_argument(
        "--output",
        default=None,
        help="output file (default: stdout): a new file, never inside a run, a DATA_DIR, an "
        "export or another tool's directory",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --output (a translation cannot be recognised as ours)",
    )
    p.add_argument(
        "--zero-shot",
        action="store_true",
        help="translate a direction the model was not trained on (both languages must have a "
        "tag in its vocabulary); without it such a direction is refused",
    )
    add_search_args(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def _translate(argv: list[str] | None) -> int:
    from megatron_branchnorm.inference.ct2 import engine_label
    from megatron_branchnorm.inference.translate import (
        SearchOptions,
        format_nbest,
        read_lines,
        warn,
    )

    args = parse_args(argv)
    to_file = args.output not in (None, "-")
    from_file = args.input not in (None, "-")
    if to_file:
        # Before any work: an output over the input or the export would destroy it.
        if not from_file and stdin_is(args.output):
            raise OutputError(f"--output {args.output}: is the file stdin reads from")
        check_output_file(
            args.output,
            "--output",
            [("--input", args.input if from_file else None), ("--model", args.model)],
            lambda _: False,
            "a file translate can recognise as its own (a translation is plain text)",
            args.overwrite,
        )
    opts = SearchOptions(
        args.beam, args.lenpen, args.max_len_a, args.max_len_b, args.nbest, args.batch_tokens
    )
    opts.check()  # --nbest <= --beam (each flag's own range is checked by argparse)
    translator = load_translator(args)
    translator.check_direction(args.src_lang, args.tgt_lang, args.zero_shot)
    lines = read_lines(args.input)
    bar = None
    if from_file and not args.quiet:
        from tqdm import tqdm

        bar = tqdm(total=len(lines), unit="sent", desc="translate", file=sys.stderr)
    try:
        hyps = translator.translate_hypotheses(
            lines, args.src_lang, args.tgt_lang, opts, bar.update if bar is not None else None
        )
    finally:
        if bar is not None:
            bar.close()  # before any error line
    if translator.truncated:
        positions = getattr(translator, "max_positions", None) or translator.model.cfg.max_positions
        warn(
            f"{translator.truncated} input line(s) longer than the model's "
            f"{positions} positions were cut"
        )
    if args.nbest == 1:
        out = [translator.decode(h[0].tokens) if h else "" for h in hyps]
    else:
        out = [x for i, h in enumerate(hyps) for x in format_nbest(i, h, translator.decode)]
    text = "".join(line + "\n" for line in out)
    if to_file:
        write_text_output(args.output, text)
    else:
        write_stdout(text)
    if not args.quiet:
        print(f"engine: {engine_label(translator)}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Bad input (a flag, a file, a language) is one line ``error: ...`` and exit 2; Ctrl-C
    (even during the torch import) exits 130; the output file appears only when complete."""
    return run_main(_translate, argv)


if __name__ == "__main__":
    sys.exit(main())
