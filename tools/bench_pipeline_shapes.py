"""Variable batch shapes in DeepSpeed's pipeline: dynamic_shape=True vs fixed bucket shapes.

Front door: `python tools/bench_pipeline_shapes.py --help` gives the usage; the code is
megatron_branchnorm/experiments/bench_pipeline_shapes.py.
"""

import sys

from megatron_branchnorm.experiments.bench_pipeline_shapes import main

if __name__ == "__main__":
    sys.exit(main())
