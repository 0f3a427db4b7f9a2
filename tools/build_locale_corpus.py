#!/usr/bin/env python
"""Build the built-in English-centric corpus (OPUS-100 layout) from installed gettext catalogs.

Front door: `python tools/build_locale_corpus.py --help` gives the usage; the code is
megatron_branchnorm/commands/corpus.py.
"""

from megatron_branchnorm.commands.corpus import main

if __name__ == "__main__":
    raise SystemExit(main())
