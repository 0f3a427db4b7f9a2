"""A preprocessed DATA_DIR's ``manifest.json``, its one reader (the writer is
``data/preprocess.py``).

:func:`read_data_manifest` returns a :class:`DataManifest`: the keys the trainer, the
converter and the evaluation read, each checked when present, with a one-line
:class:`DataError` naming the file and the key otherwise. The structure the training stream
needs beyond them (directions, sample counts, tag ids) is ``data/dataset.py``'s check.

Every file the manifest names (``spm_model``, the references, the training binaries) is a
regular file inside DATA_DIR (``formats.files.file_inside``: not absolute, no ``..``, no link
leading out); ``spm_model`` is moreover a plain file name. A manifest never makes us stat,
read, hash or copy another file of the machine.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from megatron_branchnorm.errors import UserError
from megatron_branchnorm.formats.files import (
    file_inside,
    name_problem,
    quote,
    read_json_file,
    sha256_file,
)

MANIFEST = "manifest.json"
FORMAT = "megatron_branchnorm-data"
VERSION = 1
"""The manifest version this code writes and reads (``data/dataset.open_manifest`` checks it)."""
DEFAULT_SPM_MODEL = "spm.model"
DEFAULT_PIVOT = "en"


class DataError(UserError, ValueError):
    """Bad data input or a damaged data file: a DATA_DIR whose manifest (or a file it names)
    cannot be used, a corpus line, an indexed dataset; one line naming the file and the key or
    line. The data pipeline's one error type (``data/`` raises it too)."""


@dataclass(frozen=True)
class References:
    """One direction's raw source and reference files of a dev/test split."""

    src_lang: str
    tgt_lang: str
    src: Path
    tgt: Path

    @property
    def name(self) -> str:
        return f"{self.src_lang}-{self.tgt_lang}"


@dataclass(frozen=True)
class DataManifest:
    """What ``DATA_DIR/manifest.json`` says, checked."""

    data_dir: Path
    vocab_size: int | None
    """None when not recorded (a DATA_DIR written only for evaluation)."""
    languages: tuple[str, ...]
    spm_model: str
    """A plain file name inside :attr:`data_dir` (checked, not a link; the file may be
    missing)."""
    pivot: str
    sha256: str
    """Of the manifest file's bytes: the identity of the data a checkpoint records."""
    raw: Mapping[str, Any] = field(repr=False, compare=False)
    """The whole JSON object, read-only (keys not checked here)."""

    @property
    def path(self) -> Path:
        return self.data_dir / MANIFEST

    @property
    def spm_path(self) -> Path:
        return self.data_dir / self.spm_model

    def file(self, name: object, key: str, must_exist: bool = True) -> Path:
        """The file ``name`` (the value of ``key``) names inside DATA_DIR: a regular file,
        never one outside it; :class:`DataError` naming the manifest and the key otherwise."""
        return file_inside(self.data_dir, name, self.path, key, DataError, must_exist)

    def split_names(self, with_references: bool = False) -> list[str]:
        splits = self.raw.get("splits")
        if not isinstance(splits, Mapping):
            return []
        return [
            s
            for s, v in splits.items()
            if not with_references or (isinstance(v, Mapping) and "references" in v)
        ]

    def references(self, split: str) -> dict[str, References]:
        """{"de-en": References, ...} of ``splits.<split>.references`` (paths relative to
        DATA_DIR), sorted by name; every file must exist and, where the manifest records its
        sha256 (``references.<name>.sha256.{src,tgt}``), be the file preprocess wrote."""
        where = self.path
        splits = self.raw.get("splits")
        if not isinstance(splits, Mapping):
            raise DataError(f"{where}: key splits: missing or not an object")
        if split not in splits:
            known = ", ".join(self.split_names(with_references=True))
            raise DataError(
                f"{where}: no split {split!r} (splits with references: {known or 'none'})"
            )
        refs = splits[split].get("references") if isinstance(splits[split], Mapping) else None
        if not isinstance(refs, Mapping) or not refs:
            raise DataError(f"{where}: split {split!r} has no references")
        out: dict[str, References] = {}
        for name, entry in sorted(refs.items()):
            parts = name.split("-")
            key = f"splits.{split}.references.{name}"
            if len(parts) != 2 or not all(parts) or not isinstance(entry, Mapping):
                raise DataError(f"{where}: bad reference entry {name!r} in split {split!r}")
            if "src" not in entry or "tgt" not in entry:
                raise DataError(f"{where}: key {key} needs 'src' and 'tgt' paths")
            sums = entry.get("sha256", {})  # absent from manifests of older preprocessing
            if not isinstance(sums, Mapping) or not all(
                isinstance(sums.get(side, ""), str) for side in ("src", "tgt")
            ):
                raise DataError(
                    f"{where}: key {key}.sha256 must be an object of hex digests "
                    f"{{src, tgt}}, got {quote(sums)}"
                )
            src, tgt = (self.file(entry[side], f"{key}.{side}") for side in ("src", "tgt"))
            for side, path in (("src", src), ("tgt", tgt)):
                expected = sums.get(side)
                if expected is not None and sha256_file(path) != expected:
                    # a reference shifted by one line (same count) would score silently
                    raise DataError(
                        f"{path}: not the {split} {name} {side} file preprocess wrote (its "
                        f"sha256 differs from {where}); it was edited, shifted or replaced: "
                        "restore it or preprocess again"
                    )
            out[name] = References(parts[0], parts[1], src, tgt)
        return out


def check_spm_model_name(name: object, where: Path) -> str:
    """The rule for ``spm_model``: a plain file name inside the data directory (the shared
    rule of :func:`formats.files.file_inside`, with no directory part), not a link; the file
    may be missing."""
    problem = name_problem(name)
    if problem is None and "/" in str(name):
        problem = f"{quote(name)} has a directory part; only a plain file name is allowed"
    if problem is not None:
        raise DataError(
            f"{where}: key spm_model must be a file name inside {where.parent}: {problem}"
        )
    file_inside(where.parent, name, where, "spm_model", DataError, must_exist=False)
    return str(name)


def read_data_manifest(data_dir: str | Path) -> DataManifest:
    """``DATA_DIR/manifest.json``, checked; :class:`DataError` naming the file and key."""
    data_dir = Path(data_dir)
    path = data_dir / MANIFEST
    data, raw = read_json_file(
        path,
        DataError,
        missing=f"missing; {data_dir} is not a preprocessed DATA_DIR (run tools/preprocess_data.py)",
    )

    def bad(key: str, what: str) -> DataError:
        return DataError(f"{path}: key {key} must be {what}, got {quote(data[key])}")

    if "format" in data and data["format"] != FORMAT:
        raise bad("format", repr(FORMAT))
    vocab = data.get("vocab_size")
    if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 5):
        raise bad("vocab_size", "an int > 4")
    langs = data.get("languages", [])
    if not isinstance(langs, list) or not all(isinstance(x, str) and x for x in langs):
        raise bad("languages", "a list of language codes")
    pivot = data.get("pivot", DEFAULT_PIVOT)
    if not isinstance(pivot, str) or not pivot:
        raise bad("pivot", "a language code")
    splits = data.get("splits", {})
    if not isinstance(splits, dict):
        raise bad("splits", "an object")
    spm = check_spm_model_name(data.get("spm_model", DEFAULT_SPM_MODEL), path)
    return DataManifest(
        data_dir=data_dir,
        vocab_size=vocab,
        languages=tuple(langs),
        spm_model=spm,
        pivot=pivot,
        sha256=hashlib.sha256(raw).hexdigest(),  # of the bytes parsed, read once
        raw=MappingProxyType(data),
    )
