"""What the trainer reads: the vocabulary's identity, the batch streams, and each update's
micro-batches from one global, seed-determined stream (so the order never depends on
max_steps or on the topology)."""

from __future__ import annotations

import dataclasses
import hashlib
import threading

import numpy as np
import torch

from megatron_branchnorm.config import ConfigError, ExperimentConfig
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


def build_batches(cfg: ExperimentConfig, split: str, shuffle: bool):
    """A batch iterator with state_dict()/load_state_dict() over the configured dataset."""
    d = cfg.data
    if d.dataset == "synthetic":
        from megatron_branchnorm.synthetic import SyntheticBatches, SyntheticData

        size = d.synthetic_size if split == "train" else max(64, d.synthetic_size // 50)
        data = SyntheticData(size, cfg.model.vocab_size, d.max_length, split)
        return SyntheticBatches(data, d.max_tokens, cfg.train.seed, shuffle=shuffle)
    from megatron_branchnorm.data import BatchSampler, TranslationData

    split = {"valid": "dev"}.get(split, split)  # preprocess_data.py names it dev
    data = TranslationData(d.dataset, split=split, max_length=d.max_length)
    return BatchSampler(data, d.max_tokens, d.sampling_temperature, cfg.train.seed, shuffle=shuffle)


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
    """The training batches (docs/design.md §15). Update ``u`` takes global batches
    ``[u*G, (u+1)*G)`` of one seed-determined stream (``G = micro_batches x dp``); data-parallel
    rank ``d`` reads slots ``[d*micro_batches, (d+1)*micro_batches)`` of each update.

    Only ranks that read data (the first and last pipeline stages) build epoch plans, and a
    plan holds the size of every batch (the update's token count normalises the loss) but the
    samples of this rank's batches only; the next epoch is built ahead on a thread. Other
    stages build nothing: their updates are empty, and the checkpoint takes rank 0's position.
    """

    def __init__(self, cfg: ExperimentConfig, dp: int, dp_id: int, reads_data: bool = True) -> None:
        self.micro_batches, self.dp, self.dp_id = cfg.train.micro_batches, dp, dp_id
        self.per_update = self.micro_batches * dp
        self.reads_data = reads_data
        self.source = build_batches(cfg, "train", shuffle=True) if reads_data else None
        self.epoch, self.position = 0, 0
        self._slot0 = 0  # the update slot of the current epoch's position 0
        self._plan = None
        self._ahead: _Ahead | None = None
        self._loaded: dict = {"epoch": 0, "position": 0}  # what a non-reading rank holds

    # --- plans -----------------------------------------------------------------------------

    def _build(self, epoch: int, slot0: int):
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

    def next_update(self) -> Update:
        if not self.reads_data:
            return Update(mine=[], target_tokens=0, all_tokens=0, samples=0, ids_hash="")
        mine, ntokens, src_ntokens, samples, prints = [], 0, 0, 0, []
        for _ in range(self.per_update):
            plan, p = self._current(), self.position
            ntokens += int(plan.ntokens[p])
            src_ntokens += int(plan.src_ntokens[p])
            samples += int(plan.samples[p])
            prints.append(plan.fingerprints[p])
            if p in plan.mine:
                mine.append(self.source.collate(*plan.mine[p]))
            self.position += 1
        if len(mine) != self.micro_batches:
            raise RuntimeError(f"rank read {len(mine)} micro-batches, not {self.micro_batches}")
        digest = hashlib.sha256(np.asarray(prints, dtype="<u8").tobytes()).hexdigest()[:16]
        return Update(mine, ntokens, ntokens + src_ntokens, samples, digest)

    def direction_counts(self) -> tuple[list[str], list[int]] | None:
        """The training directions and the samples each holds (after data.max_length); None
        for synthetic data or a rank that reads no data."""
        counts = getattr(self.source, "counts", None)
        if counts is None:
            return None
        return list(self.source.data.directions), [int(c) for c in counts]

    def describe(self) -> str:
        """What this rank builds of the stream (one line, printed by every rank at start)."""
        if not self.reads_data:
            return "data: this stage reads no batches and builds none"
        plan = self._current()
        return (
            f"data: epoch {plan.epoch} holds {len(plan)} batches, this rank reads "
            f"{len(plan.mine)} (data-parallel rank {self.dp_id} of {self.dp}, "
            f"{self.micro_batches} micro-batches per update)"
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
        if not self.reads_data:
            return
        self.source.check_state(state)
        epoch, position = int(state["epoch"]), int(state["position"])
        self.epoch, self.position, self._slot0 = epoch, position, -position % self.per_update
        self._plan, self._ahead = None, None
        if epoch >= 0 and position >= 0:
            self._plan = self._build(epoch, self._slot0)
        if self._plan is None or position > len(self._plan):
            raise DataError(f"sampler state epoch={epoch} position={position} is out of range")


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
