"""A throwaway Python environment holding the anchors we benchmark against: fairseq 0.12.2
and torchscale 0.3.0 (beside torch 2.13 CPU). Never inside the repository, never in .venv.

    python tools/_bench_anchors.py --prepare      # builds it if missing; prints its python

The logic lives in megatron_branchnorm/experiments/bench_anchors.py.
"""

from megatron_branchnorm.experiments.bench_anchors import main

if __name__ == "__main__":
    main()
