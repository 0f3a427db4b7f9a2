#!/usr/bin/env python
"""Build the built-in English-centric corpus (OPUS-100 layout) from installed gettext catalogs.

    python tools/build_locale_corpus.py --output data/locale_raw --langs de,fr
    python tools/preprocess_data.py --format opus100 --input data/locale_raw --langs de,fr \\
        --output data/locale --vocab-size 8000
"""

from megatron_branchnorm.commands.corpus import main

if __name__ == "__main__":
    raise SystemExit(main())
