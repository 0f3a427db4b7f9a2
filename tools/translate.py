#!/usr/bin/env python
"""Translate text with an export directory (tools/convert_checkpoint.py): beam search with the
key/value cache, length penalty as in fairseq, SentencePiece detokenisation.

    python tools/translate.py --model exports/run1 --src-lang de --tgt-lang en < in.de > out.en
    python tools/translate.py --model exports/run1 --src-lang en --tgt-lang fr \\
        --input test.en --output test.fr --beam 5 --lenpen 1.0

One output line per input line (an empty input line gives an empty output line). With
``--nbest K`` (K > 1) each input line gives K lines ``index<TAB>rank<TAB>score<TAB>text``.
"""

from megatron_branchnorm.commands.translate import main

if __name__ == "__main__":
    raise SystemExit(main())
