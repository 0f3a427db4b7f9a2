#!/usr/bin/env python
"""Preprocess an English-centric parallel corpus into a DATA_DIR for training.

    python tools/preprocess_data.py --format opus100 --input RAW --langs de,fr \\
        --output DATA_DIR --vocab-size 64000 --workers 8

Validates the input, trains one joint SentencePiece model (with <2xx> tags), encodes, and
writes indexed datasets for both directions of every pair, the raw dev/test references and
manifest.json (see docs/data.md). The output appears only when complete.
"""

from megatron_branchnorm.commands.preprocess import main

if __name__ == "__main__":
    raise SystemExit(main())
