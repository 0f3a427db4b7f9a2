"""DeepSpeed pipeline checkpoint (any number of stages) -> flat model -> export directory.

A checkpoint tag directory holds ``layer_{idx:02d}-model_states.pt`` per pipeline entry (the
index in the layer list; past 99 it has more digits, so files are matched by parsed index,
never sorted as strings), our ``train_config.json`` (resolved config, the index -> module-name
map, the step) and ``checksums.json``, and nothing else: every file is read by a name the
checksums list, after the tag is checked to hold exactly those files and each is verified
against its checksum (``formats.checkpoint.verify_checkpoint``); layer files are read with
``torch.load(weights_only=True)``.

The vocabulary exported with the weights (:func:`checkpoint_vocabulary`) is the tag's own copy
of the training SentencePiece model (``spm.model``, checked against the sha256 recorded in
``train_config.json``); only a checkpoint from before that copy existed falls back to the
DATA_DIR's model, with a warning that it could not be checked.

A bf16 checkpoint's layer files hold the bf16 weights the model computed with; the exact
weights are the fp32 master weights of DeepSpeed's BF16 optimizer, one file per stage and
data-parallel rank (:func:`read_master_weights`). Exports and re-laid checkpoints take those.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from megatron_branchnorm.config import ConfigError, config_from_dict
from megatron_branchnorm.errors import UserError
from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.formats import checkpoint_state, train_config
from megatron_branchnorm.formats.checkpoint import SPM_IN_CHECKPOINT, TRAIN_CONFIG
from megatron_branchnorm.formats.data_dir import MANIFEST, DataManifest, read_data_manifest
from megatron_branchnorm.formats.files import one_line, quote
from megatron_branchnorm.formats.records import BEST_FILE, read_best, read_best_ids
from megatron_branchnorm.model import EncoderDecoder, build_model
from megatron_branchnorm.parallel.partition import (
    engine_param_to_flat_key,
    partition_plan,
    pipe_to_flat_key,
)


class ConvertError(UserError, ValueError):
    """A checkpoint that cannot be converted: the message names the file."""


def best_tags(save_dir: Path) -> list[str]:
    """The checkpoints ``save_dir/best.json`` names, best first (train.keep_best). Each must
    still be the checkpoint that was ranked: a tag rewritten since (a rollback trained again)
    has another checkpoint id, and its rank is stale until the trainer's next save writes
    best.json again (an older best.json records no ids and is taken as it is)."""
    path = save_dir / BEST_FILE
    tags = read_best(save_dir)
    ids = read_best_ids(save_dir)
    for t in tags:
        if ckpt.tag_step(t) is None or not (save_dir / t / ckpt.MANIFEST).is_file():
            raise ConvertError(f"{path}: names {quote(t)}, not a complete checkpoint of {save_dir}")
        if t in ids and ckpt.checkpoint_id(save_dir / t) != ids[t]:
            raise ConvertError(
                f"{path}: ranks a {t} that has been rewritten since (its {ckpt.MANIFEST} "
                "changed, e.g. a rollback trained again): the ranking is stale until the "
                "trainer's next save; name a --tag instead"
            )
    return tags


def resolve_tags(
    save_dir: Path, tag: str | None, average_last: int = 1, average_best: int = 0
) -> list[str]:
    """The tag(s) to read: ``tag`` (``best``: the best checkpoint) or ``latest``; with
    ``average_last`` K the K newest complete checkpoints up to that tag; with
    ``average_best`` K the K best (``best.json``), in step order."""
    if not save_dir.is_dir():
        what = "does not exist" if not save_dir.exists() else "is not a directory"
        raise ConvertError(f"--checkpoint {save_dir}: {what} (the train.save_dir of a run)")
    if average_last < 1:
        raise ConvertError(f"--average-last must be >= 1, got {average_last}")
    if average_best:
        best = best_tags(save_dir)
        if len(best) < average_best:
            raise ConvertError(
                f"{save_dir}: --average-best {average_best} but best.json names {len(best)} "
                "checkpoint(s) (train.keep_best)"
            )
        return sorted(best[:average_best], key=ckpt.tag_step)
    if tag == "best":
        best = best_tags(save_dir)
        if not best:
            raise ConvertError(f"{save_dir}: best.json names no checkpoint yet")
        tag = best[0]
    if tag is None:
        tag = ckpt.read_latest(save_dir)
        if tag is None:
            raise ConvertError(f"{save_dir}: no checkpoint (no {ckpt.LATEST!r} file)")
        if not ckpt.is_tag(tag):
            raise ConvertError(
                f"{save_dir / ckpt.LATEST}: names {quote(tag)}, not a {ckpt.TAG_PREFIX}N tag"
            )
    elif not ckpt.is_tag(tag):
        raise ConvertError(f"--tag {quote(tag)}: expected a tag like {ckpt.tag_for(4000)}")
    if not (save_dir / tag).is_dir():
        raise ConvertError(f"{save_dir / tag}: no such checkpoint")
    if average_last == 1:
        return [tag]
    step = ckpt.tag_step(tag)
    complete = [
        s for s in (ckpt.tag_step(t) for t in ckpt.checkpoint_tags(save_dir)[0]) if s <= step
    ]
    if len(complete) < average_last:
        raise ConvertError(
            f"{save_dir}: --average-last {average_last} but only {len(complete)} complete "
            f"checkpoints up to {tag}"
        )
    return [ckpt.tag_for(s) for s in complete[-average_last:]]


def dataset_of(tag_dir: Path) -> str | None:
    """The ``data.dataset`` a checkpoint was trained on (None for synthetic data or when the
    config cannot be read: the caller reports that when it loads the checkpoint). The tag
    must hold exactly what its checksums list before its ``train_config.json`` is read."""
    try:
        ckpt.check_listing(tag_dir)
        return _dataset(train_config.read_train_record(tag_dir))
    except ckpt.CheckpointError:
        return None


def _dataset(record: train_config.TrainConfigRecord) -> str | None:
    """:func:`dataset_of` from a record already read."""
    data = record.config_value("data.dataset")
    return data if isinstance(data, str) and data and data != "synthetic" else None


def trained_directions(tag_dir: Path) -> tuple[list[str] | None, str | None]:
    """(the directions a checkpoint was trained on, or None; a one-line warning when they
    cannot be known), for export.json ``directions``: the ``directions`` of its DATA_DIR's
    manifest, when that manifest is still the one the checkpoint recorded
    (``data_manifest_sha256`` of train_config.json). None without a warning for synthetic
    data (no text to translate) and for a checkpoint that recorded no manifest (older ones:
    nothing to check the DATA_DIR against)."""
    record = train_config.read_train_record(tag_dir)
    data, recorded = _dataset(record), record.data_manifest_sha256
    if data is None or recorded is None:
        return None, None
    unknown = "the export records no trained directions (translate refuses only a language "
    unknown += "into itself without --zero-shot)"
    try:
        manifest = read_data_manifest(data)
    except UserError as exc:
        return None, f"{one_line(str(exc), 300)}: {unknown}"
    if recorded != manifest.sha256:
        why = f"was trained on another version of {manifest.path} (its sha256 differs)"
        return None, f"{tag_dir} {why}: {unknown}"
    dirs = manifest.raw.get("directions")
    ok = isinstance(dirs, list) and dirs and all(isinstance(d, str) for d in dirs)
    if not ok or not all(len(d.split("-")) == 2 and all(d.split("-")) for d in dirs):
        return None, f"{manifest.path}: key directions is not a list of src-tgt: {unknown}"
    return sorted(dirs), None


def read_checkpoint(
    tag_dir: Path, verify: bool = True, indices: set[int] | None = None
) -> tuple[train_config.TrainConfigRecord, dict[str, torch.Tensor]]:
    """(``train_config.json``'s record, flat state dict) of one checkpoint directory
    (:func:`megatron_branchnorm.formats.checkpoint_state.read_checkpoint` with the flat model's
    keys)."""
    return checkpoint_state.read_checkpoint(
        tag_dir, pipe_to_flat_key, verify=verify, indices=indices
    )


def read_master_weights(tag_dir: Path, names: dict[int, str]) -> dict[str, torch.Tensor]:
    """The fp32 master weights of a bf16 checkpoint by the flat model's keys; {} when it has
    none (:func:`megatron_branchnorm.formats.checkpoint_state.read_master_weights`)."""
    return checkpoint_state.read_master_weights(
        tag_dir, lambda name: engine_param_to_flat_key(name, names)
    )


def _apply_master_weights(
    tag_dir: Path, names: dict[int, str], state: dict[str, torch.Tensor]
) -> bool:
    """Replace ``state``'s bf16-rounded weights by the fp32 master weights, when the
    checkpoint has them; True when it did."""
    master = read_master_weights(tag_dir, names)
    if not master:
        return False
    if set(master) != set(state):
        odd = sorted(set(master) ^ set(state))[:3]
        raise ConvertError(f"{tag_dir}: bf16 master weights do not match the layer files: {odd}")
    for key, value in master.items():
        if value.numel() != state[key].numel():
            raise ConvertError(
                f"{tag_dir}: bf16 master weight {key} has {value.numel()} values, its layer "
                f"file {state[key].numel()}"
            )
        state[key] = value.view_as(state[key]).clone()
    return True


def load_pipeline_checkpoint(
    save_dir: str | Path, tag: str | None = None, average_last: int = 1, average_best: int = 0
) -> tuple[EncoderDecoder, dict]:
    """The flat model of a pipeline checkpoint (at the checkpoint's BranchNorm step), and
    provenance for the export's metadata."""
    save_dir = Path(save_dir)
    tags = resolve_tags(save_dir, tag, average_last, average_best)
    infos, states = [], []
    masters = []
    for t in tags:
        info, state = read_checkpoint(save_dir / t)
        names = info.need("spec_names")
        masters.append(_apply_master_weights(save_dir / t, names, state))
        infos.append(info)
        states.append(state)
    try:
        if infos[-1].config is None:
            raise KeyError("config")  # the message a missing config has always had
        cfg = config_from_dict(infos[-1].config)
    except (KeyError, ConfigError) as exc:
        where = save_dir / tags[-1] / TRAIN_CONFIG
        raise ConvertError(f"{where}: bad config: {one_line(str(exc), 300)}") from None
    model = build_model(cfg.model, seed=cfg.train.seed)
    if len(states) > 1:
        from megatron_branchnorm.inference.export import average_state_dicts

        state = average_state_dicts(states)
    else:
        state = states[0]
    expected = set(model.state_dict())
    missing, extra = expected - set(state), set(state) - expected
    if missing:
        raise ConvertError(
            f"{save_dir / tags[-1]}: no weights for {sorted(missing)[:3]} "
            f"({len(missing)} tensors): a layer file is missing"
        )
    if extra:
        raise ConvertError(f"{save_dir / tags[-1]}: unexpected tensors {sorted(extra)[:3]}")
    model.load_state_dict(state, strict=True)
    step = infos[-1].need("step")
    model.set_step(step)  # alpha of the last applied update
    model.eval()
    meta = {
        "source_checkpoint": str(save_dir.resolve()),
        "tag": tags[-1],
        "averaged": tags if len(tags) > 1 else [],
        "pipeline_stages": len(infos[-1].need("parts")) - 1,
        "data": cfg.data.dataset,
        "weights": "fp32 master weights (bf16 training: DeepSpeed's BF16 optimizer)"
        if all(masters)
        else "layer files",
    }
    return model, meta


# --------------------------------------------------------------------------------------------
# The vocabulary exported with the weights
# --------------------------------------------------------------------------------------------

_TAG_PIECE = re.compile(r"^<2([^<>\s]+)>$")


@dataclass
class Vocabulary:
    """The SentencePiece model to export with a checkpoint's weights."""

    spm_path: Path | None = None
    spm_sha256: str | None = None
    source: str = "none"
    """``checkpoint`` (the tag's own copy, checked), ``data`` (DATA_DIR's, checked against
    the recorded sha256), ``data-unchecked`` (an older checkpoint) or ``none``."""
    languages: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    """One-line warnings for stderr."""

    def provenance(self) -> dict:
        """What export.json records about the vocabulary."""
        return {"source": self.source, "spm_sha256": self.spm_sha256}


def _spm_languages(path: Path) -> list[str]:
    """The languages of the ``<2xx>`` tags of a SentencePiece model (sorted)."""
    import sentencepiece as spm

    try:
        sp = spm.SentencePieceProcessor(model_file=str(path))
    except (OSError, RuntimeError) as exc:
        raise ConvertError(f"{path}: not a readable SentencePiece model ({exc})") from None
    langs = []
    for i in range(sp.get_piece_size()):
        match = _TAG_PIECE.match(sp.id_to_piece(i))
        if match:
            langs.append(match.group(1))
    return sorted(langs)


def data_spm_model(data_dir: str | Path) -> tuple[Path | None, DataManifest | None, str | None]:
    """(the DATA_DIR's SentencePiece model or None, its manifest or None, why it is None).

    The manifest's ``spm_model`` must be a plain file name inside DATA_DIR (the manifest
    reader's rule): a manifest never makes us copy another file of the machine into an export."""
    manifest_path = Path(data_dir) / MANIFEST
    if not manifest_path.is_file():
        return None, None, f"{manifest_path}: missing"
    manifest = read_data_manifest(data_dir)
    if not manifest.spm_path.is_file():
        why = f"{manifest.spm_path}: missing (named by {manifest_path} key spm_model)"
        return None, manifest, why
    return manifest.spm_path, manifest, None


def checkpoint_vocabulary(save_dir: str | Path, tags: list[str]) -> Vocabulary:
    """The SentencePiece model that belongs to the weights of ``tags`` (one tag, or the tags
    averaged by ``--average-last``), for the export.

    A checkpoint written by this trainer records ``vocab.spm_sha256`` in train_config.json
    and keeps a copy of the model as ``spm.model``: that copy is exported after its sha256 is
    checked (averaged tags must all record the same vocabulary). A checkpoint from before
    (no ``vocab`` key) falls back to DATA_DIR's model, which cannot be checked: a warning
    says so. ``vocab: null`` is synthetic data (no vocabulary)."""
    save_dir = Path(save_dir)
    infos = {t: train_config.read_train_record(save_dir / t) for t in tags}  # vocab checked there
    records = {t: i.vocab for t, i in infos.items() if i.vocab_recorded}
    seen: dict[str | None, str] = {}
    for t, vocab in records.items():
        sha = None if vocab is None else vocab.spm_sha256
        if seen and sha not in seen:
            first_sha, first_tag = next(iter(seen.items()))
            raise ConvertError(
                f"--average-last {len(tags)}: {save_dir / first_tag} and {save_dir / t} were "
                f"trained with different vocabularies (spm_sha256 {_short(first_sha)} vs "
                f"{_short(sha)}); average checkpoints of one vocabulary only"
            )
        seen.setdefault(sha, t)
    out = Vocabulary()
    unrecorded = [t for t in tags if t not in records]
    if records and unrecorded:
        out.warnings.append(
            f"{', '.join(str(save_dir / t) for t in unrecorded)}: no vocabulary recorded "
            "(older checkpoint): cannot check it is the one of the other averaged tags"
        )
    last = tags[-1]
    data = dataset_of(save_dir / last)
    if records:
        ref_tag = [t for t in tags if t in records][-1]
        vocab = records[ref_tag]
        if vocab is None:
            return out  # synthetic data: no vocabulary
        expected = vocab.spm_sha256
        for t in reversed([t for t in tags if t in records]):
            path = save_dir / t / SPM_IN_CHECKPOINT
            if path.is_file():
                actual = ckpt.sha256_file(path)
                if actual != expected:
                    raise ConvertError(
                        f"{path}: sha256 {_short(actual)} is not the vocabulary recorded in "
                        f"{save_dir / t / TRAIN_CONFIG} (vocab.spm_sha256 "
                        f"{_short(expected)})"
                    )
                out.spm_path, out.spm_sha256, out.source = path, actual, "checkpoint"
                out.languages = _spm_languages(path)
                return out
        # Recorded but no copy kept: DATA_DIR's model, if it is the recorded one.
        path, manifest, why = data_spm_model(data) if data else (None, None, "no data.dataset")
        if path is None:
            out.warnings.append(
                f"{save_dir / ref_tag}: no {SPM_IN_CHECKPOINT} and {why}: exporting without "
                "a SentencePiece model"
            )
            return out
        actual = ckpt.sha256_file(path)
        if actual != expected:
            raise ConvertError(
                f"{path}: not the vocabulary the checkpoint was trained with (sha256 "
                f"{_short(actual)}, {save_dir / ref_tag / TRAIN_CONFIG} records "
                f"{_short(expected)}; was {data} preprocessed again?) and "
                f"{save_dir / ref_tag} has no {SPM_IN_CHECKPOINT} of its own"
            )
        out.spm_path, out.spm_sha256, out.source = path, actual, "data"
        out.languages = list(manifest.languages) or _spm_languages(path)
        return out
    # An older checkpoint: no record of its vocabulary.
    if data is None:
        return out
    path, manifest, why = data_spm_model(data)
    if path is None:
        out.warnings.append(
            f"{save_dir / last}: no {SPM_IN_CHECKPOINT} and {why}: exporting without a "
            "SentencePiece model"
        )
        return out
    model_vocab = _model_vocab_size(infos[last])
    data_vocab = manifest.vocab_size
    if isinstance(model_vocab, int) and isinstance(data_vocab, int) and model_vocab != data_vocab:
        raise ConvertError(
            f"{manifest.path}: vocab_size {data_vocab}, but the checkpoint's model "
            f"has {model_vocab}: {data} was preprocessed again after training, and "
            f"{save_dir / last} has no {SPM_IN_CHECKPOINT} of its own"
        )
    out.spm_path, out.spm_sha256, out.source = path, ckpt.sha256_file(path), "data-unchecked"
    out.languages = list(manifest.languages)
    out.warnings.append(
        f"{save_dir / last} records no vocabulary (a checkpoint from before spm.model was "
        f"saved with the weights): exporting {path}, which could not be checked against them"
    )
    return out


def _short(sha: str | None) -> str:
    return "none (synthetic data)" if sha is None else f"{sha[:12]}..."


def _model_vocab_size(info: train_config.TrainConfigRecord) -> int | None:
    value = info.config_value("model.vocab_size")
    return value if isinstance(value, int) else None


# --------------------------------------------------------------------------------------------
# Re-laying a checkpoint out for another number of stages
# --------------------------------------------------------------------------------------------


def repartition_checkpoint(
    save_dir: str | Path, out_dir: str | Path, stages: int, tag: str | None = None
) -> Path:
    """Re-lay a checkpoint out for ``stages`` pipeline stages into a new save_dir.

    Layer files are named by their index in the layer list, so they are copied unchanged
    (their exports are byte-identical), with the tag's ``spm.model``; a bf16 checkpoint's
    layer files are written with its fp32 master weights instead (:func:`read_master_weights`); the plan in
    ``train_config.json`` is recomputed (balanced). Weights only: the optimizer state stays
    behind, and a run resumed from the result starts Adam afresh (with a warning). The trainer
    needs no re-laid copy to keep the whole state: it resumes the original save_dir in any
    layout itself (docs/design.md §17). ``out_dir`` must not exist or be empty (a save_dir
    is never replaced: it may hold a run) and must not overlap ``save_dir``.
    """
    import os
    import shutil

    from megatron_branchnorm.formats.dirs import TEMP_MARKER
    from megatron_branchnorm.formats.outputs import refuse_overlap, temp_dir_beside

    save_dir, out_dir = Path(save_dir), Path(out_dir)
    refuse_overlap(out_dir, [("--checkpoint", save_dir)], "--output")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ConvertError(
            f"--output {out_dir}: already exists and is not empty (a re-laid checkpoint goes "
            "into a new save_dir; it never replaces one)"
        )
    (tag,) = resolve_tags(save_dir, tag)
    src = save_dir / tag
    manifest = ckpt.verify_checkpoint(src)
    info, _ = read_checkpoint(src, verify=False, indices=set())
    cfg = config_from_dict(info.need("config"))
    method = (
        cfg.pipeline.partition
        if cfg.pipeline.partition in ("balanced", "uniform")
        else ("balanced")
    )
    try:
        parts = partition_plan(cfg.model, stages, method)
    except ConfigError as exc:
        raise ConvertError(f"--repartition {stages}: {one_line(str(exc), 300)}") from None
    tmp = temp_dir_beside(out_dir, "convert_checkpoint")  # marked: never another's removed
    try:
        (tmp / tag).mkdir()
        names = info.need("spec_names")
        master = read_master_weights(src, names)  # bf16: the optimizer files stay behind
        for path in ckpt.listed_files(src, manifest):  # the verified names, no listing
            idx = ckpt.layer_index(path.name)
            if path.name == SPM_IN_CHECKPOINT or (idx is not None and not master):
                shutil.copyfile(path, tmp / tag / path.name)
            elif idx is not None:  # the layer file with its fp32 master weights
                layer = checkpoint_state.read_layer_file(path)
                for key, value in layer.items():
                    exact = master[pipe_to_flat_key(names[idx], key)]
                    layer[key] = exact.view(value.shape).clone()
                torch.save(layer, tmp / tag / path.name)
        config = copy.deepcopy(info.need("config"))
        config["pipeline"] = {**config.get("pipeline", {}), "stages": stages, "partition": method}
        relaid = replace(
            info,
            parts=tuple(parts),
            repartitioned=True,
            config=config,
            where=tmp / tag / TRAIN_CONFIG,
        )
        train_config.write_train_config(tmp / tag, relaid)
        ckpt.write_manifest(tmp / tag, relaid.need("step"))
        ckpt.write_latest(tmp, tag)
        (tmp / TEMP_MARKER).unlink()
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
