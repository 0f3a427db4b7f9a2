"""The checkpoint layout on disk, its one owner: tag names, ``latest``, the files of a tag,
checksums, resume's choice of tag, the check of a checkpoint before anything in it is read,
the safe loading of its torch files, and RNG states. ``train_config.json``'s record is
formats/train_config.py's; reading a checkpoint's weights and optimizer state is
formats/checkpoint_state.py's (both build on the names here, never the other way round).

A save writes ``SAVE_DIR/global_stepN/`` through DeepSpeed (every rank its own files), then
each rank's RNG state, then (rank 0, after a barrier) ``train_config.json``, the tag's copy of
the SentencePiece model and ``checksums.json`` over every file of the tag, and only then
``SAVE_DIR/latest`` (written to a temporary name and renamed). A checkpoint without its
checksums is incomplete and never loaded.

A checkpoint is not trusted code: ``latest`` and every tag are a ``global_stepN`` directory
inside the save_dir (never a path or a link out of it), and no file is unpickled beyond
tensors, containers, numbers, strings and the few DeepSpeed types of :data:`ALLOWED_GLOBALS`
(``torch.load(weights_only=True)`` here, in formats/checkpoint_state.py and in DeepSpeed's own
load: megatron_branchnorm/training/checkpoint_engine.py).

A tag directory is exactly what its ``checksums.json`` lists (:func:`check_listing`): the
manifest lists only the names a save writes, exactly as the functions below spell them
(:func:`is_saved_name`: ``layer_001-...`` or ``layer_01-x-...`` would be a second name for
layer 1, which DeepSpeed's load globs as ``layer_01-*model_states.pt``); every entry of the
tag is a regular file it lists, none a symbolic link; and every reader takes the names from
the manifest (:func:`listed_files`), never from a directory listing. A complete save leaves
nothing else in a tag (its temporary files are renamed before the manifest is written), so
anything else, a dot-file included, is refused by name before any file is read.

The files of a tag directory (DeepSpeed 0.19.8 names the first three):

- ``layer_{idx:02d}-model_states.pt``: the weights of entry ``idx`` of the layer list
  (docs/design.md §1; past 99 the index has more digits, so files are matched by parsed index,
  never sorted as strings);
- ``mp_rank_{stage:02d}_model_states.pt``: one stage's engine state;
- ``[bf16_]zero_pp_rank_{dp}_mp_rank_{stage:02d}_optim_states.pt``: the optimizer state of one
  (data-parallel rank, stage); with bf16, the fp32 master weights
  (``checkpoint_state.read_master_weights``);
- ``rng_state_rank{rank:04d}.pt``, ``train_config.json``, ``spm.model``, ``checksums.json``:
  ours.

This module imports no DeepSpeed: it names DeepSpeed's pickled types, never imports them.
"""

from __future__ import annotations

import hashlib
import json
import operator
import os
import random
import re
import stat
from pathlib import Path

from megatron_branchnorm.errors import UserError
from megatron_branchnorm.formats.files import (
    MAX_JSON_BYTES,
    FileShapeError,
    name_problem,
    one_line,
    quote,
    read_json_object,
    read_small_file,
    sha256_file,
)

MANIFEST = "checksums.json"
LATEST = "latest"
"""``SAVE_DIR/latest``: the tag to resume from, moved only once a checkpoint is complete."""
LATEST_MAX_BYTES = 4096
"""Largest ``latest`` read: it holds one tag name."""
TAG_PREFIX = "global_step"
TRAIN_CONFIG = "train_config.json"
"""Our client state in every tag: step, samples, data position, the index -> module-name map
(``spec_names``), the stage plan (``parts``), the resolved config, vocabulary, precision;
read and written as a ``TrainConfigRecord`` (formats/train_config.py)."""
SPM_IN_CHECKPOINT = "spm.model"
"""The training SentencePiece model's copy in every checkpoint tag (checked against
``train_config.json``'s ``vocab.spm_sha256``)."""

