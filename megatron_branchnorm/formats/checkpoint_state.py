"""Reading a checkpoint's weights and optimizer state, whatever layout saved it: the layer
files (:func:`read_checkpoint`, with ``train_config.json``'s record), the fp32 master weights of
a bf16 run (:func:`read_master_weights`), and Adam's state per parameter
(:func:`read_optimizer_state`), which resume in another layout (docs/design.md §17) and
``convert_checkpoint.py`` take.

The files' names are formats/checkpoint.py's (``LAYER_FILE``, ``ENGINE_FILE``,
``OPTIM_FILE``), and so is the check of a checkpoint before any of it is read
(``verify_checkpoint``); a file is read only by a name its manifest lists
(``listed_files``), never found by a directory listing. The record is formats/train_config.py's. Every file is read with
``torch.load(weights_only=True)``; the one DeepSpeed object pickled in them
(``fragment_address``) is read into a stand-in (:class:`FragmentAddress`), so this module
imports no DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_branchnorm.formats.checkpoint import (
    ENGINE_FILE,
    OPTIM_FILE,
    CheckpointError,
    layer_files,
    listed_files,
    verify_checkpoint,
)
from megatron_branchnorm.formats.files import one_line
from megatron_branchnorm.formats.train_config import TrainConfigRecord, read_train_record

if TYPE_CHECKING:  # torch is imported where tensors are read: the names above stay light
    import torch

# ---- reading a checkpoint's weights ----------------------------------------------------------

FlatKey = Callable[[str, str], str]
"""(module name of a layer-list entry, key in its layer file) -> the flat model's key:
``partition.pipe_to_flat_key``."""


def read_checkpoint(
    tag_dir: Path,
    flat_key: FlatKey,
    verify: bool = True,
    indices: set[int] | None = None,
    info: TrainConfigRecord | None = None,
) -> tuple[TrainConfigRecord, dict[str, torch.Tensor]]:
    """(``train_config.json``'s record, flat state dict in fp32) of one checkpoint directory,
    verified against its checksums unless the caller already did (``verify=False``); with
    ``indices``, only the layer files of those layer-list indices are read. Layer files are
    read with ``torch.load(weights_only=True)``. ``info``: the tag's record when the caller
    has read it already."""
    tag_dir = Path(tag_dir)
    manifest = verify_checkpoint(tag_dir) if verify else None
    if info is None:
        info = read_train_record(tag_dir)
    names = info.need("spec_names")
    state: dict[str, torch.Tensor] = {}
    for idx, path in sorted(layer_files(tag_dir, manifest).items()):
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
    BF16; {}: none, the optimizer state is in the engine files), from the names its manifest
    lists."""
    files: dict[int, dict[int, Path]] = {}
    for path in listed_files(tag_dir):
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
        for path in listed_files(tag_dir):
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
