"""Convert a DeepSpeed pipeline checkpoint into an export directory for inference.

    python tools/convert_checkpoint.py --checkpoint runs/tiny --output exports/tiny
    python tools/convert_checkpoint.py --checkpoint runs/x --tag global_step4000 --average-last 5 \\
        --output exports/x --format hf
    python tools/convert_checkpoint.py --checkpoint runs/x --average-best 3 --output exports/best3

Reads a checkpoint written with any number of pipeline stages, verifies its checksums, builds
the flat model, folds the residual scheme into a plain Post-LN model where it can (Pre-LN stays
Pre-LN) and writes model.safetensors, config.yaml, spm.model and export.json. ``--format hf``
writes a Hugging Face MarianMTModel directory instead (checked by loading it back).
"""

from megatron_branchnorm.commands.convert import main

if __name__ == "__main__":
    raise SystemExit(main())
