#!/usr/bin/env python
"""Translate text with an export directory (tools/convert_checkpoint.py): beam search with the
key/value cache, length penalty as in fairseq, SentencePiece detokenisation.

Front door: `python tools/translate.py --help` gives the usage; the code is
megatron_branchnorm/commands/translate.py.
"""

from megatron_branchnorm.commands.translate import main

if __name__ == "__main__":
    raise SystemExit(main())
