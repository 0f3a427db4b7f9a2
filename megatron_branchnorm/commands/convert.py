"""Convert a DeepSpeed pipeline checkpoint into an export directory for inference.

    python tools/convert_checkpoint.py --checkpoint runs/tiny --output exports/tiny
    python tools/convert_checkpoint.py --checkpoint runs/x --tag global_step4000 --average-last 5 \\
        --output exports/x --format hf
    python tools/convert_checkpoint.py --checkpoint runs/x --average-best 3 --output exports/best3
    python tools/convert_checkpoint.py --checkpoint runs/x --output exports/x-ct2 \\
        --format ctranslate2 --quantization int8

Reads a checkpoint written with any number of pipeline stages, verifies its checksums, builds
the flat model, folds the residual scheme into a plain Post-LN model where it can (Pre-LN stays
Pre-LN) and writes model.safetensors, config.yaml, spm.model and export.json (which records the
directions the run's DATA_DIR trained, for translate.py). ``--format hf``
writes a Hugging Face MarianMTModel directory instead (checked by loading it back);
``--format ctranslate2`` a CTranslate2 model directory converted from it by ctranslate2's
converter (``--quantization``, default float32: the same translations as the PyTorch search)
with spm.model and export.json, for translate.py and evaluate.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_branchnorm.cli import ArgumentParser, UsageError, int_flag, run_main
from megatron_branchnorm.formats.outputs import check_parent_dir, refuse_overlap

PROG = "convert_checkpoint.py"
QUANTIZATIONS = ("int8", "int8_float32", "int16", "float16", "float32")
"""``--quantization`` (inference/ct2.QUANTIZATIONS, kept here so that ``--help`` stays light)."""
DEFAULT_QUANTIZATION = "float32"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (numbers range-checked by argparse)."""
    parser = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="train.save_dir of the run")
    parser.add_argument(
        "--tag", default=None, help="global_stepN, or best (train.keep_best; default: latest)"
    )
    parser.add_argument("--output", required=True, help="export directory to create")
    parser.add_argument("--format", choices=("native", "hf", "ctranslate2"), default="native")
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=None,
        help=f"weight type of a --format ctranslate2 export (default {DEFAULT_QUANTIZATION}: "
        "exact; int8: about 4x smaller and faster on CPU, a little BLEU lost)",
    )
    parser.add_argument(
        "--average-last",
        type=int_flag(1, 10_000),
        default=1,
        metavar="K",
        help="average the last K complete checkpoints up to --tag",
    )
    parser.add_argument(
        "--average-best",
        type=int_flag(1, 10_000),
        default=0,
        metavar="K",
        help="average the K best checkpoints by validation loss (best.json, train.keep_best)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --output that this tool wrote (an export), nothing else",
    )
    parser.add_argument(
        "--repartition",
        type=int_flag(1, 10_000),
        default=None,
        metavar="STAGES",
        help="instead of exporting, write the weights of a training checkpoint re-laid out "
        "for STAGES pipeline stages into --output (a new save_dir); the optimizer state stays "
        "behind: to keep it, resume the original save_dir in the new layout (train.py re-lays "
        "the whole state itself)",
    )
    args = parser.parse_args(argv)
    if args.quantization is not None and args.format != "ctranslate2":
        raise UsageError("--quantization applies to --format ctranslate2 only")
    if args.average_best and (args.average_last != 1 or args.tag is not None):
        raise UsageError("--average-best takes neither --average-last nor --tag")
    if args.repartition is not None:
        if args.overwrite:
            raise UsageError(
                "--overwrite does not apply to --repartition: a re-laid checkpoint goes into a "
                "new save_dir and never replaces one"
            )
        if args.average_last != 1 or args.average_best or args.format != "native":
            raise UsageError("--repartition takes none of --average-last, --average-best, --format")
    if args.format == "ctranslate2":
        from megatron_branchnorm.inference.ct2 import require_ctranslate2

        require_ctranslate2("--format ctranslate2")  # before any work
    return args


