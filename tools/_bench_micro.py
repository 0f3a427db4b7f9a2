"""Micro-benchmarks and a profile behind docs/performance.md (one change at a time).

Front door: `python tools/_bench_micro.py --help` gives the usage; the code is
megatron_branchnorm/experiments/bench_micro.py.
"""

from megatron_branchnorm.experiments.bench_micro import main

if __name__ == "__main__":
    main()
