"""``train_config.json``, our client state in every checkpoint tag, its one owner: the file's
schema (:class:`TrainConfigRecord`, with :class:`VocabRecord`), its writer and readers, and
what a reader derives from a record: the saved ``spec_names``, data-parallel size and micro
batches (docs/design.md §6.2, §17).

Outside formats/ the file is read with :func:`read_train_record` and written with
``write_train_config(tag_dir, record)``; :func:`read_train_config` is the raw JSON object under
it. The names of a tag's files and :class:`~megatron_branchnorm.formats.checkpoint.CheckpointError`
are formats/checkpoint.py's; reading a checkpoint's weights, which hands this record with them,
is formats/checkpoint_state.py's.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from megatron_branchnorm.formats.checkpoint import TRAIN_CONFIG, CheckpointError
from megatron_branchnorm.formats.files import quote, read_json_object

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")

REQUIRED_KEYS = ("step", "samples", "sampler", "spec_names", "parts", "config")
"""Keys every checkpoint of this trainer has (it always wrote them): checked when present,
None in the record when absent; :meth:`TrainConfigRecord.need` names the file and key when a
reader needs one that is missing."""
OPTIONAL_KEYS = ("data_manifest_sha256", "precision", "data_parallel")
"""Keys added after the first checkpoints (read with ``.get`` before the record): absent and
null are both None, which each reader takes as "not recorded"."""


@dataclass(frozen=True)
class VocabRecord:
    """``train_config.json``'s ``vocab`` object: the training SentencePiece model's sha256 (the
    tag's ``spm.model`` copy is checked against it) and its vocabulary size."""

    spm_sha256: str
    vocab_size: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Keys this code does not know, kept as they were (written back by :meth:`to_json`)."""

    def to_json(self) -> dict[str, Any]:
        return {**self.extra, "spm_sha256": self.spm_sha256, "vocab_size": self.vocab_size}


@dataclass(frozen=True)
class TrainConfigRecord:
    """What a tag's ``train_config.json`` says, checked (docs/design.md §6, §17).

    Every key the trainer writes is a field; a key absent from an older checkpoint reads as
    None (:data:`REQUIRED_KEYS`, :data:`OPTIONAL_KEYS`), ``vocab`` as ``vocab_recorded=False``
    and ``repartitioned`` as False, exactly the defaults of the readers before this record.
    Keys this code does not know are kept in :attr:`extra` and written back, as the
    checkpoint converter's rewrite always did. ``config`` and ``sampler`` are the JSON
    objects as read (the config's own schema is config.py's): copy before changing them."""

    step: int | None = None
    """The number of updates applied."""
    samples: int | None = None
    """Samples trained on so far."""
    sampler: dict[str, Any] | None = None
    """The data stream's position (training/data.py ``TrainStream.state_dict``)."""
    spec_names: dict[int, str] | None = None
    """Layer-list index -> flat-model module name (docs/design.md §1)."""
    parts: tuple[int, ...] | None = None
    """The stage plan: ascending layer-list boundaries, one more than the stages."""
    config: dict[str, Any] | None = None
    """The resolved config (``ExperimentConfig.to_dict``): sections of keys."""
    vocab: VocabRecord | None = None
    """The training vocabulary; None: synthetic data (or not recorded, below)."""
    vocab_recorded: bool = True
    """False for a checkpoint from before vocabularies were recorded (no ``vocab`` key)."""
    data_manifest_sha256: str | None = None
    """sha256 of the DATA_DIR's manifest.json trained on; None: synthetic data, or older."""
    precision: str | None = None
    """``training/ds_config.precision_of``: precision and ZeRO stage; None: older."""
    data_parallel: int | None = None
    """Data-parallel size at the save; None: older (see :func:`saved_data_parallel`)."""
    repartitioned: bool = False
    """Re-laid by ``convert_checkpoint.py --repartition`` (its optimizer state stayed behind)."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Keys this code does not know, kept as they were (written back by :meth:`to_json`)."""
    where: Path | None = field(default=None, compare=False)
    """The file (or the copy of it) the record was read from: errors name it."""

    @property
    def path(self) -> Path:
        return self.where if self.where is not None else Path(TRAIN_CONFIG)

    def need(self, key: str) -> Any:
        """The value of required key ``key`` (:data:`REQUIRED_KEYS`); CheckpointError naming
        the file and key when the checkpoint does not have it."""
        if key not in REQUIRED_KEYS:
            raise ValueError(f"{key} is not a required key of {TRAIN_CONFIG}")
        value = getattr(self, key)
        if value is None:
            what = "is missing or malformed" if key == "spec_names" else "is missing"
            raise CheckpointError(f"{self.path}: key {key} {what}")
        return value

    def config_value(self, key: str) -> Any:
        """``config.<section>.<name>`` for ``key`` ``"section.name"``; None when the config,
        the section or the name is absent."""
        section, _, name = key.partition(".")
        values = (self.config or {}).get(section)
        return values.get(name) if isinstance(values, Mapping) else None

    def to_json(self) -> dict[str, Any]:
        """The JSON object of ``train_config.json`` (also the client state DeepSpeed keeps in
        each engine file): the trainer's keys as it has always written them, then the rest."""
        out: dict[str, Any] = dict(self.extra)
        for key in REQUIRED_KEYS:  # absent in the record: absent in the file
            value = getattr(self, key)
            if value is not None:
                out[key] = list(value) if key == "parts" else value
        if self.vocab_recorded:
            out["vocab"] = None if self.vocab is None else self.vocab.to_json()
        for key in OPTIONAL_KEYS:
            out[key] = getattr(self, key)
        if self.repartitioned:
            out["repartitioned"] = True
        return out

    @classmethod
    def from_json(
        cls, data: Mapping[str, Any] | str | Path, where: Path | None = None
    ) -> TrainConfigRecord:
        """The record of a ``train_config.json`` file (a path) or of its JSON object (a
        mapping: ``where`` is the file it came from, named in errors). CheckpointError in one
        line naming the file and the key when a value is malformed."""
        if isinstance(data, (str, Path)):
            where = Path(data) if where is None else where
            data = read_json_object(Path(data), CheckpointError)
        where = Path(where) if where is not None else Path(TRAIN_CONFIG)

        def check(key: str, ok: bool, what: str, value: object) -> None:
            if not ok:
                raise CheckpointError(f"{where}: key {key} must be {what}, got {quote(value)}")

        def count(value: object, low: int = 0) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and value >= low

        fields: dict[str, Any] = {}
        if "step" in data:
            check("step", count(data["step"]), "a non-negative integer", data["step"])
            fields["step"] = data["step"]
        if "samples" in data:
            check("samples", count(data["samples"]), "a non-negative integer", data["samples"])
            fields["samples"] = data["samples"]
        if "sampler" in data:
            check("sampler", isinstance(data["sampler"], Mapping), "an object", data["sampler"])
            fields["sampler"] = data["sampler"]
        if "spec_names" in data:
            fields["spec_names"] = _parse_spec_names(data["spec_names"], where)
        if "parts" in data:
            parts = data["parts"]
            ok = (
                isinstance(parts, (list, tuple))
                and len(parts) >= 2
                and all(count(p) for p in parts)
                and list(parts) == sorted(parts)
            )
            check("parts", ok, "a list of at least two ascending layer indices", parts)
            fields["parts"] = tuple(parts)
        if "config" in data:
            config = data["config"]
            check("config", isinstance(config, Mapping), "an object", config)
            for name, values in config.items():
                check(f"config.{name}", isinstance(values, Mapping), "an object", values)
            fields["config"] = config
        fields["vocab_recorded"] = "vocab" in data
        if data.get("vocab") is not None:
            fields["vocab"] = _parse_vocab(data["vocab"], where)
        sha = data.get("data_manifest_sha256")
        ok = sha is None or (isinstance(sha, str) and _SHA256_HEX.fullmatch(sha) is not None)
        check("data_manifest_sha256", ok, "null or 64 hex digits", sha)
        fields["data_manifest_sha256"] = sha
        precision = data.get("precision")
        check("precision", precision is None or isinstance(precision, str), "text", precision)
        fields["precision"] = precision
        dp = data.get("data_parallel")
        check("data_parallel", dp is None or count(dp, 1), "a positive integer", dp)
        fields["data_parallel"] = dp
        relaid = data.get("repartitioned")
        check("repartitioned", relaid is None or isinstance(relaid, bool), "true or false", relaid)
        fields["repartitioned"] = bool(relaid)
        known = {*REQUIRED_KEYS, *OPTIONAL_KEYS, "vocab", "repartitioned"}
        extra = {k: v for k, v in data.items() if k not in known}
        return cls(**fields, extra=MappingProxyType(extra), where=where)


def _parse_spec_names(value: object, where: Path) -> dict[int, str]:
    """``spec_names`` ({"0": "embedding", ...}) by int index; CheckpointError when malformed."""
    try:
        return {int(k): str(v) for k, v in value.items()}  # type: ignore[attr-defined]
    except (AttributeError, TypeError, ValueError):
        raise CheckpointError(f"{where}: key spec_names is missing or malformed") from None


def _parse_vocab(value: object, where: Path) -> VocabRecord:
    """A non-null ``vocab`` object; CheckpointError naming the file and key otherwise."""
    sha = value.get("spm_sha256") if isinstance(value, Mapping) else None
    if not isinstance(sha, str) or _SHA256_HEX.fullmatch(sha) is None:
        raise CheckpointError(
            f"{where}: key vocab must be null or hold spm_sha256 (64 hex digits), got "
            f"{quote(value)}"
        )
    size = value.get("vocab_size")
    is_count = isinstance(size, int) and not isinstance(size, bool) and size >= 1
    if size is not None and not is_count:
        raise CheckpointError(
            f"{where}: key vocab.vocab_size must be a positive integer, got {quote(size)}"
        )
    extra = {k: v for k, v in value.items() if k not in ("spm_sha256", "vocab_size")}
    return VocabRecord(sha, size, MappingProxyType(extra))


def write_train_config(tag_dir: Path, info: TrainConfigRecord | Mapping[str, Any]) -> None:
    """The tag's ``train_config.json`` (rank 0, before the checksums are written): a record's
    :meth:`~TrainConfigRecord.to_json`, or a JSON object as it is."""
    if isinstance(info, TrainConfigRecord):
        info = info.to_json()
    path = Path(tag_dir) / TRAIN_CONFIG
    tmp = path.parent / f".{TRAIN_CONFIG}.tmp"
    tmp.write_text(json.dumps(info, indent=1, sort_keys=True, default=str), encoding="utf-8")
    os.replace(tmp, path)


def read_train_config(tag_dir: Path) -> dict:
    """A tag's ``train_config.json`` as a raw JSON object (the record's input: read it with
    :func:`read_train_record`); CheckpointError naming the file when it is missing,
    unreadable, not JSON or not an object."""
    return read_json_object(Path(tag_dir) / TRAIN_CONFIG, CheckpointError)


def read_train_record(tag_dir: Path) -> TrainConfigRecord:
    """A tag's ``train_config.json``, checked (:meth:`TrainConfigRecord.from_json`)."""
    return TrainConfigRecord.from_json(Path(tag_dir) / TRAIN_CONFIG)


def saved_spec_names(tag_dir: Path, info: TrainConfigRecord | Mapping[str, Any]) -> dict[int, str]:
    """The saved ``spec_names`` (layer-list index -> flat-model module name) of a tag's
    ``train_config.json`` (its record, or its raw JSON object); CheckpointError naming the file
    and key when missing or malformed."""
    if isinstance(info, TrainConfigRecord):
        return info.need("spec_names")
    where = Path(tag_dir) / TRAIN_CONFIG
    if not isinstance(info, Mapping) or "spec_names" not in info:
        raise CheckpointError(f"{where}: key spec_names is missing or malformed")
    return _parse_spec_names(info["spec_names"], where)


def saved_data_parallel(tag_dir: Path, info: TrainConfigRecord) -> int | None:
    """The data-parallel size a checkpoint was trained at: ``train_config.json``'s
    ``data_parallel``, or for older checkpoints its RNG files (one per rank) over its stages;
    None when neither says."""
    if info.data_parallel is not None:
        return info.data_parallel
    if info.parts is None:
        return None
    stages = len(info.parts) - 1
    ranks = sum(1 for p in Path(tag_dir).glob("rng_state_rank*.pt"))
    return ranks // stages if stages >= 1 and ranks and ranks % stages == 0 else None


def saved_micro_batches(info: TrainConfigRecord) -> int | None:
    """``train.micro_batches`` (per data-parallel rank) of the run that saved a checkpoint."""
    value = info.config_value("train.micro_batches")
    return value if isinstance(value, int) and value >= 1 else None
