#!/usr/bin/env python
"""Preprocess an English-centric parallel corpus into a DATA_DIR for training.

Front door: `python tools/preprocess_data.py --help` gives the usage; the code is
megatron_branchnorm/commands/preprocess.py.
"""

from megatron_branchnorm.commands.preprocess import main

if __name__ == "__main__":
    raise SystemExit(main())
