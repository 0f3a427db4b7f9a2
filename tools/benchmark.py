"""Side-by-side performance benchmark against fairseq, torchscale and torch.nn.Transformer.

    python tools/benchmark.py --quick                       # ~ a few minutes on 2 cores
    python tools/benchmark.py --sections model,trainstep --rounds 5 --json out.json

The logic lives in megatron_branchnorm/experiments/benchmark.py.
"""

import sys

from megatron_branchnorm.experiments.benchmark import main

if __name__ == "__main__":
    sys.exit(main())
