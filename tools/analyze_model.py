#!/usr/bin/env python
"""Layer-wise analyses of exported models (BranchNorm paper, Figs. 8 and 9): the cosine
similarity between adjacent layers' representations and the sparsity of the FFN activations,
per encoder and decoder layer, on a DATA_DIR's held-out sentences (teacher-forced).

    python tools/analyze_model.py runs/study/export/branchnorm runs/study/export/deepnorm \\
        --data runs/study/data --split test --output analysis.png --json analysis.json

The logic lives in megatron_branchnorm/experiments/analyze_model.py.
"""

import sys

from megatron_branchnorm.experiments.analyze_model import main

if __name__ == "__main__":
    sys.exit(main())
