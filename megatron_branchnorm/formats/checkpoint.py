"""The checkpoint layout on disk, its one owner: tag names, ``latest``, the files of a tag,
checksums, ``train_config.json``, RNG states, and reading a checkpoint's weights.

A save writes ``SAVE_DIR/global_stepN/`` through DeepSpeed (every rank its own files), then
each rank's RNG state, then (rank 0, after a barrier) ``train_config.json``, the tag's copy of
the SentencePiece model and ``checksums.json`` over every file of the tag, and only then
``SAVE_DIR/latest`` (written to a temporary name and renamed). A checkpoint without its
checksums is incomplete and never loaded.

A checkpoint is not trusted code: ``latest`` and every tag are a ``global_stepN`` directory
inside the save_dir (never a path or a link out of it), the manifest lists plain file names of
its tag, and no file is unpickled beyond tensors, containers, numbers, strings and the few
DeepSpeed types of :data:`ALLOWED_GLOBALS` (``torch.load(weights_only=True)`` here and in
DeepSpeed's own load: megatron_branchnorm/training/checkpoint_engine.py).

The files of a tag directory (DeepSpeed 0.19.8 names the first three):

- ``layer_{idx:02d}-model_states.pt``: the weights of entry ``idx`` of the layer list
  (docs/design.md §1; past 99 the index has more digits, so files are matched by parsed index,
  never sorted as strings);
- ``mp_rank_{stage:02d}_model_states.pt``: one stage's engine state;
- ``[bf16_]zero_pp_rank_{dp}_mp_rank_{stage:02d}_optim_states.pt``: the optimizer state of one
  (data-parallel rank, stage); with bf16, the fp32 master weights (:func:`read_master_weights`);
- ``rng_state_rank{rank:04d}.pt``, ``train_config.json``, ``spm.model``, ``checksums.json``:
  ours.

This module imports no DeepSpeed: the one DeepSpeed object pickled in the files we read
(``fragment_address``) is read into a stand-in (:class:`FragmentAddress`).
"""

from __future__ import annotations

import hashlib
import json
import operator
import os
import random
import re
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from megatron_branchnorm.errors import UserError
from megatron_branchnorm.formats.files import (
    MAX_JSON_BYTES,
    FileShapeError,
    one_line,
    quote,
    read_json_object,
    read_small_file,
    sha256_file,
)

if TYPE_CHECKING:  # torch is imported where tensors are read: the names above stay light
    import torch

MANIFEST = "checksums.json"
LATEST = "latest"
"""``SAVE_DIR/latest``: the tag to resume from, moved only once a checkpoint is complete."""
LATEST_MAX_BYTES = 4096
"""Largest ``latest`` read: it holds one tag name."""
TAG_PREFIX = "global_step"
TRAIN_CONFIG = "train_config.json"
"""Our client state in every tag: step, samples, data position, the index -> module-name map
(``spec_names``), the stage plan (``parts``), the resolved config, vocabulary, precision;
read and written as a :class:`TrainConfigRecord`."""
SPM_IN_CHECKPOINT = "spm.model"
"""The training SentencePiece model's copy in every checkpoint tag (checked against
``train_config.json``'s ``vocab.spm_sha256``)."""

_TAG = re.compile(r"^global_step(0|[1-9][0-9]*)$")
LAYER_FILE = re.compile(r"^layer_([0-9]{2,})-model_states\.pt$")
"""DeepSpeed's file of one entry of the layer list; group 1 is the index."""
ENGINE_FILE = re.compile(r"^mp_rank_([0-9]{2,})_model_states\.pt$")
"""DeepSpeed's engine state of one stage; group 1 is the stage."""
OPTIM_FILE = re.compile(r"^(bf16_)?zero_pp_rank_([0-9]+)_mp_rank_([0-9]{2,})_optim_states\.pt$")
"""DeepSpeed's optimizer state of one (data-parallel rank, stage): groups (bf16 prefix or
None, data-parallel rank, stage). The BF16 optimizer's holds a flat fp32 partition of the
stage's parameters per group and, per group, where each parameter lies in it."""


