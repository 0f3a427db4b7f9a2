"""Convert a DeepSpeed pipeline checkpoint into an export directory for inference.

    python tools/convert_checkpoint.py --checkpoint runs/tiny --output exports/tiny
    python tools/convert_checkpoint.py --checkpoint runs/x --tag global_step4000 --average-last 5 \\
        --output exports/x --format hf

Reads a checkpoint written with any number of pipeline stages, verifies its checksums, builds
the flat model, folds the residual scheme into a plain Post-LN model where it can (Pre-LN stays
Pre-LN) and writes model.safetensors, config.yaml, spm.model and export.json. ``--format hf``
writes a Hugging Face MarianMTModel directory instead (checked by loading it back).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse, convert, write."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="train.save_dir of the run")
    parser.add_argument("--tag", default=None, help="global_stepN (default: latest)")
    parser.add_argument("--output", required=True, help="export directory to create")
    parser.add_argument("--format", choices=("native", "hf"), default="native")
    parser.add_argument(
        "--average-last",
        type=int,
        default=1,
        help="average the last K complete checkpoints up to --tag",
    )
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument(
        "--repartition",
        type=int,
        default=None,
        metavar="STAGES",
        help="instead of exporting, write a training checkpoint re-laid out "
        "for STAGES pipeline stages into --output (a new save_dir)",
    )
    args = parser.parse_args(argv)

    from megatron_branchnorm.checkpoint import CheckpointError
    from megatron_branchnorm.inference.convert import (
        ConvertError,
        load_pipeline_checkpoint,
        repartition_checkpoint,
    )
    from megatron_branchnorm.inference.export import ExportError, save_export

    try:
        if args.repartition is not None:
            out = repartition_checkpoint(args.checkpoint, args.output, args.repartition, args.tag)
            print(f"wrote {out}: checkpoint for {args.repartition} stage(s)")
            return 0
        model, meta = load_pipeline_checkpoint(args.checkpoint, args.tag, args.average_last)
        spm_path = None
        data = meta.get("data")
        if data and data != "synthetic":
            manifest_path = Path(data) / "manifest.json"
            if manifest_path.is_file():
                manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
                spm_path = Path(data) / manifest.get("spm_model", "spm.model")
                meta["languages"] = manifest.get("languages", [])
                if not spm_path.is_file():
                    spm_path = None
        if args.format == "native":
            out = save_export(model, args.output, spm_path, meta, overwrite=args.overwrite)
            print(f"wrote {out} (step {model.step}, {model.cfg.residual})")
        else:
            from megatron_branchnorm.inference.hf_export import HFExportError, export_hf

            try:
                result = export_hf(model, args.output, spm_path)
            except HFExportError as exc:
                raise ExportError(str(exc)) from None
            print(
                f"wrote {args.output} (Hugging Face MarianMTModel; max |logit diff| "
                f"{result['max_abs_diff']:.2e})"
            )
    except (ConvertError, CheckpointError, ExportError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
