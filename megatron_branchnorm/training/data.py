"""What the trainer reads: the vocabulary's identity, the batch streams, and each update's
micro-batches from one global, seed-determined stream (so the order never depends on
max_steps or on the topology)."""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections.abc import Callable

import numpy as np
import torch

from megatron_branchnorm.config import ConfigError, ExperimentConfig
from megatron_branchnorm.data.buckets import LengthHistogram, choose_buckets, max_shapes_of
from megatron_branchnorm.data.dataset import bucket_identity, check_bucket_state
from megatron_branchnorm.data.synthetic import SyntheticBatches
from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.formats.data_dir import DataError, read_data_manifest
from megatron_branchnorm.tokens import PAD_ID


def resolve_vocab(cfg: ExperimentConfig) -> ExperimentConfig:
    """model.vocab_size from the data manifest when unset; a mismatch is an error."""
    if cfg.data.dataset == "synthetic":
        if cfg.model.vocab_size is None:
            raise ConfigError("config key model.vocab_size: required with data.dataset=synthetic")
        return cfg
    from megatron_branchnorm.data import open_manifest

    manifest = open_manifest(cfg.data.dataset)
    vocab = int(manifest["vocab_size"])
    if cfg.model.vocab_size is not None and cfg.model.vocab_size != vocab:
        raise ConfigError(
            f"config key model.vocab_size: {cfg.model.vocab_size} differs from the data "
            f"manifest's vocab_size={vocab} ({cfg.data.dataset}/manifest.json)"
        )
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab))


def vocab_identity(cfg: ExperimentConfig) -> tuple[dict | None, str | None]:
    """(``{"spm_sha256", "vocab_size", "path"}`` of the run's SentencePiece model, sha256 of
    the data manifest); (None, None) for synthetic data. The model must be a plain file name
    inside DATA_DIR (a manifest cannot point at any file of the machine)."""
    if cfg.data.dataset == "synthetic":
        return None, None
    manifest = read_data_manifest(cfg.data.dataset)
    if manifest.vocab_size is None:
        raise DataError(f"{manifest.path}: key vocab_size: missing")
    path = manifest.spm_path
    vocab = {
        "spm_sha256": ckpt.sha256_file(path),
        "vocab_size": manifest.vocab_size,
        "path": str(path),
    }
    return vocab, manifest.sha256


def build_batches(cfg: ExperimentConfig, split: str, shuffle: bool, keep_keys: bool = True):
    """A batch iterator with state_dict()/load_state_dict() over the configured dataset; the
    shuffled training stream is cut into ``data.bucket_shapes`` (data/buckets.py).
    ``keep_keys=False``: no per-sample array is kept (a stage that follows the shapes only)."""
    d = cfg.data
    max_shapes = max_shapes_of(d.bucket_shapes) if split == "train" and shuffle else 0
    if d.dataset == "synthetic":
        from megatron_branchnorm.data.synthetic import SyntheticBatches, SyntheticData

        size = d.synthetic_size if split == "train" else max(64, d.synthetic_size // 50)
        data = SyntheticData(size, cfg.model.vocab_size, d.max_length, split)
        if max_shapes:
            return BucketedSyntheticBatches(data, d.max_tokens, cfg.train.seed, max_shapes)
        return SyntheticBatches(data, d.max_tokens, cfg.train.seed, shuffle=shuffle)
    from megatron_branchnorm.data import BatchSampler, TranslationData

    split = {"valid": "dev"}.get(split, split)  # preprocess_data.py names it dev
    data = TranslationData(d.dataset, split=split, max_length=d.max_length)
    return BatchSampler(
        data,
        d.max_tokens,
        d.sampling_temperature,
        cfg.train.seed,
        shuffle=shuffle,
        max_shapes=max_shapes,
        keep_keys=keep_keys,
    )


class BucketedSyntheticBatches(SyntheticBatches):
    """The synthetic task's shuffled stream cut into bucket shapes (data/buckets.py): epoch
    e's samples, in the order of the seeded permutation of (seed, e), grouped by bucket and
    cut into each shape's rows, the batches shuffled by (seed, e, 1)."""

    def __init__(self, data, max_tokens: int, seed: int, max_shapes: int) -> None:
        super().__init__(data, max_tokens, seed, shuffle=True)
        src_len, tgt_len = data.lengths_raw + 2, data.lengths_raw + 1  # task/EOS, EOS
        hist = LengthHistogram()
        hist.add(src_len, tgt_len, len(data), len(data))
        self.buckets = choose_buckets(hist, max_tokens, max_shapes)
        self._bucket = self.buckets.bucket_of(src_len, tgt_len)

    def _bucketed(self, epoch: int) -> tuple[list[list[int]], np.ndarray]:
        """Epoch ``epoch``'s batches in stream order and the bucket of each."""
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.data))
        keys = self._bucket[order]
        order = order[np.argsort(keys, kind="stable")]
        ranges, final = self.buckets.arrange(np.bincount(keys, minlength=len(self.buckets)))
        order = np.concatenate([order[a:b] for runs in ranges for a, b in runs])
        ends, buckets = self.buckets.batch_ends(final)
        batches = np.split(order, ends[:-1])
        perm = np.random.default_rng([self.seed, epoch, 1]).permutation(len(batches))
        return [batches[k].tolist() for k in perm], buckets[perm]

    def _make_plan(self, epoch: int) -> list[list[int]]:
        return self._bucketed(epoch)[0]

    def epoch_plan(self, epoch: int, keep):
        """As :meth:`SyntheticBatches.epoch_plan`, with the bucket of every batch."""
        plan = super().epoch_plan(epoch, keep)
        plan.shapes = self._bucketed(epoch)[1]
        return plan

    def epoch_shapes(self, epoch: int):
        """The bucket of every batch of ``epoch`` (as :meth:`BatchSampler.epoch_shapes`)."""
        from megatron_branchnorm.data.dataset import EpochPlan

        return EpochPlan(epoch, None, None, None, None, {}, shapes=self._bucketed(epoch)[1])

    def identity(self) -> dict:
        """The bucket shapes a saved position is only valid with."""
        return {"bucket_shapes": bucket_identity(self.buckets)}

    def check_state(self, state: dict) -> None:
        """A DataError when ``state`` was saved with other bucket shapes."""
        check_bucket_state(state, bucket_identity(self.buckets))