class CheckpointError(UserError, RuntimeError):
    """A missing, partial or corrupt checkpoint: the message names the file."""


ALLOWED_GLOBALS: dict[str, str] = {
    "deepspeed.utils.tensor_fragment.fragment_address": (
        "param_slice_mappings of the bf16 and ZeRO optimizer files: where each parameter lies "
        "in the flat fp32 partition (a dataclass of two ints)"
    ),
    "deepspeed.runtime.zero.config.ZeroStageEnum": (
        "zero_stage of the fp16 ZeRO optimizer files (an int enum)"
    ),
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": (
        "loss_scaler of the fp16 ZeRO optimizer files with a dynamic loss scale (its numbers)"
    ),
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": (
        "loss_scaler of the fp16 ZeRO optimizer files with a static loss scale (its number)"
    ),
}
"""The only objects besides tensors, containers, numbers and strings that a checkpoint file
may hold (what ``torch.load(weights_only=True)`` reads by itself), by qualified name: the
types DeepSpeed 0.19.8 pickles into the files of an fp32, bf16 or fp16 ZeRO-1 run (fp32 and
bf16: found by loading real checkpoints, fp32 files need none; fp16, which does not run on a
CPU: from its ZeRO optimizer's ``state_dict``). Every checkpoint read goes through this list:
DeepSpeed's load (training/checkpoint_engine.py resolves the names) and ours (which read
``fragment_address`` into :class:`FragmentAddress`, and no fp16 state)."""


# ---- names -----------------------------------------------------------------------------------


def tag_for(step: int) -> str:
    """DeepSpeed's tag directory name for update ``step``."""
    step = operator.index(step)
    if step < 0:
        raise ValueError(f"a checkpoint step is >= 0, got {step}")
    return f"{TAG_PREFIX}{step}"


def tag_step(tag: str) -> int | None:
    """N of ``global_stepN`` (ASCII digits, no sign, no leading zero); None for any other name."""
    match = _TAG.fullmatch(tag) if isinstance(tag, str) else None
    return int(match.group(1)) if match else None


def is_tag(name: str) -> bool:
    """Whether ``name`` is a checkpoint tag's name (``global_stepN``)."""
    return tag_step(name) is not None


def tag_problem(save_dir: Path, tag: str) -> str | None:
    """Why ``save_dir/tag`` is not a checkpoint directory to read, None when it is one:
    ``tag`` a ``global_stepN`` name as :func:`tag_for` writes it (no path, no leading zero, no
    whitespace, checked before the file system is asked anything), and ``save_dir/tag`` a
    directory, not a symbolic link (which may lead out of the save_dir)."""
    if not is_tag(tag):
        return f"not a checkpoint tag ({TAG_PREFIX}N, N without leading zeros)"
    tag_dir = Path(save_dir) / tag
    if tag_dir.is_symlink():
        return "a symbolic link: a checkpoint is a directory of its save_dir, never a link"
    if not tag_dir.is_dir():
        return "not a checkpoint directory"
    return None


def layer_file(index: int) -> str:
    """The file name of layer-list entry ``index`` in a tag."""
    return f"layer_{index:02d}-model_states.pt"


def layer_index(name: str) -> int | None:
    """The layer-list index of a layer file's name; None for any other file."""
    match = LAYER_FILE.fullmatch(name)
    return int(match.group(1)) if match else None


def engine_file(stage: int) -> str:
    """The file name of one stage's engine state in a tag."""
    return f"mp_rank_{stage:02d}_model_states.pt"


def optim_file(dp_rank: int, stage: int, bf16: bool = False) -> str:
    """The file name of one (data-parallel rank, stage)'s optimizer state in a tag."""
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{dp_rank}_mp_rank_{stage:02d}_optim_states.pt"


def rng_file(tag_dir: Path, rank: int) -> Path:
    """Where rank ``rank`` keeps its RNG state in a checkpoint."""
    return tag_dir / f"rng_state_rank{rank:04d}.pt"


