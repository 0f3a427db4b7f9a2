"""The learning-rate schedule (fairseq's inverse_sqrt), shared by the trainer and the probes.

No DeepSpeed import here: tools that train the flat model (tools/probe_learning.py) use it too.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from megatron_branchnorm.config import ExperimentConfig


def inverse_sqrt_factor(cfg: ExperimentConfig) -> Callable[[int], float]:
    """LR multiplier of update t = e + 1 (LambdaLR's epoch e): linear warm-up from
    warmup_init_lr to lr over warmup_steps, then lr * sqrt(warmup_steps / t) (fairseq)."""
    peak, init, warm = cfg.train.lr, cfg.train.warmup_init_lr, cfg.train.warmup_steps

    def factor(e: int) -> float:
        t = e + 1
        if warm > 0 and t <= warm:
            return (init + (peak - init) * t / warm) / peak
        return math.sqrt(max(warm, 1) / t)

    return factor
