"""Validation over every direction on 1 and 2 gloo ranks.

    RANK=r WORLD_SIZE=1|2 ... python tests/pipeline/validation_harness.py DATA_DIR OUT_DIR

Every run validates the initial weights (the same on every topology: layers are seeded from
(seed, layer)) as step 0 of its metrics.jsonl. On 1 rank: ``one`` (1 stage), which then
trains 1 update with validation every update (the sampling table, the trainer's own
validation row). On 2 ranks: ``dp2`` (1 stage x 2 data-parallel) and ``pp2`` (2 stages).
Each run's validation plan goes to OUT_DIR/<run>/plan.json (rank 0).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import deepspeed  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_branchnorm.config import load_config  # noqa: E402
from megatron_branchnorm.training.environment import setup_process_env  # noqa: E402
from megatron_branchnorm.training.trainer import Trainer  # noqa: E402

K = 6
"""data.valid_samples_per_direction of the runs (tests/pipeline/test_validation.py)."""


def overrides(data_dir: str, save_dir: Path, *extra: str) -> list[str]:
    """tiny_cpu on the corpus at ``data_dir``, Post-LN (no alpha_t to match), no dropout,
    micro-batches of at most 64 tokens (several per direction)."""
    return [
        f"data.dataset={data_dir}",
        "model.vocab_size=null",
        "model.residual=postln",
        "model.dropout=0.0",
        "data.max_length=48",
        "data.max_tokens=64",
        f"data.valid_samples_per_direction={K}",
        "train.save_interval=0",
        "train.log_interval=1",
        f"train.save_dir={save_dir}",
        *extra,
    ]


def validate_initial(cfg, save_dir: Path) -> Trainer:
    """A Trainer of ``cfg`` that has validated its initial weights as step 0."""
    trainer = Trainer(cfg)
    trainer.validator.run(0)
    valid = trainer.validator.valid
    if trainer.rank == 0:
        plan = {"counts": valid.counts, "per_rank": valid.per_rank, "dp": valid.dp}
        (save_dir / "plan.json").write_text(json.dumps(plan))
    return trainer


def main() -> None:
    data_dir, out_dir = sys.argv[1], Path(sys.argv[2])
    setup_process_env()
    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    if world == 1:
        run = out_dir / "one"
        cfg = load_config(
            "tiny_cpu", overrides(data_dir, run, "train.max_steps=1", "train.eval_interval=1")
        )
        validate_initial(cfg, run).train()
        return
    for name, stages in (("dp2", 1), ("pp2", 2)):
        run = out_dir / name
        cfg = load_config("tiny_cpu", overrides(data_dir, run, f"pipeline.stages={stages}"))
        validate_initial(cfg, run).close()
        dist.barrier()


if __name__ == "__main__":
    main()
    # Skip the interpreter's teardown, as train.py does (train.exit_now): gloo's threads torn
    # down after Python sometimes abort a rank that has finished ("terminate called without an
    # active exception", exit -6; seen here in a fresh-clone CI run). The results are written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
