"""What the trainer reads: the vocabulary's identity, the batch streams, and each update's
micro-batches from one global, seed-determined stream (so the order never depends on
max_steps or on the topology)."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import torch

from megatron_branchnorm import checkpoint as ckpt
from megatron_branchnorm.config import ConfigError, ExperimentConfig
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
    from megatron_branchnorm.data import open_manifest

    data_dir = Path(cfg.data.dataset)
    manifest = open_manifest(data_dir)
    name = manifest["spm_model"]
    if Path(name).name != name or name in ("", ".", ".."):
        raise ConfigError(
            f"{data_dir / 'manifest.json'}: key spm_model must be a file name inside the data "
            f"directory, got {name!r}"
        )
    path = data_dir / name
    vocab = {
        "spm_sha256": ckpt.sha256_file(path),
        "vocab_size": int(manifest["vocab_size"]),
        "path": str(path),
    }
    return vocab, ckpt.sha256_file(data_dir / "manifest.json")


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
    ids_hash: str  # sha256 prefix of the example ids ("" without ids): the order is checkable


class TrainStream:
    """The training batches: each update takes ``micro_batches x dp`` consecutive batches of
    the global stream and keeps this rank's data-parallel share."""

    def __init__(self, cfg: ExperimentConfig, dp: int, dp_id: int) -> None:
        self.batches = build_batches(cfg, "train", shuffle=True)
        self.iterator = iter(self.batches)
        self.micro_batches, self.dp, self.dp_id = cfg.train.micro_batches, dp, dp_id

    def next_update(self) -> Update:
        gas = self.micro_batches
        batches = [next(self.iterator) for _ in range(gas * self.dp)]
        ntokens = sum(int(b["ntokens"]) for b in batches)
        ids = torch.cat([b["ids"].reshape(-1).long() for b in batches if "ids" in b] or [])
        return Update(
            mine=batches[self.dp_id * gas : (self.dp_id + 1) * gas],
            target_tokens=ntokens,
            all_tokens=ntokens + sum(source_tokens(b) for b in batches),
            samples=sum(int(b["src_tokens"].shape[0]) for b in batches),
            ids_hash=hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:16] if len(ids) else "",
        )

    def state_dict(self) -> dict:
        return self.batches.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.batches.load_state_dict(state)
        self.iterator = iter(self.batches)


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
