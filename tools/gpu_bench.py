"""train.py's steady state beside torch.nn.Transformer (eager and compiled) and torchscale, on
the GPU this machine has (or --device cpu, a small mode): one table.

Front door: `python tools/gpu_bench.py --help` gives the usage; the code is
megatron_branchnorm/experiments/gpu_bench.py.
"""

from megatron_branchnorm.experiments.gpu_bench import main

if __name__ == "__main__":
    raise SystemExit(main())