def _convert(argv: list[str] | None) -> int:
    args = parse_args(argv)
    from megatron_branchnorm.inference.convert import (
        checkpoint_vocabulary,
        dataset_of,
        load_pipeline_checkpoint,
        repartition_checkpoint,
        resolve_tags,
        trained_directions,
    )
    from megatron_branchnorm.inference.export import prepare_export_dir, save_export

    save_dir = Path(args.checkpoint)
    check_parent_dir(args.output, "--output")
    if args.repartition is not None:
        out = repartition_checkpoint(save_dir, args.output, args.repartition, args.tag)
        print(
            f"wrote {out}: weights for {args.repartition} stage(s), without the optimizer state "
            "(Adam starts fresh from it); train.py resumes the original save_dir in any layout "
            "with the whole state (docs/design.md §17)"
        )
        return 0
    # Before any work: the output must not overlap the run or its data, nor lie inside a
    # directory of a known kind, and --overwrite only ever replaces a directory this tool
    # wrote; checked before the checkpoint is read, again once its data.dataset is known.
    refuse_overlap(args.output, [("--checkpoint", save_dir)], "--output")

    def check_output(inputs: list[tuple[str, str | Path | None]]) -> None:
        if args.format == "native":
            prepare_export_dir(args.output, args.overwrite, "--output", inputs)
        else:
            from megatron_branchnorm.formats.outputs import prepare_output
            from megatron_branchnorm.inference.ct2 import CT2_EXPORT_KIND
            from megatron_branchnorm.inference.hf_export import HF_EXPORT_KIND

            kind = HF_EXPORT_KIND if args.format == "hf" else CT2_EXPORT_KIND
            prepare_output(args.output, kind, args.overwrite, "--output", inputs)

    check_output([("--checkpoint", save_dir)])
    tags = resolve_tags(save_dir, args.tag, args.average_last, args.average_best)
    inputs: list[tuple[str, str | Path | None]] = [
        ("--checkpoint", save_dir),
        ("the checkpoint's data.dataset", dataset_of(save_dir / tags[-1])),
    ]
    check_output(inputs)
    model, meta = load_pipeline_checkpoint(save_dir, tags[-1], args.average_last, args.average_best)
    vocab = checkpoint_vocabulary(save_dir, meta["averaged"] or [meta["tag"]])
    directions, unknown = trained_directions(save_dir / meta["tag"])
    for warning in [*vocab.warnings, *([unknown] if unknown else [])]:
        print(f"warning: {warning}", file=sys.stderr)
    meta["languages"] = vocab.languages
    if directions is not None:
        meta["directions"] = directions  # translate refuses others without --zero-shot
    meta["vocab"] = vocab.provenance()
    if args.format == "native":
        out = save_export(model, args.output, vocab.spm_path, meta, overwrite=args.overwrite)
        print(f"wrote {out} (step {model.step}, {model.cfg.residual})")
        return 0
    if args.format == "ctranslate2":
        from megatron_branchnorm.inference.ct2 import export_ct2

        quantization = args.quantization or DEFAULT_QUANTIZATION
        result = export_ct2(
            model, args.output, vocab.spm_path, meta, quantization, args.overwrite, inputs=inputs
        )
        print(
            f"wrote {args.output} (CTranslate2 {quantization}, from a Hugging Face export "
            f"whose max |logit diff| was {result['max_abs_diff']:.2e})"
        )
        return 0
    from megatron_branchnorm.inference.hf_export import export_hf

    result = export_hf(model, args.output, vocab.spm_path, overwrite=args.overwrite, inputs=inputs)
    print(
        f"wrote {args.output} (Hugging Face MarianMTModel; max |logit diff| "
        f"{result['max_abs_diff']:.2e})"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Bad input (a flag, the checkpoint, an output over an input) is one line ``error: ...``
    and exit 2; Ctrl-C (even during the torch import) exits 130; outputs appear only when
    complete."""
    return run_main(_convert, argv)


if __name__ == "__main__":
    sys.exit(main())
