"""Validation during training: the per-token loss on the valid split every
train.eval_interval updates, and early stopping on it (train.patience, fairseq's
``--patience``: :mod:`megatron_branchnorm.patience`)."""

from __future__ import annotations

import torch

from megatron_branchnorm.config import ExperimentConfig
from megatron_branchnorm.patience import Patience
from megatron_branchnorm.training import collectives
from megatron_branchnorm.training.data import as_engine_items, build_batches
from megatron_branchnorm.training.metrics import MetricsLog, valid_losses


def reduce_loss_sums(loss_fn) -> torch.Tensor:
    """(label-smoothed loss sum, NLL sum, target tokens) of the micro-batches just run, summed
    over all ranks (only last-stage ranks hold non-zero sums), as a float64 tensor of 3 on the
    communication device: nothing waits for the GPU until :func:`read_loss_sums`. Resets
    ``loss_fn``'s sums."""
    sums = collectives.all_reduce(loss_fn.sums(collectives.communication_device()))
    loss_fn.reset()
    return sums


def read_loss_sums(sums: torch.Tensor) -> tuple[float, float, int]:
    """What :func:`reduce_loss_sums` returned, on the host (one host sync)."""
    loss_sum, nll_sum, count = collectives.to_host(sums)
    return loss_sum, nll_sum, int(count)


class Validator:
    """Owns train.eval_interval, the validation batches (read and collated once) and the
    early-stopping state."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        engine,
        loss_fn,
        world: int,
        dp: int,
        dp_id: int,
        metrics: MetricsLog,
        max_batches: int = 64,
    ) -> None:
        self.cfg, self.engine, self.loss_fn = cfg, engine, loss_fn
        self.world, self.dp, self.dp_id = world, dp, dp_id
        self.metrics = metrics
        self.max_batches = max_batches
        self.batches: list[dict] | None = None
        self.patience = Patience(cfg.train.patience)

    def due(self, step: int) -> bool:
        interval = self.cfg.train.eval_interval
        return bool(interval) and step % interval == 0

    def _load(self) -> list[dict]:
        """Up to ``max_batches`` validation batches, a multiple of the data-parallel size."""
        try:
            valid = build_batches(self.cfg, "valid", shuffle=False)
        except Exception as exc:  # noqa: BLE001 - a dataset without valid split
            self.metrics.log(f"validation skipped: {exc}")
            return []
        batches = []
        for b in valid:
            batches.append(b)
            if len(batches) >= self.max_batches:
                break
        return batches[: (len(batches) // self.dp) * self.dp]

    def loss(self) -> float | None:
        """Per-token validation loss (label-smoothed, as trained) on the valid split; None
        without a valid split."""
        if self.batches is None:
            self.batches = self._load()
        if not self.batches:
            return None
        per_rank = len(self.batches) // self.dp
        ntokens = sum(int(b["ntokens"]) for b in self.batches)
        mine = self.batches[self.dp_id * per_rank : (self.dp_id + 1) * per_rank]
        self.loss_fn.reset()
        self.loss_fn.scale = per_rank * self.dp / ntokens
        items = list(as_engine_items(mine, self.engine.device))
        self.engine.eval_batch(iter(items), num_micro_batches=per_rank)
        loss_sum, _, count = read_loss_sums(reduce_loss_sums(self.loss_fn))
        return loss_sum / max(count, 1)

    def run(self, step: int) -> bool:
        """Validate at ``step`` and record it; True when early stopping says stop (the same
        answer on every rank: the loss is reduced over all of them)."""
        vloss = self.loss()
        if vloss is None:
            return False
        self.metrics.write({"step": step, "valid_loss": vloss})
        self.metrics.log(f"step {step} | valid loss {vloss:.4f}")
        return self.patience.update(step, vloss)

    def record_early_stop(self, step: int) -> None:
        p = self.patience
        self.metrics.write(
            {"step": step, "early_stop": True, "best_valid_loss": p.best, "best_step": p.best_step}
        )
        self.metrics.log(f"early stop at step {step}: {p.describe()}")

    def restore_patience(self, step: int, rank: int, save_dir) -> None:
        """Early stopping's state at the resumed ``step``, from rank 0's read of
        metrics.jsonl (broadcast: every rank must take the same decision); nothing is read
        when it is off or the run starts fresh."""
        if not self.patience.patience or not step:
            return
        losses = collectives.broadcast_object(valid_losses(save_dir) if rank == 0 else None)
        self.patience.restore(losses, step)
