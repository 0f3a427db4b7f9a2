"""A depth-by-scheme sweep on SLURM (submit), and its results as the paper's tables (table).

Front door: `python tools/sweep.py --help` gives the usage; the code is
megatron_branchnorm/experiments/sweep.py.
"""

import sys

from megatron_branchnorm.experiments.sweep import main

if __name__ == "__main__":
    sys.exit(main())