def source_tokens(batch: dict) -> int:
    if "src_ntokens" in batch:
        return int(batch["src_ntokens"])
    return int((batch["src_tokens"] != PAD_ID).sum())


@dataclasses.dataclass
class Update:
    """This rank's micro-batches of one update, with what the whole update holds."""

    mine: list[dict]
    target_tokens: int  # over all data-parallel ranks: the loss is normalised by it
    all_tokens: int  # source + target, for tokens/s
    samples: int  # sentence pairs
    ids_hash: str  # sha256 prefix of the batches' id fingerprints: the order is checkable
    shapes: list[int] | None = None  # the bucket of each of this replica's micro-batches


STOP_CHECK_DRAWS = 1024
"""An update that draws more micro-batches than this asks whether a stop signal reached any
rank after every this many draws (``stop_requested``, a collective: every rank asks at the
same draws, a rank that draws nothing too), so that a stop signal ends a long drawing instead
of waiting for the update. Updates of up to this many micro-batches never ask."""


class _Ahead:
    """One epoch plan built on a daemon thread while the current epoch trains (numpy's sorts
    and permutations release the GIL); a process that exits never waits for it."""

    def __init__(self, key: tuple[int, int], build) -> None:
        self.key = key
        self._build, self._result, self._error = build, None, None
        self._thread = threading.Thread(target=self._run, name=f"plan-epoch-{key[0]}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._build()
        except BaseException as exc:  # noqa: BLE001 - re-raised by get() on the main thread
            self._error = exc

    def get(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


class TrainStream:
    """The training batches (docs/design.md §15, §18). Update ``u`` takes global batches
    ``[u*G, (u+1)*G)`` of one seed-determined stream (``G = micro_batches x dp``); data-parallel
    rank ``d`` reads slots ``[d*micro_batches, (d+1)*micro_batches)`` of each update.

    Only ranks that read data (the first and last pipeline stages) build epoch plans with
    samples, and a plan holds the size of every batch (the update's token count normalises the
    loss) but the samples of this rank's batches only; the next epoch is built ahead on a
    thread. With bucket shapes (``data.bucket_shapes``), every batch a rank reads is padded to
    its bucket's shape, and every rank, reading data or not, knows the bucket of each of its
    replica's micro-batches (``Update.shapes``): a stage that reads no data builds the plan of
    the shapes alone (:meth:`BatchSampler.epoch_shapes`), so the pipeline can send fixed shapes
    without asking the stage before. Without buckets such a stage builds nothing: its updates
    are empty. The checkpoint takes rank 0's position either way.
    """

    def __init__(
        self,
        cfg: ExperimentConfig,
        dp: int,
        dp_id: int,
        reads_data: bool = True,
        stop_requested: Callable[[], bool] | None = None,
    ) -> None:
        self.micro_batches, self.dp, self.dp_id = cfg.train.micro_batches, dp, dp_id
        self.per_update = self.micro_batches * dp
        self.reads_data = reads_data
        self.stop_requested = stop_requested  # see STOP_CHECK_DRAWS; None: never asked
        self._batch_key = (
            "pipeline.data_parallel" if cfg.pipeline.data_parallel else "train.micro_batches"
        )
        follows = reads_data or max_shapes_of(cfg.data.bucket_shapes) > 0
        self.source = (
            build_batches(cfg, "train", shuffle=True, keep_keys=reads_data) if follows else None
        )
        self.buckets = getattr(self.source, "buckets", None)
        self.epoch, self.position = 0, 0
        self._slot0 = 0  # the update slot of the current epoch's position 0
        self._plan = None
        self._ahead: _Ahead | None = None
        self._loaded: dict = {"epoch": 0, "position": 0}  # what a non-reading rank holds

    # --- plans -----------------------------------------------------------------------------

    def _build(self, epoch: int, slot0: int):
        if not self.reads_data:
            return self.source.epoch_shapes(epoch)
        g, gas, d = self.per_update, self.micro_batches, self.dp_id
        return self.source.epoch_plan(epoch, lambda pos: ((pos + slot0) % g) // gas == d)

    def _current(self):
        """The plan of the current epoch (from the thread when it was built ahead), and the
        next epoch's started on the thread."""
        while True:
            if self._plan is None or self._plan.epoch != self.epoch:
                key = (self.epoch, self._slot0)
                ahead, self._ahead = self._ahead, None
                self._plan = ahead.get() if ahead is not None and ahead.key == key else None
                if self._plan is None:
                    self._plan = self._build(*key)
            if self.position < len(self._plan):
                break
            self._next_epoch()
        if self._ahead is None:
            nxt = (self.epoch + 1, (self._slot0 + len(self._plan)) % self.per_update)
            self._ahead = _Ahead(nxt, lambda: self._build(*nxt))
        return self._plan

    def _next_epoch(self) -> None:
        self._slot0 = (self._slot0 + len(self._plan)) % self.per_update
        self.epoch, self.position = self.epoch + 1, 0

    # --- updates ---------------------------------------------------------------------------

    def _stopped(self, draws: int) -> bool:
        """Whether the drawing ends here, after ``draws`` of the update's micro-batches: at
        every :data:`STOP_CHECK_DRAWS`-th draw short of the last, ``stop_requested``."""
        return (
            self.stop_requested is not None
            and 0 < draws < self.per_update
            and draws % STOP_CHECK_DRAWS == 0
            and self.stop_requested()
        )

    def next_update(self) -> Update | None:
        """This rank's share of the next update; None when a stop signal ended its drawing
        (:data:`STOP_CHECK_DRAWS`): the stream is back at the update's first batch, as a
        checkpoint between updates saves it."""
        if self.source is None:
            for draws in range(STOP_CHECK_DRAWS, self.per_update, STOP_CHECK_DRAWS):
                if self._stopped(draws):
                    return None
            return Update(mine=[], target_tokens=0, all_tokens=0, samples=0, ids_hash="")
        start = (self.epoch, self.position, self._slot0)
        mine, shapes, ntokens, src_ntokens, samples, prints = [], [], 0, 0, 0, []
        for draws in range(self.per_update):
            if self._stopped(draws):
                self.epoch, self.position, self._slot0 = start
                return None
            plan, p = self._current(), self.position
            ours = ((p + self._slot0) % self.per_update) // self.micro_batches == self.dp_id
            if plan.shapes is not None and ours:
                shapes.append(int(plan.shapes[p]))
            if self.reads_data:
                ntokens += int(plan.ntokens[p])
                src_ntokens += int(plan.src_ntokens[p])
                samples += int(plan.samples[p])
                prints.append(plan.fingerprints[p])
                if (p in plan.mine) != ours:
                    raise RuntimeError(f"stream position {p}: the plan and the slot disagree")
                if ours:
                    batch = self.source.collate(*plan.mine[p])
                    mine.append(
                        batch if self.buckets is None else self.buckets.pad(batch, shapes[-1])
                    )
            self.position += 1
        if self.buckets is not None and len(shapes) != self.micro_batches:
            raise RuntimeError(f"rank has {len(shapes)} shapes, not {self.micro_batches}")
        if not self.reads_data:
            return Update([], 0, 0, 0, "", shapes=shapes)
        if len(mine) != self.micro_batches:
            raise RuntimeError(f"rank read {len(mine)} micro-batches, not {self.micro_batches}")
        digest = hashlib.sha256(np.asarray(prints, dtype="<u8").tobytes()).hexdigest()[:16]
        return Update(
            mine,
            ntokens,
            ntokens + src_ntokens,
            samples,
            digest,
            shapes=shapes if self.buckets is not None else None,
        )

    def update_too_large(self) -> str | None:
        """One line naming the key when an update takes more micro-batches than the current
        epoch holds batches (an update would read the same data more than once, and a count
        such as 2**32 would never end); None when it fits, or on a rank that builds no plan."""
        if self.source is None:
            return None
        batches = len(self._current())
        if self.per_update <= batches:
            return None
        return (
            f"config key {self._batch_key}: an update takes {self.per_update:,} micro-batches "
            f"({self.micro_batches:,} on each of {self.dp:,} data-parallel replicas), more than "
            f"the {batches:,} batches one epoch of the training data holds; lower "
            "train.micro_batches or pipeline.data_parallel (which fix the micro-batches per "
            "update), or train on more data"
        )

    def direction_counts(self) -> tuple[list[str], list[int]] | None:
        """The training directions and the samples each holds (after data.max_length); None
        for synthetic data or a rank that reads no data."""
        counts = getattr(self.source, "counts", None)
        if counts is None or not self.reads_data:
            return None
        return list(self.source.data.directions), [int(c) for c in counts]

    def describe(self) -> str:
        """What this rank builds of the stream (one line, printed by every rank at start)."""
        if self.source is None:
            return "data: this stage reads no batches and builds none"
        plan = self._current()
        if not self.reads_data:
            return (
                f"data: this stage reads no batches; it follows the bucket of each of epoch "
                f"{plan.epoch}'s {len(plan)} batches (data-parallel rank {self.dp_id} of {self.dp})"
            )
        return (
            f"data: epoch {plan.epoch} holds {len(plan)} batches, this rank reads "
            f"{len(plan.mine)} (data-parallel rank {self.dp_id} of {self.dp}, "
            f"{self.micro_batches} micro-batches per update)"
        )

    def shape_identity(self) -> dict:
        """What fixes the shape of each micro-batch this rank sends or receives: the bucket
        shapes (count and :meth:`Buckets.digest`), and the stream's order of them from here
        (position, micro-batches per update, and a digest of the current epoch's bucket of
        every batch). Every rank of the job must hold the same (:func:`shape_disagreement`);
        ``{"shapes": 0}`` without bucket shapes (the shapes travel with each micro-batch)."""
        if self.buckets is None:
            return {"shapes": 0}
        plan = self._current()
        order = hashlib.sha256(np.ascontiguousarray(plan.shapes, dtype=np.uint8).tobytes())
        return {
            "shapes": len(self.buckets),
            "digest": self.buckets.digest(),
            "epoch": self.epoch,
            "position": self.position,
            "slot": self._slot0,
            "per_update": self.per_update,
            "batches": len(plan),
            "order": order.hexdigest()[:12],
        }

    def describe_buckets(self) -> str | None:
        """The bucket shapes and the padding share of the current epoch's batches, measured
        (source + target slots against real tokens); None without buckets or on a rank that
        reads no data."""
        if self.buckets is None or not self.reads_data:
            return None
        plan = self._current()
        real = int(plan.ntokens.sum()) + int(plan.src_ntokens.sum())
        share = self.buckets.padding_share(plan.shapes, real)
        return (
            f"{self.buckets.describe()}; padding {share:.1%} of the tokens of epoch "
            f"{plan.epoch}'s {len(plan)} batches ({self.buckets.length_padding:.1%} from the "
            "lengths alone)"
        )

    # --- resume ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Position of the next batch of the stream (epoch, batch in the epoch), with the
        sampler's identity; a rank that reads no data returns what it loaded (the checkpoint
        saves rank 0's)."""
        if not self.reads_data:
            return dict(self._loaded)
        return {"epoch": self.epoch, "position": self.position, **self.source.identity()}

    def load_state_dict(self, state: dict) -> None:
        """Continue with the batch after the last one of ``state``'s update (checkpoints are
        taken between updates, so that batch starts an update whatever the data-parallel
        size now)."""
        self._loaded = dict(state)
        if self.source is None:
            return
        self.source.check_state(state)
        epoch, position = int(state["epoch"]), int(state["position"])
        self.epoch, self.position, self._slot0 = epoch, position, -position % self.per_update
        self._plan, self._ahead = None, None
        if epoch >= 0 and position >= 0:
            self._plan = self._build(epoch, self._slot0)
        if self._plan is None or position > len(self._plan):
            raise DataError(f"sampler state epoch={epoch} position={position} is out of range")


def _describe_shapes(identity: dict, stream: bool) -> str:
    """What :meth:`TrainStream.shape_identity` says: the bucket shapes, or with ``stream``
    the order of them."""
    if not identity.get("shapes"):
        return "no bucket shapes (data.bucket_shapes=0: shapes sent with each micro-batch)"
    if not stream:
        return f"{identity['shapes']} bucket shapes with digest {identity['digest']}"
    return (
        f"epoch {identity['epoch']}'s order of {identity['batches']:,} batch shapes with "
        f"digest {identity['order']}, at position {identity['position']} (update slot "
        f"{identity['slot']}, {identity['per_update']:,} micro-batches per update)"
    )


def _ranks_named(members: list[tuple[int, int]], most: int = 8) -> str:
    """``rank 3 (stage 1)``, ``ranks 1, 3 (stages 1, 1)``: the first ``most`` of
    ``members`` (rank, stage)."""
    if len(members) == 1:
        return f"rank {members[0][0]} (stage {members[0][1]})"
    shown = members[:most]
    more = f" and {len(members) - most} more" if len(members) > most else ""
    ranks = ", ".join(str(r) for r, _ in shown)
    stages = ", ".join(str(s) for _, s in shown)
    return f"ranks {ranks}{more} (stages {stages})"


def shape_disagreement(gathered: list[tuple[int, dict]]) -> str | None:
    """One line naming the ranks that derived other bucket shapes, or another order of them,
    than rank 0 (``gathered``: each rank's (stage, :meth:`TrainStream.shape_identity`), in
    rank order); None when every rank agrees.

    The pipeline sends each bucket's shapes once and fixed-shape tensors after that
    (docs/design.md §18): stages that derived different shapes would exchange messages of
    different sizes, which gloo refuses but NCCL does not check (a hang, or garbage read)."""
    ref = gathered[0][1]
    groups: dict[str, list[tuple[int, int]]] = {}
    compared: set[bool] = set()  # False: the shapes differ, True: only their order
    for rank, (stage, identity) in enumerate(gathered):
        if identity == ref:
            continue
        same_shapes = all(identity.get(k) == ref.get(k) for k in ("shapes", "digest"))
        compared.add(same_shapes)
        groups.setdefault(_describe_shapes(identity, same_shapes), []).append((rank, stage))
    if not groups:
        return None
    named = "; ".join(f"{_ranks_named(members)} derived {what}" for what, members in groups.items())
    mine = " and ".join(_describe_shapes(ref, stream) for stream in sorted(compared))
    return (
        "the ranks disagree on the shapes of the training micro-batches, which the pipeline "
        f"sends without their sizes (data.bucket_shapes): {named}, where "
        f"{_ranks_named([(0, gathered[0][0])])} derived {mine}; every rank must read the same "
        "data, config and checkpoint with the same version of megatron_branchnorm"
    )


def to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """``tensor`` on ``device``; to a GPU through pinned memory without blocking the host (a
    copy from pageable memory waits for the GPU to take it)."""
    device = torch.device(device)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def as_engine_items(batches: list[dict], device):
    """The (inputs, labels) pairs DeepSpeed's pipeline engine takes, on ``device`` (made only
    when the engine asks: only the first and last stages load micro-batches)."""
    for b in batches:
        yield (
            (to_device(b["src_tokens"], device), to_device(b["prev_output_tokens"], device)),
            to_device(b["target"], device),
        )