def layer_files(tag_dir: Path) -> dict[int, Path]:
    """{layer-list index: layer file} of a tag directory."""
    out = {}
    for path in Path(tag_dir).iterdir():
        idx = layer_index(path.name)
        if idx is not None:
            out[idx] = path
    return out


def write_manifest(tag_dir: Path, step: int) -> None:
    """Checksums of every file in ``tag_dir`` (rank 0, after all ranks saved)."""
    files = sorted(
        p
        for p in tag_dir.iterdir()
        if p.is_file() and p.name != MANIFEST and not p.name.startswith(".")  # .tmp leftovers
    )
    manifest = {
        "step": step,
        "files": {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in files},
    }
    tmp = tag_dir / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True), encoding="utf-8")
    os.replace(tmp, tag_dir / MANIFEST)


def checkpoint_id(tag_dir: Path) -> str:
    """What a complete checkpoint is, not where it lies: the hex SHA-256 of its
    ``checksums.json``, which lists every file's checksum. A tag rewritten with other contents
    (a rollback trained again) gets another id; the same bytes saved again get the same one.
    OSError (no manifest: incomplete or removed) propagates; a manifest that is not a regular
    file of at most :data:`MAX_JSON_BYTES` (a link, a FIFO, a device) is a CheckpointError."""
    path = Path(tag_dir) / MANIFEST
    try:
        data = read_small_file(path, MAX_JSON_BYTES, follow_symlinks=False)
    except FileShapeError as exc:
        raise CheckpointError(str(exc)) from None
    return hashlib.sha256(data).hexdigest()


def write_latest(save_dir: Path, tag: str) -> None:
    """Point ``latest`` at ``tag`` atomically."""
    tmp = save_dir / f".{LATEST}.tmp"
    tmp.write_text(tag, encoding="utf-8")
    os.replace(tmp, save_dir / LATEST)


