"""Micro-benchmarks and a profile behind docs/performance.md (one change at a time).

    python tools/_bench_micro.py                 # loss and Adam variants, interleaved, medians
    python tools/_bench_micro.py --profile ours  # op profile of one model step (12L-12L)
    python tools/_bench_micro.py --profile ours --bf16
    python tools/_bench_micro.py --dropout-ab    # our CPU dropout vs F.dropout, alone and in a step
    python tools/_bench_micro.py --compile-ab    # the residual tail LN(x + a*drop(y)), eager vs compiled
    python tools/_bench_micro.py --split-ab      # attention heads: unbind (the model's) vs slicing

The logic lives in megatron_branchnorm/experiments/bench_micro.py.
"""

from megatron_branchnorm.experiments.bench_micro import main

if __name__ == "__main__":
    main()
