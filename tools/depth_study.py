#!/usr/bin/env python
"""Depth study: Post-LN, Pre-LN, DeepNorm and BranchNorm at increasing depth (BranchNorm paper,
Fig. 3), each cell a real 2-stage DeepSpeed pipeline training on the built-in corpus.

    python tools/depth_study.py --data runs/study/data --out runs/study/depth \\
        --schemes postln,preln,deepnorm,branchnorm --depths 6,50 --steps 100
    python tools/depth_study.py --data runs/study/data --out runs/study/depth \\
        --schemes branchnorm --depths 500 --steps 30        # the 1000-layer cell
    python tools/depth_study.py --out runs/study/depth --report-only   # table + PNG again

The logic lives in megatron_branchnorm/experiments/depth_study.py.
"""

import sys

from megatron_branchnorm.experiments.depth_study import main

if __name__ == "__main__":
    sys.exit(main())