def read_latest(save_dir: Path) -> str | None:
    """The tag ``latest`` names; None for a fresh save_dir; an error when a save_dir with
    checkpoints has no readable ``latest`` (never a silent fresh start), and when ``latest``
    names anything but a checkpoint directory of ``save_dir`` (:func:`tag_problem`: a
    path, a link out of it) or is itself a link. Surrounding whitespace (``echo TAG >
    latest``) is no part of the name."""
    latest = save_dir / LATEST
    tags = (
        [p for p in save_dir.iterdir() if is_tag(p.name) and p.is_dir()]
        if save_dir.is_dir()
        else []
    )
    if not latest.exists():
        complete = [p for p in tags if (p / MANIFEST).is_file()]
        if complete:
            raise CheckpointError(
                f"{latest}: missing, but {len(complete)} complete checkpoint(s) exist "
                f"(e.g. {complete[0].name}); write the tag to resume into {latest} or pick a "
                "new train.save_dir"
            )
        return None
    try:
        tag = (
            read_small_file(latest, LATEST_MAX_BYTES, follow_symlinks=False).decode("utf-8").strip()
        )
    except FileShapeError as exc:
        raise CheckpointError(str(exc)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{latest}: unreadable: {exc}") from None
    problem = tag_problem(save_dir, tag)
    if problem:
        raise CheckpointError(f"{latest}: names {quote(tag)}, {problem}")
    return tag


def checkpoint_tags(save_dir: Path) -> tuple[list[str], list[str]]:
    """(complete, incomplete) tags in ``save_dir``, each sorted by step: complete ones have
    their manifest (written only after every rank finished saving)."""
    found = []
    if save_dir.is_dir():
        for p in save_dir.iterdir():
            step = tag_step(p.name)
            if p.is_dir() and step is not None:
                found.append((step, p.name, (p / MANIFEST).is_file()))
    found.sort()
    return [t for _, t, ok in found if ok], [t for _, t, ok in found if not ok]


def resume_tag(save_dir: Path) -> tuple[str | None, list[str]]:
    """The checkpoint a run in ``save_dir`` resumes from, with warnings to print.

    ``latest`` names it; a save killed after its manifest but before ``latest`` moved leaves
    a newer complete checkpoint, which is taken instead (with a warning). A ``latest`` that
    is unreadable or names anything but a checkpoint directory is an error
    (:func:`read_latest`), never a fresh start, and so is a newer checkpoint that is a link
    (:func:`tag_problem`); incomplete checkpoints (killed saves) are never loaded.
    """
    tag = read_latest(save_dir)
    complete, incomplete = checkpoint_tags(save_dir)
    notes = [f"ignoring incomplete checkpoint {save_dir / t} (no {MANIFEST})" for t in incomplete]
    if tag is None:
        return None, notes
    newer = [t for t in complete if tag_step(t) > tag_step(tag)]
    if newer:
        problem = tag_problem(save_dir, newer[-1])
        if problem:
            raise CheckpointError(f"{save_dir / newer[-1]}: {problem}")
        notes.append(
            f"{save_dir / LATEST} names {tag} but {newer[-1]} is complete (a save stopped "
            f"before moving latest): resuming from {newer[-1]}"
        )
        tag = newer[-1]
    return tag, notes


def verify_checkpoint(tag_dir: Path) -> dict:
    """Check a checkpoint before anything in it is read; returns its manifest.

    The tag directory must be a real one (:func:`tag_problem`), its ``checksums.json`` of the
    shape :func:`write_manifest` writes, each file it lists a plain name of the tag (no path,
    no link) with the listed size and SHA-256, and each torch file among them free of objects
    a checkpoint never holds (:func:`check_torch_file`). CheckpointError, one line naming the
    file or the manifest's entry, otherwise.
    """
    tag_dir = Path(tag_dir)
    problem = tag_problem(tag_dir.parent, tag_dir.name)
    if problem:
        raise CheckpointError(f"{tag_dir}: {problem}")
    manifest_path = tag_dir / MANIFEST
    if manifest_path.is_symlink():
        raise CheckpointError(f"{manifest_path}: a symbolic link; a checkpoint's files are its own")
    manifest = read_json_object(
        manifest_path, CheckpointError, missing="missing: the checkpoint is incomplete"
    )
    for name, (digest, size) in manifest_entries(manifest_path, manifest).items():
        path = tag_dir / name
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing (listed in {MANIFEST})") from None
        if stat.S_ISLNK(mode):
            raise CheckpointError(
                f"{manifest_path}: entry {quote(name)} is a symbolic link; a checkpoint's files "
                "are its own"
            )
        if not stat.S_ISREG(mode):
            raise CheckpointError(f"{path}: not a regular file (listed in {MANIFEST})")
        actual = path.stat().st_size
        if actual != size:
            raise CheckpointError(f"{path}: {actual} bytes, {size} expected (truncated?)")
        if sha256_file(path) != digest:
            raise CheckpointError(f"{path}: checksum mismatch (corrupt)")
        if name.endswith(".pt"):
            check_torch_file(path)
    return manifest


_SHA256 = re.compile(r"[0-9a-f]{64}")


def manifest_entries(manifest_path: Path, manifest: dict) -> dict[str, tuple[str, int]]:
    """{file name: (hex SHA-256, bytes)} of a checkpoint's manifest (the JSON object of
    ``manifest_path``), each name a plain file name of the tag: not empty, no ``/``, not
    ``.`` or ``..``, no NUL. CheckpointError naming the manifest and the key or entry for any
    other shape; the names are checked as text, no file is touched."""

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{manifest_path}: {what} (not a manifest the trainer wrote)")

    step = manifest.get("step")
    if "step" not in manifest or isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise bad(f"key 'step' must be an integer >= 0, got {quote(step)}")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise bad(f"key 'files' must be an object of file name -> checksum, got {quote(files)}")
    out = {}
    for name, info in files.items():
        if name in ("", ".", "..") or "/" in name or "\0" in name:
            raise bad(f"entry {quote(name)} is not a plain file name of the tag")
        if not isinstance(info, dict):
            raise bad(f"entry {quote(name)} must be an object with sha256 and bytes")
        digest, size = info.get("sha256"), info.get("bytes")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise bad(f"entry {quote(name)}: sha256 must be 64 hex digits, got {quote(digest)}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise bad(f"entry {quote(name)}: bytes must be an integer >= 0, got {quote(size)}")
        out[name] = (digest, size)
    return out


def check_torch_file(path: Path) -> None:
    """CheckpointError naming ``path`` when unpickling the torch file would build an object
    that is not a tensor, container, number, string or one of :data:`ALLOWED_GLOBALS` (read
    from its pickle's opcodes: nothing is unpickled). Every rank checks every file, so all of
    them refuse a checkpoint alike before DeepSpeed's load reads any; a file in torch's
    legacy (non-zip) format is left to that load, which reads with ``weights_only=True`` and
    refuses the same (training/checkpoint_engine.py)."""
    import torch

    with open(path, "rb") as fh:
        if fh.read(4) != b"PK\x03\x04":  # torch's zip format, what every save writes
            return
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets its name
        raise CheckpointError(f"{path}: not a readable torch file: {one_line(exc, 200)}") from None
    refused = sorted(set(found) - ALLOWED_GLOBALS.keys())
    if refused:
        raise CheckpointError(
            f"{path}: refused: it would unpickle {', '.join(refused[:3])}, which no checkpoint "
            "holds (only tensors and a few DeepSpeed types are read)"
        )


def load_torch_file(path: Path, map_location=None, safe_globals: list | tuple = ()) -> object:
    """A torch file read with ``torch.load(weights_only=True)``: tensors, containers, numbers,
    strings and the types of ``safe_globals`` (objects, or (object, qualified name) pairs),
    nothing else is unpickled. CheckpointError naming the file when it holds anything else or
    cannot be read."""
    import pickle

    import torch

    try:
        with torch.serialization.safe_globals(list(safe_globals)):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"{path}: refused: {_weights_only_reason(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets its name
        raise CheckpointError(f"{path}: cannot read: {one_line(exc, 200)}") from None


def _weights_only_reason(exc: BaseException) -> str:
    """The one paragraph of torch's weights-only refusal that says what was refused."""
    paragraphs = [p.strip() for p in str(exc).split("\n\n") if p.strip()]
    said = [p for p in paragraphs if not p.startswith(("Weights only load failed", "Check the"))]
    return one_line(said[0] if said else exc, 200)


def rng_state() -> dict:
    """Python, NumPy and torch RNG states, in a form ``torch.load(weights_only=True)`` reads.

    On a GPU, only this rank's bound device's generator is saved (a list of one): a rank
    drives one GPU, and a list of every visible GPU's state would not restore on a node
    with fewer GPUs."""
    import numpy as np
    import torch

    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [np_state[0], torch.as_tensor(np_state[1]), *np_state[2:]],
        "torch": torch.get_rng_state(),
        "cuda": [torch.cuda.get_rng_state()] if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` captured."""
    import numpy as np
    import torch

    version, seq, gauss = state["python"]
    random.setstate((version, tuple(seq), gauss))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    cuda = state["cuda"]
    if torch.cuda.is_available() and cuda:
        # one state (this format), or every GPU's (older checkpoints): this rank's own
        own = cuda[0] if len(cuda) == 1 else cuda[min(torch.cuda.current_device(), len(cuda) - 1)]
        torch.cuda.set_rng_state(own)


def restore_rng_state(path: Path) -> None:
    """Restore the RNG state a rank saved in ``path`` (:func:`rng_file`), read with
    ``weights_only=True``; CheckpointError naming the file when it is not such a state."""
    state = load_torch_file(path, map_location="cpu")
    try:
        set_rng_state(state)
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError, AttributeError) as exc:
        raise CheckpointError(f"{path}: not an RNG state: {one_line(exc, 200)}") from None


# ---- train_config.json -----------------------------------------------------------------------
#
# The file's one schema: TrainConfigRecord. Outside formats/ it is read with read_train_record
# and written with write_train_config(tag_dir, record); read_train_config is the raw JSON object
# under it. A record lives here, beside CheckpointError, because read_checkpoint returns it and
# the package's import graph has no circles (tests/core/test_architecture.py).

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


# ---- reading a checkpoint's weights ----------------------------------------------------------

FlatKey = Callable[[str, str], str]
"""(module name of a layer-list entry, key in its layer file) -> the flat model's key:
``partition.pipe_to_flat_key``."""


def read_checkpoint(
    tag_dir: Path, flat_key: FlatKey, verify: bool = True, indices: set[int] | None = None
) -> tuple[TrainConfigRecord, dict[str, torch.Tensor]]:
    """(``train_config.json``'s record, flat state dict in fp32) of one checkpoint directory,
    verified against its checksums unless the caller already did (``verify=False``); with
    ``indices``, only the layer files of those layer-list indices are read. Layer files are
    read with ``torch.load(weights_only=True)``."""
    tag_dir = Path(tag_dir)
    if verify:
        verify_checkpoint(tag_dir)
    info = read_train_record(tag_dir)
    names = info.need("spec_names")
    state: dict[str, torch.Tensor] = {}
    for idx, path in sorted(layer_files(tag_dir).items()):
        if idx not in names:
            raise CheckpointError(f"{path}: layer index {idx} is not in the saved layout")
        if indices is not None and idx not in indices:
            continue
        for key, value in read_layer_file(path).items():
            state[flat_key(names[idx], key)] = value.float()
    return info, state


def read_layer_file(path: Path) -> dict[str, torch.Tensor]:
    """One layer file's state dict (``weights_only=True``); CheckpointError naming it."""
    import torch

    try:
        layer = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets its name
        raise CheckpointError(f"{path}: cannot read layer file: {one_line(exc)}") from None
    if not isinstance(layer, dict):
        raise CheckpointError(f"{path}: cannot read layer file: not a state dict")
    return layer


@dataclass
class FragmentAddress:
    """Stand-in for DeepSpeed's ``deepspeed.utils.tensor_fragment.fragment_address`` (a
    dataclass of two ints), the one non-tensor object in a BF16 optimizer file: with it,
    those files are read with ``weights_only=True`` and without importing DeepSpeed."""

    numel: int
    start: int


FRAGMENT_ADDRESS = "deepspeed.utils.tensor_fragment.fragment_address"
"""DeepSpeed's qualified name of :class:`FragmentAddress`, as its pickles name it."""


def load_optimizer_file(path: Path) -> dict:
    """A DeepSpeed optimizer-state file read with ``weights_only=True``, its
    ``fragment_address`` objects as :class:`FragmentAddress` (exceptions propagate)."""
    import torch

    with torch.serialization.safe_globals([(FragmentAddress, FRAGMENT_ADDRESS)]):
        return torch.load(path, map_location="cpu", weights_only=True)


def bf16_optim_files(tag_dir: Path) -> dict[int, dict[int, Path]]:
    """{stage: {data-parallel rank: file}} of a tag's BF16 optimizer files ({}: none)."""
    return optim_files(tag_dir, bf16_only=True)


def optim_files(tag_dir: Path, bf16_only: bool = False) -> dict[int, dict[int, Path]]:
    """{stage: {data-parallel rank: file}} of a tag's partitioned optimizer files (ZeRO or
    BF16; {}: none, the optimizer state is in the engine files)."""
    files: dict[int, dict[int, Path]] = {}
    for path in Path(tag_dir).iterdir():
        match = OPTIM_FILE.fullmatch(path.name)
        if match and (match.group(1) or not bf16_only):
            files.setdefault(int(match.group(3)), {})[int(match.group(2))] = path
    return files


def read_master_weights(tag_dir: Path, param_key: Callable[[str], str]) -> dict[str, torch.Tensor]:
    """The fp32 master weights of a bf16 checkpoint by ``param_key(engine parameter name)``
    (1-D: the caller shapes them like the layer files' tensors; ``param_key`` raises KeyError
    for a name it cannot place); {} when the checkpoint has none (fp32, fp16).

    Each stage's parameters are flattened and split over its data-parallel ranks in rank
    order; ``param_slice_mappings`` says where each parameter's piece lies in a rank's
    partition, so a parameter is the concatenation of its pieces over the ranks. The tied
    embedding is held by the first and the last stage with the same values: the first
    stage's copy is taken.
    """
    import torch

    files = bf16_optim_files(tag_dir)
    state: dict[str, torch.Tensor] = {}
    for stage in sorted(files):
        pieces: dict[str, list[torch.Tensor]] = {}
        for dp in sorted(files[stage]):
            path = files[stage][dp]
            try:
                opt = load_optimizer_file(path)["optimizer_state_dict"]
                groups = zip(
                    opt["single_partition_of_fp32_groups"], opt["param_slice_mappings"], strict=True
                )
                for flat, mapping in groups:
                    for name, addr in mapping.items():
                        pieces.setdefault(name, []).append(flat.narrow(0, addr.start, addr.numel))
            except Exception as exc:  # noqa: BLE001 - any unreadable file gets its name
                raise CheckpointError(
                    f"{path}: cannot read bf16 master weights: {one_line(exc)}"
                ) from None
        first = files[stage][min(files[stage])]
        for name, parts in pieces.items():
            try:
                key = param_key(name)
            except KeyError:
                idx = name.split(".", 1)[0]
                raise CheckpointError(f"{first}: layer {idx} is not in the layout") from None
            state.setdefault(key, torch.cat(parts))
    return state


# ---- reading a checkpoint's optimizer state, per parameter ------------------------------------

OPTIMIZER_PARAM_NAMES = "optimizer_param_names"
"""Our key in each stage's engine file (DeepSpeed's client state): the engine's parameter names
in the order of the fp32 optimizer's param groups (torch keys its state by that position). The
BF16 optimizer's files name their parameters themselves (``param_slice_mappings``)."""

ADAM_STATE = ("exp_avg", "exp_avg_sq")


class LayoutError(CheckpointError):
    """A checkpoint whose optimizer state cannot be re-laid out (the message says why)."""


def read_optimizer_state(
    tag_dir: Path,
    param_key: Callable[[str], str],
    stages: set[int] | None = None,
    keys: set[str] | None = None,
) -> dict[str, dict[str, torch.Tensor]] | None:
    """The training state of a checkpoint per parameter, whatever its stage and data-parallel
    layout: ``{param_key(engine name): {"step", "exp_avg", "exp_avg_sq"[, "master"]}}``, each
    tensor 1-D (``step`` 0-dim), fp32, on the CPU. ``master`` (the fp32 master weights) is there
    for a bf16 checkpoint only: an fp32 run's weights are its layer files.

    Only the files of ``stages`` (of the saved layout; None: all) are read, and only the
    parameters whose key is in ``keys`` (None: all) are assembled. A parameter held by
    two stages (the tied embedding, first and last) has the same state on both: the lowest
    stage's copy is taken. None when the checkpoint holds no such state: an fp32 run saved
    before :data:`OPTIMIZER_PARAM_NAMES`, or a checkpoint re-laid by ``convert_checkpoint.py
    --repartition`` (weights only); :class:`LayoutError` for fp16's ZeRO state, which is not
    read.
    """

    tag_dir = Path(tag_dir)
    partitioned = optim_files(tag_dir)
    if partitioned and not bf16_optim_files(tag_dir):
        raise LayoutError(
            f"{tag_dir}: fp16 ZeRO optimizer state is not re-laid out; resume it at its saved "
            "layout, or in bf16 or fp32"
        )
    by_stage: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
    if partitioned:
        for stage, files in sorted(partitioned.items()):
            if stages is None or stage in stages:
                by_stage[stage] = _read_bf16_stage(files, param_key, keys)
    else:
        for path in sorted(Path(tag_dir).iterdir()):
            match = ENGINE_FILE.fullmatch(path.name)
            if match and (stages is None or int(match.group(1)) in stages):
                found = _read_fp32_stage(path, param_key, keys)
                if found is None:
                    return None
                by_stage[int(match.group(1))] = found
    if not by_stage:  # no optimizer files (a checkpoint re-laid by convert --repartition)
        return None
    state: dict[str, dict[str, torch.Tensor]] = {}
    for stage in sorted(by_stage):
        for key, value in by_stage[stage].items():
            state.setdefault(key, value)
    return state


def _placed(name: str, path: Path, param_key: Callable[[str], str]) -> str:
    try:
        return param_key(name)
    except KeyError:
        raise CheckpointError(f"{path}: parameter {name} is not in the layout") from None


def _read_bf16_stage(
    files: dict[int, Path], param_key, keys: set[str] | None
) -> dict[str, dict[str, torch.Tensor]]:
    """One stage's BF16 optimizer files (one per data-parallel rank, in rank order): each holds
    a flat fp32 partition per param group, Adam's moments over the same partition, and where
    each parameter's piece lies in it; a parameter is its pieces concatenated over the ranks."""
    import torch

    pieces: dict[str, dict[str, list[torch.Tensor]]] = {}
    steps: dict[str, torch.Tensor] = {}
    for dp in sorted(files):
        path = files[dp]
        try:
            opt = load_optimizer_file(path)["optimizer_state_dict"]
            base = opt["base_optimizer_state"]
            groups = zip(
                opt["single_partition_of_fp32_groups"],
                opt["param_slice_mappings"],
                base["param_groups"],
                strict=True,
            )
            for flat, mapping, group in groups:
                adam = base["state"].get(group["params"][0])
                if adam is None:  # saved before the first update: no moments yet
                    continue
                sources = {"master": flat, **{k: adam[k] for k in ADAM_STATE}}
                for name, addr in mapping.items():
                    key = _placed(name, path, param_key)
                    if keys is not None and key not in keys:
                        continue
                    into = pieces.setdefault(key, {k: [] for k in sources})
                    for k, src in sources.items():
                        into[k].append(src.narrow(0, addr.start, addr.numel))
                    steps[key] = adam["step"]
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - any unreadable file gets its name
            raise CheckpointError(
                f"{path}: cannot read bf16 optimizer state: {one_line(exc)}"
            ) from None
    return {
        key: {
            "step": steps[key].float().clone(),
            **{k: torch.cat(v).float() for k, v in parts.items()},
        }
        for key, parts in pieces.items()
    }


def _read_fp32_stage(
    path: Path, param_key, keys: set[str] | None
) -> dict[str, dict[str, torch.Tensor]] | None:
    """One stage's engine file of an fp32 run: torch's optimizer state keyed by position,
    named by :data:`OPTIMIZER_PARAM_NAMES` (None when the file predates it)."""
    import torch

    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        names = saved.get(OPTIMIZER_PARAM_NAMES)
        if names is None:
            return None
        opt = saved["optimizer"]
        out = {}
        for group, group_names in zip(opt["param_groups"], names, strict=True):
            for index, name in zip(group["params"], group_names, strict=True):
                adam = opt["state"].get(index)
                key = _placed(name, path, param_key)
                if adam is not None and (keys is None or key in keys):  # none before update 1
                    out[key] = {
                        "step": adam["step"].float().clone(),
                        **{k: adam[k].float().flatten() for k in ADAM_STATE},
                    }
        return out
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets its name
        raise CheckpointError(f"{path}: cannot read optimizer state: {one_line(exc)}") from None


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


def seed_rng(seed: int, step: int, rank: int) -> None:
    """Seed Python's, NumPy's and torch's generators (every GPU's too) from (seed, step, rank):
    the RNG of a rank resumed in another layout, where no saved stream belongs to it."""
    import numpy as np
    import torch

    value = int.from_bytes(
        hashlib.sha256(f"{seed}:{step}:{rank}".encode()).digest()[:8], "little"
    ) & (2**63 - 1)
    random.seed(value)
    np.random.seed(value % 2**32)
    torch.manual_seed(value)
