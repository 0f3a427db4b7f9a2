"""Side-by-side performance benchmark against fairseq, torchscale and torch.nn.Transformer.

Front door: `python tools/benchmark.py --help` gives the usage; the code is
megatron_branchnorm/experiments/benchmark.py.
"""

import sys

from megatron_branchnorm.experiments.benchmark import main

if __name__ == "__main__":
    sys.exit(main())
