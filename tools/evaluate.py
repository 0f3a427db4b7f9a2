#!/usr/bin/env python
"""Evaluate an export on every direction of a preprocessed DATA_DIR: sacreBLEU BLEU and chrF
against the raw references, averages X->En / En->X / all, a table on stdout.

Front door: `python tools/evaluate.py --help` gives the usage; the code is
megatron_branchnorm/commands/evaluate.py.
"""

from megatron_branchnorm.commands.evaluate import main

if __name__ == "__main__":
    raise SystemExit(main())
