#!/usr/bin/env python
"""Layer-wise analyses of exported models (BranchNorm paper, Figs. 8 and 9): the cosine similarity
between adjacent layers' representations and the sparsity of the FFN activations, per encoder
and decoder layer, on a DATA_DIR's held-out sentences (teacher-forced).

Front door: `python tools/analyze_model.py --help` gives the usage; the code is
megatron_branchnorm/experiments/analyze_model.py.
"""

import sys

from megatron_branchnorm.experiments.analyze_model import main

if __name__ == "__main__":
    sys.exit(main())
