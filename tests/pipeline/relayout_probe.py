"""train.py's main, with each rank's training state written right after a resume in another
layout (tests/pipeline/test_relayout.py compares it with the checkpoint it came from).

    RANK=r WORLD_SIZE=w ... python tests/pipeline/relayout_probe.py OUT_DIR --config ... [k=v ...]

The state is read back through what each optimizer exposes, not through the resume's own
code: torch's ``optimizer.state`` in fp32, DeepSpeed's ``safe_get_full_fp32_param`` and
``safe_get_full_optimizer_state`` (an all-reduce over the data-parallel group) in bf16.
OUT_DIR/rank<r>.pt holds ``{flat key: {"master", "exp_avg", "exp_avg_sq", "step"}}``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_branchnorm.training import stop_signals  # noqa: E402

stop_signals.install()

import torch  # noqa: E402

from megatron_branchnorm import train  # noqa: E402
from megatron_branchnorm.parallel.partition import engine_param_to_flat_key, spec_names  # noqa: E402
from megatron_branchnorm.training.checkpointer import Checkpointer  # noqa: E402


def live_state(ckpt: Checkpointer) -> dict[str, dict[str, torch.Tensor]]:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    names = spec_names(ckpt.cfg.model)
    fp32 = ckpt.engine.optimizer is ckpt.optimizer
    out = {}
    for name, p in ckpt.module.named_parameters():
        key = engine_param_to_flat_key(name, names)
        if fp32:
            adam = ckpt.optimizer.state[p]
            got = {"master": p.detach(), **{k: adam[k] for k in ("exp_avg", "exp_avg_sq")}}
            step = adam["step"]
        else:
            got = {
                "master": safe_get_full_fp32_param(p),
                **{k: safe_get_full_optimizer_state(p, k) for k in ("exp_avg", "exp_avg_sq")},
            }
            flat = ckpt.engine.optimizer.fp32_groups_flat_partition[0]
            step = ckpt.engine.optimizer.optimizer.state[flat]["step"]
        out[key] = {k: v.detach().float().flatten().cpu().clone() for k, v in got.items()}
        out[key]["step"] = step.detach().float().cpu().clone()
    return out


def main() -> None:
    out_dir = Path(sys.argv[1])
    original = Checkpointer._resume_other_layout

    def probed(self, tag_dir, saved):
        original(self, tag_dir, saved)
        out_dir.mkdir(parents=True, exist_ok=True)
        torch.save(live_state(self), out_dir / f"rank{self.rank}.pt")

    Checkpointer._resume_other_layout = probed
    train.exit_now(train.main(sys.argv[2:]))


if __name__ == "__main__":
    main()
