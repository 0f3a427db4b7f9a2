"""Gloo ranks, started once, run the in-process fault checks and write results.

    RANK=r WORLD_SIZE=2|4 ... python tests/faults/harness.py OUT_DIR

Runs (all with tests/faults/common.py's BASE config: dropout, activation checkpointing).
On 2 ranks: ``ref`` 12 updates (checkpoints at 4, 8, 12: the corruption matrix copies them);
``resume`` 6 updates, then a new Trainer resumes to 12 (golden resume); ``skip`` a NaN loss at
update 3 and an Inf gradient on stage 0 at update 5 (two skipped updates); ``stop``: 3 updates,
then a resumed Trainer gets an Inf gradient at update 4 three times in a row with
train.max_consecutive_skips=3 (must stop with parameters, moments and LR untouched);
``dp_equiv`` 3 updates with dropout 0.
On 4 ranks (pp2 x dp2, one micro-batch per replica): ``ref`` 6 updates (the reference of the
signal test in tests/faults/conftest.py::dp2_runs); ``dp_equiv`` as on 2 ranks.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_branchnorm.config import load_config  # noqa: E402
from megatron_branchnorm.experiments.fault_inject import injecting  # noqa: E402
from megatron_branchnorm.training.environment import setup_process_env  # noqa: E402
from megatron_branchnorm.training.trainer import Trainer  # noqa: E402
from tests.faults.common import (  # noqa: E402
    BASE,
    DP_RUN,
    DP_STEPS,
    DP_WORLD,
    EQUIV,
    EQUIV_STEPS,
    STEPS,
)


def train(save_dir: Path, steps: int, *extra: str, fault: str = "") -> tuple[Trainer, int]:
    """A Trainer on BASE, trained; ``fault`` is the injection spec installed around it
    (experiments/fault_inject.py). Returns the trainer and its exit code."""
    cfg = load_config(
        "tiny_cpu",
        [*BASE, f"train.save_dir={save_dir}", f"train.max_steps={steps}", *extra],
    )
    with injecting(fault):
        trainer = Trainer(cfg)
        return trainer, trainer.train()


def snapshot(trainer: Trainer) -> dict:
    """Parameters, Adam moments and LR state of this rank's stage (CPU copies)."""
    opt = trainer.optimizer
    state = {}
    for i, p in enumerate(p for g in opt.param_groups for p in g["params"]):
        s = opt.state.get(p, {})
        state[i] = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in s.items()}
    return {
        "params": {k: v.detach().clone() for k, v in trainer.module.state_dict().items()},
        "moments": state,
        "lr": [g["lr"] for g in opt.param_groups],
        "sched": trainer.scheduler.last_epoch,
        "step": trainer.state.step,
    }


def same(a: dict, b: dict) -> dict[str, bool]:
    """Which parts of two snapshots are bit-identical."""
    params = a["params"].keys() == b["params"].keys() and all(
        torch.equal(a["params"][k], b["params"][k]) for k in a["params"]
    )
    moments = a["moments"].keys() == b["moments"].keys() and all(
        a["moments"][i].keys() == b["moments"][i].keys()
        and all(
            torch.equal(x, b["moments"][i][k]) if torch.is_tensor(x) else x == b["moments"][i][k]
            for k, x in a["moments"][i].items()
        )
        for i in a["moments"]
    )
    return {
        "params": params,
        "moments": moments and len(a["moments"]) > 0,
        "lr": a["lr"] == b["lr"] and a["sched"] == b["sched"],
        "step": a["step"] == b["step"],
    }


def main() -> None:
    out_dir = Path(sys.argv[1])
    setup_process_env()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    if dist.get_world_size() == DP_WORLD:
        train(out_dir / "ref", DP_STEPS, *DP_RUN)
        train(out_dir / "dp_equiv", EQUIV_STEPS, *DP_RUN, *EQUIV)
        dist.barrier()
        return
    out: dict = {}

    train(out_dir / "ref", STEPS, "train.save_interval=4")
    train(out_dir / "resume", STEPS // 2, "train.save_interval=4")
    train(out_dir / "resume", STEPS, "train.save_interval=4")
    train(out_dir / "dp_equiv", EQUIV_STEPS, *EQUIV)

    skip, code = train(
        out_dir / "skip", 6, "train.save_interval=0", fault="nan_loss@3,inf_grad@5:stage0"
    )
    per_rank = [None, None]
    dist.all_gather_object(per_rank, {"engine_skipped": skip.engine.skipped_steps, "code": code})
    out["skip"] = per_rank

    first, _ = train(out_dir / "stop", 3, "train.save_interval=0")
    before = snapshot(first)
    stop, code = train(
        out_dir / "stop",
        6,
        "train.save_interval=0",
        "train.max_consecutive_skips=3",
        fault="inf_grad@4x3",
    )
    per_rank = [None, None]
    dist.all_gather_object(
        per_rank,
        {"code": code, "engine_skipped": stop.engine.skipped_steps, **same(before, snapshot(stop))},
    )
    out["stop"] = per_rank
    if rank == 0:
        (out_dir / "harness.json").write_text(json.dumps(out, indent=1))
    dist.barrier()


if __name__ == "__main__":
    main()
    # Skip the interpreter's teardown, as train.py does (train.exit_now): gloo's threads torn
    # down after Python sometimes abort a rank that has finished ("terminate called without an
    # active exception", exit -6; seen here in a fresh-clone CI run). The results are written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