_TAG = re.compile(r"^global_step(0|[1-9][0-9]*)$")
RNG_FILE = re.compile(r"^rng_state_rank([0-9]{4,})\.pt$")
"""Our RNG state of one rank; group 1 is the rank."""
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
``fragment_address`` into formats/checkpoint_state.py's ``FragmentAddress``, and no fp16
state)."""


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
    """The layer-list index of a layer file's name as :func:`layer_file` spells it; None for
    any other name (``layer_001-model_states.pt`` included: one index has one name)."""
    match = LAYER_FILE.fullmatch(name)
    if match is None or name != layer_file(int(match.group(1))):
        return None
    return int(match.group(1))


def engine_file(stage: int) -> str:
    """The file name of one stage's engine state in a tag."""
    return f"mp_rank_{stage:02d}_model_states.pt"


def optim_file(dp_rank: int, stage: int, bf16: bool = False) -> str:
    """The file name of one (data-parallel rank, stage)'s optimizer state in a tag."""
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{dp_rank}_mp_rank_{stage:02d}_optim_states.pt"


def rng_file(tag_dir: Path, rank: int) -> Path:
    """Where rank ``rank`` keeps its RNG state in a checkpoint."""
    return tag_dir / f"rng_state_rank{rank:04d}.pt"


def is_saved_name(name: str) -> bool:
    """Whether ``name`` is the name of a file a save writes into a tag, spelled exactly as
    :func:`layer_file`, :func:`engine_file`, :func:`optim_file` and :func:`rng_file` spell it
    (no other zero padding, nothing added), or ``train_config.json`` or ``spm.model``. The
    manifest itself is none of them."""
    if name in (TRAIN_CONFIG, SPM_IN_CHECKPOINT):
        return True
    if layer_index(name) is not None:
        return True
    match = ENGINE_FILE.fullmatch(name)
    if match:
        return name == engine_file(int(match.group(1)))
    match = OPTIM_FILE.fullmatch(name)
    if match:
        bf16, dp, stage = match.groups()
        return name == optim_file(int(dp), int(stage), bf16 is not None)
    match = RNG_FILE.fullmatch(name)
    return match is not None and name == rng_file(Path(), int(match.group(1))).name


def listed_files(tag_dir: Path, manifest: dict | None = None) -> list[Path]:
    """The files of a tag by the exact names its manifest lists, sorted: ``manifest`` as
    :func:`verify_checkpoint` returned it, or (None) the tag's ``checksums.json`` read again.
    Never a directory listing: an entry the manifest does not list is no file of the
    checkpoint. CheckpointError naming the manifest when it is not one the trainer wrote."""
    tag_dir = Path(tag_dir)
    if manifest is None:
        manifest = read_manifest(tag_dir)
    return [tag_dir / name for name in sorted(manifest_entries(tag_dir / MANIFEST, manifest))]


def layer_files(tag_dir: Path, manifest: dict | None = None) -> dict[int, Path]:
    """{layer-list index: layer file} of a tag directory, from the names its manifest lists
    (:func:`listed_files`)."""
    out = {}
    for path in listed_files(tag_dir, manifest):
        idx = layer_index(path.name)
        if idx is not None:
            out[idx] = path
    return out


def write_manifest(tag_dir: Path, step: int) -> None:
    """Checksums of every file in ``tag_dir`` (rank 0, after all ranks saved).

    A complete save leaves only files of the names it writes there (its temporary files are
    renamed before this runs), so any other entry (a dot-file, a second name of a layer's
    file, a directory, a FIFO, a symbolic link) is a CheckpointError naming it and no
    manifest is written: the tag stays incomplete, never a checkpoint its own check refuses."""
    tag_dir = Path(tag_dir)
    files = []
    for name in sorted(os.listdir(tag_dir)):
        path = tag_dir / name
        if name == MANIFEST:
            continue
        if not is_saved_name(name) or path.is_symlink() or not path.is_file():
            raise CheckpointError(
                f"{_entry_where(tag_dir, name)}: {_entry_kind(path)} that no save writes into "
                f"a checkpoint; {MANIFEST} not written (move it out of the tag and save again)"
            )
        files.append(path)
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


