"""Validation during training (docs/design.md §16): every train.eval_interval updates, the
per-token loss of every translation direction on a fixed sample of its dev split (the first
``data.valid_samples_per_direction`` usable sentences), the averages over X->pivot, pivot->X
and all directions, and early stopping (train.patience, fairseq's ``--patience``:
:mod:`megatron_branchnorm.training.patience`) on the all-direction figure.

``valid_loss``, the figure early stopping and keep_best read, is the macro average: the mean
of the directions' per-token losses, each direction counting once.

On the pipeline, one ``engine.eval_batch`` runs every validation micro-batch: each data-parallel
replica takes a contiguous share of the micro-batches (direction by direction, each cut by
length under data.max_tokens), padded to the same count on every replica with micro-batches
whose target is all padding (the loss masks PAD_ID: they add 0 loss and 0 tokens). The last
stage's loss records one row of sums per micro-batch (``PipeLoss.start_recording``), which are
added per direction into a (directions, 3) tensor on the device; one all-reduce, one read.
Every rank knows the micro-batch count from the sentence lengths alone: only the first and last
stages collate batches.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from megatron_branchnorm.config import ExperimentConfig
from megatron_branchnorm.formats.data_dir import DataError
from megatron_branchnorm.formats.records import valid_losses
from megatron_branchnorm.tokens import PAD_ID
from megatron_branchnorm.training import collectives
from megatron_branchnorm.training.data import as_engine_items, build_batches
from megatron_branchnorm.training.metrics import MetricsLog
from megatron_branchnorm.training.patience import Patience


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


class _SyntheticSource:
    """The synthetic copy/reverse task as a one-direction ``SampleSource``
    (megatron_branchnorm/data/dataset.py), so validation batches it as it batches a corpus."""

    def __init__(self, data) -> None:
        self.data = data
        self.directions = list(data.directions)
        n = np.asarray(data.lengths_raw, dtype=np.int64)
        self._lengths = (n + 2, n + 1)  # task token + words + EOS; words + EOS

    def group_indices(self, group: int) -> np.ndarray:
        return np.arange(len(self.data), dtype=np.int64)

    def group_lengths(self, group: int) -> tuple[np.ndarray, np.ndarray]:
        return self._lengths

    def sample_offset(self, group: int) -> int:
        return 0

    def collate(self, group: int, indices: np.ndarray) -> dict:
        from megatron_branchnorm.data.synthetic import collate

        return collate(self.data, [int(i) for i in indices])


class _FirstSamples:
    """Direction ``group`` of a ``SampleSource`` cut to its first ``k`` usable samples (all
    when ``k`` is 0), as a one-direction ``SampleSource``."""

    def __init__(self, source, group: int, k: int) -> None:
        self.source, self.group = source, group
        self.directions = [source.directions[group]]
        usable = source.group_indices(group)
        self.indices = usable[:k] if k else usable

    def group_indices(self, group: int) -> np.ndarray:
        return self.indices

    def group_lengths(self, group: int) -> tuple[np.ndarray, np.ndarray]:
        return self.source.group_lengths(self.group)

    def sample_offset(self, group: int) -> int:
        return self.source.sample_offset(self.group)

    def collate(self, group: int, indices: np.ndarray) -> dict:
        return self.source.collate(self.group, indices)


@dataclasses.dataclass
class ValidSet:
    """The validation micro-batches, the same plan on every rank: direction ``g`` holds
    ``counts[g]`` micro-batches, consecutive in the global list, which is padded to a multiple
    of the data-parallel size."""

    directions: list[str]
    pivot: str | None  # None: no pivot language (synthetic data)
    parts: list  # per direction, a one-pass BatchSampler over its sample (None: no sample)
    counts: list[int]  # micro-batches per direction
    dp: int

    @property
    def real(self) -> int:
        """Micro-batches that carry data."""
        return sum(self.counts)

    @property
    def per_rank(self) -> int:
        """Micro-batches each data-parallel replica runs (padding included)."""
        return -(-self.real // self.dp)

    def direction_ids(self, dp_id: int) -> list[int]:
        """The direction of each micro-batch of replica ``dp_id`` (0 for padding: it adds
        nothing)."""
        ids = [g for g, c in enumerate(self.counts) for _ in range(c)]
        lo = dp_id * self.per_rank
        return [ids[j] if j < len(ids) else 0 for j in range(lo, lo + self.per_rank)]

    def collate(self, dp_id: int) -> list[dict]:
        """Replica ``dp_id``'s micro-batches, collated (first and last stages only). Only the
        directions that overlap its share are read."""
        lo, hi = dp_id * self.per_rank, (dp_id + 1) * self.per_rank
        out: list[dict] = []
        start = 0
        for part, count in zip(self.parts, self.counts, strict=True):
            if count and start < hi and start + count > lo:
                for j, batch in enumerate(part, start):
                    if lo <= j < hi:
                        out.append(batch)
            start += count
        if len(out) < self.per_rank:
            out += [self.padding()] * (self.per_rank - len(out))
        return out

    def padding(self) -> dict:
        """A micro-batch without target tokens: the first sentence of the first direction
        that has one, its target all PAD_ID (loss and token count 0)."""
        part = next(p for p, c in zip(self.parts, self.counts, strict=True) if c)
        first = part.data.group_indices(0)[:1]
        batch = dict(part.data.collate(0, first))
        batch["target"] = torch.full_like(batch["target"], PAD_ID)
        batch["ntokens"] = 0
        return batch


def pivot_of(cfg: ExperimentConfig) -> str | None:
    """The pivot language of the data manifest (English when it does not say); None for
    synthetic data."""
    if cfg.data.dataset == "synthetic":
        return None
    from megatron_branchnorm.data import open_manifest

    return str(open_manifest(cfg.data.dataset).get("pivot", "en"))


def build_valid_set(cfg: ExperimentConfig, dp: int) -> ValidSet:
    """The validation plan of ``cfg`` for ``dp`` data-parallel replicas: the first
    data.valid_samples_per_direction usable dev sentences of every direction, each direction
    cut by length into micro-batches of at most data.max_tokens (nothing is collated here)."""
    from megatron_branchnorm.data import BatchSampler

    source = build_batches(cfg, "valid", shuffle=False).data
    if not hasattr(source, "group_indices"):
        source = _SyntheticSource(source)
    k = cfg.data.valid_samples_per_direction
    parts, counts = [], []
    for g in range(len(source.directions)):
        one = _FirstSamples(source, g, k)
        part = None
        if one.indices.size:
            part = BatchSampler(one, cfg.data.max_tokens, 1.0, cfg.train.seed, shuffle=False)
        parts.append(part)
        counts.append(part.batches_per_epoch() if part else 0)
    return ValidSet(list(source.directions), pivot_of(cfg), parts, counts, dp)


def summarize(directions: list[str], pivot: str | None, sums: list[list[float]]) -> dict:
    """The validation row from the reduced (loss sum, NLL sum, tokens) of each direction:
    ``valid_loss`` and ``valid_nll_loss`` (macro averages: each direction's per-token figure
    counts once), ``valid_loss_x_en`` / ``valid_loss_en_x`` (into / out of the pivot, when
    there are such directions), ``valid_loss_by_direction`` and ``valid_tokens``. Directions
    without target tokens are left out; {} when no direction has any."""
    per = {
        name: (loss / tokens, nll / tokens)
        for name, (loss, nll, tokens) in zip(directions, sums, strict=True)
        if tokens > 0
    }
    if not per:
        return {}

    def mean(names: list[str]) -> float:
        return sum(per[n][0] for n in names) / len(names)

    row: dict = {
        "valid_loss": mean(list(per)),
        "valid_nll_loss": sum(v[1] for v in per.values()) / len(per),
    }
    if pivot is not None:
        pairs = {n: n.split("-", 1) for n in per}
        into = [n for n, (s, t) in pairs.items() if t == pivot and s != pivot]
        out_of = [n for n, (s, t) in pairs.items() if s == pivot and t != pivot]
        if into:
            row["valid_loss_x_en"] = mean(into)
        if out_of:
            row["valid_loss_en_x"] = mean(out_of)
    row["valid_loss_by_direction"] = {n: v[0] for n, v in per.items()}
    row["valid_tokens"] = int(sum(s[2] for s in sums))
    return row


class Validator:
    """Owns train.eval_interval, the validation set (planned once, this rank's share collated
    once on the first and last stages) and the early-stopping state."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        engine,
        loss_fn,
        world: int,
        dp: int,
        dp_id: int,
        metrics: MetricsLog,
    ) -> None:
        self.cfg, self.engine, self.loss_fn = cfg, engine, loss_fn
        self.world, self.dp, self.dp_id = world, dp, dp_id
        self.metrics = metrics
        self.valid: ValidSet | None = None
        self.loaded = False
        self.patience = Patience(cfg.train.patience)

    def due(self, step: int) -> bool:
        interval = self.cfg.train.eval_interval
        return bool(interval) and step % interval == 0

    def _load(self) -> None:
        """Plan the validation set (every rank), collate this replica's share (first and last
        stages) and put its direction ids on the device (last stage)."""
        self.loaded = True
        try:
            valid = build_valid_set(self.cfg, self.dp)
        except DataError as exc:  # a dataset without a dev split
            self.metrics.log(f"validation skipped: {exc}")
            return
        empty = [d for d, c in zip(valid.directions, valid.counts, strict=True) if not c]
        if empty:
            self.metrics.log(f"validation: no usable dev sentence in {', '.join(empty)}")
        if not valid.real:
            self.metrics.log("validation skipped: no usable dev sentence")
            return
        self.valid = valid
        self.metrics.log(
            f"validation: {len(valid.directions) - len(empty)} directions, up to "
            f"{self.cfg.data.valid_samples_per_direction or 'all'} sentences each, "
            f"{valid.real} micro-batches ({valid.per_rank} per replica)"
        )
        engine = self.engine
        self.mine = valid.collate(self.dp_id) if self._reads_data() else []
        self.index = None
        if engine.is_last_stage():
            self.index = torch.tensor(
                valid.direction_ids(self.dp_id), dtype=torch.long, device=engine.device
            )

    def _reads_data(self) -> bool:
        return self.engine.is_first_stage() or self.engine.is_last_stage()

    def sums(self) -> torch.Tensor | None:
        """(loss sum, NLL sum, target tokens) per direction, (directions, 3) float64, summed
        over every rank, on the communication device (not yet read); None without a
        validation set."""
        if not self.loaded:
            self._load()
        valid = self.valid
        if valid is None:
            return None
        device = collectives.communication_device()
        items = iter(as_engine_items(self.mine, self.engine.device) if self._reads_data() else ())
        self.loss_fn.scale = 1.0  # what eval_batch returns is not used
        self.loss_fn.start_recording()
        try:
            self.engine.eval_batch(items, num_micro_batches=valid.per_rank)
        finally:
            rows = self.loss_fn.stop_recording()  # (per_rank, 3) on the last stage
        shape = (len(valid.directions), 3)
        if rows is None:  # a stage without the loss
            sums = torch.zeros(shape, dtype=torch.float64, device=device)
        elif rows.shape[0] != valid.per_rank:
            raise RuntimeError(
                f"validation: the loss ran {rows.shape[0]} times for {valid.per_rank} micro-batches"
            )
        else:  # row i is micro-batch i's: add it into its direction's row
            sums = torch.zeros(shape, dtype=torch.float64, device=rows.device)
            sums.index_add_(0, self.index, rows)
        return collectives.all_reduce(sums)

    def evaluate(self) -> dict:
        """The validation row (without ``step``): see :func:`summarize`; {} without a
        validation set."""
        sums = self.sums()
        if sums is None:
            return {}
        return summarize(self.valid.directions, self.valid.pivot, collectives.to_host(sums))

    def loss(self) -> float | None:
        """The all-direction validation loss (macro average); None without a valid split."""
        return self.evaluate().get("valid_loss")

    def run(self, step: int) -> bool:
        """Validate at ``step`` and record it; True when early stopping says stop (the same
        answer on every rank: the losses are reduced over all of them)."""
        row = self.evaluate()
        if not row:
            return False
        self.metrics.write({"step": step, **row})
        groups = [
            f"{name} {row[key]:.4f}"
            for name, key in (("x-en", "valid_loss_x_en"), ("en-x", "valid_loss_en_x"))
            if key in row
        ]
        extra = f" ({', '.join(groups)})" if groups else ""
        n = len(row["valid_loss_by_direction"])
        self.metrics.log(
            f"step {step} | valid loss {row['valid_loss']:.4f}{extra} | "
            f"{n} direction{'s' if n != 1 else ''}"
        )
        return self.patience.update(step, row["valid_loss"])

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
