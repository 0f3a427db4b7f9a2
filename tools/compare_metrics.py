"""Whether two training runs recorded the same thing: their metrics.jsonl row by row, exactly,
leaving out the timing keys (tokens_per_sec, tflops_per_gpu, memory_mb, elapsed_s, eta_s).

    python tools/compare_metrics.py RUN_A RUN_B     # exit 0 same, 1 different, 2 unreadable

Front door: `python tools/compare_metrics.py --help` gives the usage; the code is
megatron_branchnorm/experiments/compare_metrics.py.
"""

import sys

from megatron_branchnorm.experiments.compare_metrics import main

if __name__ == "__main__":
    sys.exit(main())