def read_manifest(tag_dir: Path) -> dict:
    """The JSON object of a tag's ``checksums.json`` (not a symbolic link), unchecked;
    CheckpointError naming it when it is missing (an incomplete checkpoint) or unreadable."""
    manifest_path = Path(tag_dir) / MANIFEST
    if manifest_path.is_symlink():
        raise CheckpointError(f"{manifest_path}: a symbolic link; a checkpoint's files are its own")
    return read_json_object(
        manifest_path, CheckpointError, missing="missing: the checkpoint is incomplete"
    )


def check_listing(tag_dir: Path) -> dict:
    """The manifest of a tag whose directory holds exactly the files it lists; nothing but the
    manifest is opened (entries are looked at with ``lstat``), so a reader may call it before
    it reads any file of the tag.

    The tag directory must be a real one (:func:`tag_problem`), its ``checksums.json`` of the
    shape :func:`write_manifest` writes (:func:`manifest_entries`: only names a save writes),
    every entry of the directory but the manifest listed (an unlisted file, FIFO, directory or
    link of any name is refused: DeepSpeed's load globs, and a second name of a layer's file
    would be read), and every listed file a regular file, not a symbolic link.
    CheckpointError, one line naming the entry or the manifest's entry, otherwise."""
    tag_dir = Path(tag_dir)
    problem = tag_problem(tag_dir.parent, tag_dir.name)
    if problem:
        raise CheckpointError(f"{tag_dir}: {problem}")
    manifest_path = tag_dir / MANIFEST
    manifest = read_manifest(tag_dir)
    entries = manifest_entries(manifest_path, manifest)
    try:
        present = sorted(os.listdir(tag_dir))
    except OSError as exc:
        raise CheckpointError(f"{tag_dir}: unreadable ({one_line(exc.strerror or exc)})") from None
    for name in present:
        if name != MANIFEST and name not in entries:
            raise CheckpointError(
                f"{_entry_where(tag_dir, name)}: {_entry_kind(tag_dir / name)} that {MANIFEST} "
                "does not list; a checkpoint holds only the files its save wrote (move it out "
                "of the tag)"
            )
    for name in entries:
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
    return manifest


def _entry_where(tag_dir: Path, name: str) -> str:
    """An entry of a tag for a message: its path, or the quoted name when it would not print
    on one line."""
    return str(tag_dir / name) if name.isprintable() else f"{tag_dir}: entry {quote(name)}"


def _entry_kind(path: Path) -> str:
    """What an entry of a directory is, for a message (``lstat``: nothing is opened)."""
    try:
        mode = path.lstat().st_mode
    except OSError:
        return "an entry"
    for test, what in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISREG, "a file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
    ):
        if test(mode):
            return what
    return "a special file"


def verify_checkpoint(tag_dir: Path) -> dict:
    """Check a checkpoint before anything in it is read; returns its manifest.

    The tag directory must hold exactly the files its ``checksums.json`` lists
    (:func:`check_listing`, before any file is read), each with the listed size and SHA-256,
    and each torch file among them free of objects a checkpoint never holds
    (:func:`check_torch_file`). CheckpointError, one line naming the file or the manifest's
    entry, otherwise.
    """
    tag_dir = Path(tag_dir)
    manifest = check_listing(tag_dir)
    for name, (digest, size) in manifest_entries(tag_dir / MANIFEST, manifest).items():
        path = tag_dir / name
        try:
            actual = path.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing (listed in {MANIFEST})") from None
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
    ``manifest_path``), each name a plain file name of the tag (``formats.files.name_problem``
    and no ``/``) that a save writes (:func:`is_saved_name`). CheckpointError naming the
    manifest and the key or entry for any other shape; the names are checked as text, no file
    is touched."""

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
        if name_problem(name) or "/" in name:
            raise bad(f"entry {quote(name)} is not a plain file name of the tag")
        if not is_saved_name(name):
            raise bad(
                f"entry {quote(name)} is not a file a save writes (it writes each name "
                f"exactly as {layer_file(1)}, {engine_file(0)}, {rng_file(Path(), 0).name}: "
                "one name per file)"
            )
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
