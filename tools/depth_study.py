#!/usr/bin/env python
"""Depth study: Post-LN, Pre-LN, DeepNorm and BranchNorm at increasing depth (BranchNorm paper,
Fig. 3), each cell a real 2-stage DeepSpeed pipeline training on the built-in corpus.

Front door: `python tools/depth_study.py --help` gives the usage; the code is
megatron_branchnorm/experiments/depth_study.py.
"""

import sys

from megatron_branchnorm.experiments.depth_study import main

if __name__ == "__main__":
    sys.exit(main())
