"""Checkpoint bookkeeping around DeepSpeed's save/load: checksums, `latest`, RNG states.

A save writes ``SAVE_DIR/global_stepN/`` through DeepSpeed (every rank its own files), then
each rank's RNG state, then (rank 0, after a barrier) ``checksums.json`` over every file of
the tag, and only then ``SAVE_DIR/latest`` (written to a temporary name and renamed). A
checkpoint without its checksums is incomplete and never loaded; DeepSpeed loads with
``weights_only=False``, so every file is verified against the manifest before it is read.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path

import numpy as np
import torch

from megatron_branchnorm.errors import UserError

MANIFEST = "checksums.json"


class CheckpointError(UserError, RuntimeError):
    """A missing, partial or corrupt checkpoint: the message names the file."""


def tag_for(step: int) -> str:
    """DeepSpeed's tag directory name for update ``step``."""
    return f"global_step{step}"


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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


def write_latest(save_dir: Path, tag: str) -> None:
    """Point ``latest`` at ``tag`` atomically."""
    tmp = save_dir / ".latest.tmp"
    tmp.write_text(tag, encoding="utf-8")
    os.replace(tmp, save_dir / "latest")


def read_latest(save_dir: Path) -> str | None:
    """The tag ``latest`` names; None for a fresh save_dir; an error when a save_dir with
    checkpoints has no readable ``latest`` (never a silent fresh start)."""
    latest = save_dir / "latest"
    tags = [p for p in save_dir.glob("global_step*") if p.is_dir()] if save_dir.is_dir() else []
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
        tag = latest.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{latest}: unreadable: {exc}") from None
    if not tag or not (save_dir / tag).is_dir():
        raise CheckpointError(f"{latest}: names {tag!r}, which is not a checkpoint directory")
    return tag


def tag_step(tag: str) -> int | None:
    """N of ``global_stepN``; None for any other name."""
    digits = tag.removeprefix("global_step")
    return int(digits) if tag.startswith("global_step") and digits.isdigit() else None


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
    is unreadable or names no directory is an error (:func:`read_latest`), never a fresh
    start; incomplete checkpoints (killed saves) are never loaded.
    """
    tag = read_latest(save_dir)
    complete, incomplete = checkpoint_tags(save_dir)
    notes = [f"ignoring incomplete checkpoint {save_dir / t} (no {MANIFEST})" for t in incomplete]
    if tag is None:
        return None, notes
    step = tag_step(tag)
    newer = [t for t in complete if step is not None and tag_step(t) > step]
    if newer:
        notes.append(
            f"{save_dir / 'latest'} names {tag} but {newer[-1]} is complete (a save stopped "
            f"before moving latest): resuming from {newer[-1]}"
        )
        tag = newer[-1]
    return tag, notes


def verify_checkpoint(tag_dir: Path) -> dict:
    """Check every file of a checkpoint against its manifest; returns the manifest."""
    manifest_path = tag_dir / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{manifest_path}: missing: the checkpoint is incomplete")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = manifest["files"]
    except (ValueError, KeyError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{manifest_path}: corrupt manifest: {exc}") from None
    for name, info in files.items():
        path = tag_dir / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (listed in {MANIFEST})")
        if path.stat().st_size != info["bytes"]:
            raise CheckpointError(
                f"{path}: {path.stat().st_size} bytes, {info['bytes']} expected (truncated?)"
            )
        if sha256_file(path) != info["sha256"]:
            raise CheckpointError(f"{path}: checksum mismatch (corrupt)")
    return manifest


def rng_state() -> dict:
    """Python, NumPy and torch RNG states, in a form ``torch.load(weights_only=True)`` reads.

    On a GPU, only this rank's bound device's generator is saved (a list of one): a rank
    drives one GPU, and a list of every visible GPU's state would not restore on a node
    with fewer GPUs."""
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [np_state[0], torch.as_tensor(np_state[1]), *np_state[2:]],
        "torch": torch.get_rng_state(),
        "cuda": [torch.cuda.get_rng_state()] if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` captured."""
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


def rng_file(tag_dir: Path, rank: int) -> Path:
    """Where rank ``rank`` keeps its RNG state in a checkpoint."""
    return tag_dir / f"rng_state_rank{rank:04d}.pt"
