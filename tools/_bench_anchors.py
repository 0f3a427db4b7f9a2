"""A throwaway Python environment holding the anchors we benchmark against: fairseq 0.12.2 and
torchscale 0.3.0 (beside torch 2.13 CPU). Never inside the repository, never in .venv.

Front door: `python tools/_bench_anchors.py --help` gives the usage; the code is
megatron_branchnorm/experiments/bench_anchors.py.
"""

from megatron_branchnorm.experiments.bench_anchors import main

if __name__ == "__main__":
    main()
