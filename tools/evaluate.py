#!/usr/bin/env python
"""Evaluate an export on every direction of a preprocessed DATA_DIR: sacreBLEU BLEU and chrF
against the raw references, averages X->En / En->X / all, a table on stdout.

    python tools/evaluate.py --model exports/run1 --data data/opus100 --split test \\
        --json results/test.json --hyp-dir results/hyp
    python tools/evaluate.py --model exports/multiun --data data/multiun --split test --lowercase

Cased sacreBLEU by default (OPUS-100); --lowercase for MultiUN; --tokenize picks sacreBLEU's
tokenizer (default: by target language: zh; ja-mecab or char; 13a otherwise); --bleu tokenized
[--compound-split] is the tokenized BLEU of the WMT14 En-Fr and WMT17 En-De papers. The
signature of every score is printed.
"""

from megatron_branchnorm.commands.evaluate import main

if __name__ == "__main__":
    raise SystemExit(main())
