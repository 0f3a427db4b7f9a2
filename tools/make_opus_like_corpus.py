#!/usr/bin/env python
"""Write a synthetic corpus of OPUS-100's shape (OPUS-100 layout) with N training pairs.

Front door: `python tools/make_opus_like_corpus.py --help` gives the usage; the code is
megatron_branchnorm/commands/opus_like.py.
"""

from megatron_branchnorm.commands.opus_like import main

if __name__ == "__main__":
    raise SystemExit(main())
