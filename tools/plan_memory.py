"""Plan GPU memory and pipeline bubble for a config before launching it; builds no model.

    python tools/plan_memory.py --config opus100_1000L --gpus 32 --gpu-memory 40GB
    python tools/plan_memory.py --config opus100_1000L --gpus 8 --gpu-memory 80GB --stages 8
    python tools/plan_memory.py --config opus100_200L --gpus 8 --gpu-memory 80GB --stages auto

Prints per stage: parameters, weights + gradients, ZeRO-1 optimizer state, activation memory
with and without checkpointing, the pipeline bubble (p-1)/(m+p-1), whether it fits, and a line
``total parameters: X.XXB``. ``section.key=value`` overrides apply as in train.py. Exit codes:
0 fits, 1 does not fit, 2 bad input (one line ``error: ...``), 130 Ctrl-C. The estimates are explained in megatron_branchnorm/planner.py.
"""

from megatron_branchnorm.commands.plan import main

if __name__ == "__main__":
    raise SystemExit(main())
