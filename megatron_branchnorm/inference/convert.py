"""DeepSpeed pipeline checkpoint (any number of stages) -> flat model -> export directory.

A checkpoint tag directory holds ``layer_{idx:02d}-model_states.pt`` per pipeline entry (the
index in the layer list; past 99 it has more digits, so files are matched by parsed index,
never sorted as strings), our ``train_config.json`` (resolved config, the index -> module-name
map, the step) and ``checksums.json``. Every file is verified against the checksums, and layer
files are read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from megatron_branchnorm import checkpoint as ckpt
from megatron_branchnorm.config import config_from_dict
from megatron_branchnorm.model import EncoderDecoder, build_model
from megatron_branchnorm.pipeline import pipe_to_flat_key

LAYER_FILE = re.compile(r"^layer_(\d+)-model_states\.pt$")


class ConvertError(ValueError):
    """A checkpoint that cannot be converted: the message names the file."""


def resolve_tags(save_dir: Path, tag: str | None, average_last: int = 1) -> list[str]:
    """The tag(s) to read: ``tag`` or ``latest``; with ``average_last`` K the K newest
    complete checkpoints up to that tag."""
    if tag is None:
        tag = ckpt.read_latest(save_dir)
        if tag is None:
            raise ConvertError(f"{save_dir}: no checkpoint (no 'latest' file)")
    if not (save_dir / tag).is_dir():
        raise ConvertError(f"{save_dir / tag}: no such checkpoint")
    if average_last <= 1:
        return [tag]
    step = int(tag.removeprefix("global_step"))
    complete = sorted(
        int(p.name.removeprefix("global_step"))
        for p in save_dir.glob("global_step*")
        if (p / ckpt.MANIFEST).is_file() and int(p.name.removeprefix("global_step")) <= step
    )
    if len(complete) < average_last:
        raise ConvertError(
            f"{save_dir}: --average-last {average_last} but only {len(complete)} complete "
            f"checkpoints up to {tag}"
        )
    return [ckpt.tag_for(s) for s in complete[-average_last:]]


def read_checkpoint(
    tag_dir: Path, verify: bool = True, indices: set[int] | None = None
) -> tuple[dict, dict[str, torch.Tensor]]:
    """(saved training info, flat state dict) of one checkpoint directory, verified against
    its checksums unless the caller already did (``verify=False``); with ``indices``, only
    the layer files of those layer-list indices are read."""
    if verify:
        try:
            ckpt.verify_checkpoint(tag_dir)
        except ckpt.CheckpointError as exc:
            raise ConvertError(str(exc)) from None
    info_path = tag_dir / "train_config.json"
    try:
        info = json.loads(info_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConvertError(f"{info_path}: unreadable: {exc}") from None
    names = {int(k): v for k, v in info["spec_names"].items()}
    state: dict[str, torch.Tensor] = {}
    for path in tag_dir.iterdir():
        match = LAYER_FILE.match(path.name)
        if not match:
            continue
        idx = int(match.group(1))
        if idx not in names:
            raise ConvertError(f"{path}: layer index {idx} is not in the saved layout")
        if indices is not None and idx not in indices:
            continue
        try:
            layer = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unreadable file gets its name
            raise ConvertError(f"{path}: cannot read layer file: {exc}") from None
        for key, value in layer.items():
            state[pipe_to_flat_key(names[idx], key)] = value.float()
    return info, state


def load_pipeline_checkpoint(
    save_dir: str | Path, tag: str | None = None, average_last: int = 1
) -> tuple[EncoderDecoder, dict]:
    """The flat model of a pipeline checkpoint (at the checkpoint's BranchNorm step), and
    provenance for the export's metadata."""
    save_dir = Path(save_dir)
    tags = resolve_tags(save_dir, tag, average_last)
    infos, states = [], []
    for t in tags:
        info, state = read_checkpoint(save_dir / t)
        infos.append(info)
        states.append(state)
    cfg = config_from_dict(infos[-1]["config"])
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
    step = int(infos[-1]["step"])
    model.set_step(step)  # alpha of the last applied update
    model.eval()
    meta = {
        "source_checkpoint": str(save_dir.resolve()),
        "tag": tags[-1],
        "averaged": tags if len(tags) > 1 else [],
        "pipeline_stages": len(infos[-1]["parts"]) - 1,
        "data": cfg.data.dataset,
    }
    return model, meta


def repartition_checkpoint(
    save_dir: str | Path, out_dir: str | Path, stages: int, tag: str | None = None
) -> Path:
    """Re-lay a checkpoint out for ``stages`` pipeline stages into a new save_dir.

    Layer files are named by their index in the layer list, so they are copied unchanged
    (their exports are byte-identical); the plan in ``train_config.json`` is recomputed
    (balanced). DeepSpeed's per-stage engine files (optimizer state) cannot be re-laid out:
    a run resumed from the result loads weights by layer and starts the optimizer afresh.
    """
    import shutil

    from megatron_branchnorm.partition import partition_plan

    save_dir, out_dir = Path(save_dir), Path(out_dir)
    (tag,) = resolve_tags(save_dir, tag)
    src = save_dir / tag
    info, _ = read_checkpoint(src)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ConvertError(f"{out_dir}: already exists and is not empty")
    cfg = config_from_dict(info["config"])
    method = (
        cfg.pipeline.partition
        if cfg.pipeline.partition in ("balanced", "uniform")
        else ("balanced")
    )
    parts = partition_plan(cfg.model, stages, method)
    tmp = out_dir.parent / f".{out_dir.name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / tag).mkdir(parents=True)
    for path in src.iterdir():
        if LAYER_FILE.match(path.name):
            shutil.copyfile(path, tmp / tag / path.name)
    info["parts"] = parts
    info["repartitioned"] = True
    info["config"]["pipeline"]["stages"] = stages
    info["config"]["pipeline"]["partition"] = method
    (tmp / tag / "train_config.json").write_text(
        json.dumps(info, indent=1, sort_keys=True), encoding="utf-8"
    )
    ckpt.write_manifest(tmp / tag, int(info["step"]))
    ckpt.write_latest(tmp, tag)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    if out_dir.exists():
        out_dir.rmdir()
    tmp.rename(out_dir)
    return out_dir
