"""Variable batch shapes in DeepSpeed's pipeline: dynamic_shape=True vs fixed bucket shapes.

    python tools/bench_pipeline_shapes.py --steps 30          # starts 2 gloo ranks itself

The logic lives in megatron_branchnorm/experiments/bench_pipeline_shapes.py.
"""

import sys

from megatron_branchnorm.experiments.bench_pipeline_shapes import main

if __name__ == "__main__":
    sys.exit(main())
