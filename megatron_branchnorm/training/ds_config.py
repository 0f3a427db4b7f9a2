"""The DeepSpeed JSON of a run: read, checked, and completed with the keys the YAML config
owns (each setting has one owner; a key set in both is an error), plus the precision checks
that must fail with one line before DeepSpeed fails mid-initialisation."""

from __future__ import annotations

import json
import math
from pathlib import Path

from megatron_branchnorm.config import ConfigError, ExperimentConfig
from megatron_branchnorm.formats.files import MAX_JSON_BYTES, FileShapeError, quote, read_small_file
from megatron_branchnorm.resources import find_ds_config

YAML_OWNED_DS_KEYS = {
    "train_batch_size": "train.micro_batches",
    "train_micro_batch_size_per_gpu": "data.max_tokens",
    "gradient_accumulation_steps": "train.micro_batches",
    "gradient_clipping": "train.clip_grad",
    "optimizer": "train.lr / train.adam_*",
    "scheduler": "train.lr / train.warmup_steps",
}


DS_SCALAR_TYPES: dict[str, dict[str, type]] = {
    "": {
        "steps_per_print": int,
        "wall_clock_breakdown": bool,
        "memory_breakdown": bool,
        "prescale_gradients": bool,
        "gradient_predivide_factor": float,
        "zero_allow_untested_optimizer": bool,
        "dump_state": bool,
        "dataloader_drop_last": bool,
    },
    "fp16": {
        "enabled": bool,
        "loss_scale": float,
        "initial_scale_power": int,
        "loss_scale_window": int,
        "hysteresis": int,
        "consecutive_hysteresis": bool,
        "min_loss_scale": float,
        "auto_cast": bool,
    },
    "bf16": {"enabled": bool, "immediate_grad_update": bool},
    "zero_optimization": {"stage": int},
}
"""Types of the DeepSpeed JSON keys DeepSpeed reads without checking them (a string where a
number belongs fails mid-update as a TypeError); pydantic-validated sections are checked by
DeepSpeed itself at initialisation."""


def check_ds_types(ds: dict, path: Path) -> None:
    """Every key of :data:`DS_SCALAR_TYPES` present in ``ds`` has its type (a finite number
    where a number belongs); a ConfigError naming the JSON and the key otherwise."""
    for section, types_ in DS_SCALAR_TYPES.items():
        values = ds if not section else ds.get(section, {})
        if not isinstance(values, dict):
            raise ConfigError(
                f"{path}: key {section} must be an object, got {type(values).__name__}"
            )
        for key, tp in types_.items():
            if key not in values:
                continue
            v, name = values[key], f"{section}.{key}" if section else key
            ok = isinstance(v, tp) and not (tp is not bool and isinstance(v, bool))
            if tp is float:
                ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            if not ok:
                want = {bool: "true or false", int: "an integer", float: "a finite number"}[tp]
                raise ConfigError(f"{path}: key {name} must be {want}, got {quote(v)}")


def check_precision_supported(ds: dict, path: str) -> None:
    """A ConfigError naming the DeepSpeed JSON when it asks for a precision this machine's
    accelerator cannot run (DeepSpeed itself raises 'Type fp16 is not supported on your
    device' from every rank, mid-initialisation), with what to use instead."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    device = acc.device_name()
    if ds.get("fp16", {}).get("enabled") and not acc.is_fp16_supported():
        instead = (
            "ds_configs/zero1_bf16.json on a GPU with bf16 (A100, H100)"
            if device != "cpu"
            else "ds_configs/cpu_fp32.json (or ds_configs/zero1_bf16.json) on CPU ranks"
        )
        raise ConfigError(
            f"config key train.deepspeed_config: {path}: fp16.enabled is true, but this "
            f"machine's accelerator ({device}) cannot run fp16; use {instead}"
        )
    if ds.get("bf16", {}).get("enabled") and not acc.is_bf16_supported():
        raise ConfigError(
            f"config key train.deepspeed_config: {path}: bf16.enabled is true, but this "
            f"machine's accelerator ({device}) cannot run bf16 (V100 and older GPUs); use "
            "ds_configs/zero1_fp16.json"
        )


def load_ds_config(cfg: ExperimentConfig, dp: int) -> dict:
    """The DeepSpeed JSON with the keys our YAML owns filled in; conflicts are errors."""
    path = find_ds_config(cfg.train.deepspeed_config)  # a shipped name or a file
    if not path.is_file():
        raise ConfigError(f"config key train.deepspeed_config: {path}: no such file")
    try:
        ds = json.loads(read_small_file(path, MAX_JSON_BYTES))
    except FileShapeError as exc:  # a FIFO, a device, a huge file: never read without bound
        raise ConfigError(f"config key train.deepspeed_config: {exc}") from None
    except ValueError as exc:
        raise ConfigError(f"{path}: invalid JSON: {exc}") from None
    if not isinstance(ds, dict):
        raise ConfigError(f"{path}: top level must be an object")
    for key, owner in YAML_OWNED_DS_KEYS.items():
        if key in ds:
            raise ConfigError(f"{path}: key {key} is owned by the YAML config ({owner}); remove it")
    check_ds_types(ds, path)
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    if not 0 <= stage <= 3:
        raise ConfigError(f"{path}: key zero_optimization.stage must be 0, 1, 2 or 3, got {stage}")
    if stage >= 2:
        raise ConfigError(
            f"{path}: zero_optimization.stage={stage}: DeepSpeed pipeline parallelism supports "
            "ZeRO stage 0 or 1 only"
        )
    fp16 = ds.get("fp16", {}).get("enabled", False)
    bf16 = ds.get("bf16", {}).get("enabled", False)
    if fp16 and bf16:
        raise ConfigError(f"{path}: fp16.enabled and bf16.enabled are both true")
    ds["train_micro_batch_size_per_gpu"] = 1  # micro-batches are token-based: 1 "sample" each
    ds["gradient_accumulation_steps"] = cfg.train.micro_batches
    ds["train_batch_size"] = cfg.train.micro_batches * dp
    ds["gradient_clipping"] = cfg.train.clip_grad  # DeepSpeed's default would be 1.0
    ds.setdefault("steps_per_print", 10**9)
    if stage == 1:
        # ZeRO accepts only its listed optimizer types, exactly; ours is a torch.optim.AdamW
        # subclass (it records the fp32 gradient norm), so DeepSpeed would refuse it.
        ds.setdefault("zero_allow_untested_optimizer", True)
    return ds


def precision_of(ds_config: dict) -> str:
    """``fp32`` / ``bf16`` / ``fp16`` with the ZeRO stage: what DeepSpeed's optimizer state
    depends on."""
    kind = "fp32"
    for name in ("bf16", "fp16"):
        if ds_config.get(name, {}).get("enabled"):
            kind = name
    return f"{kind}, ZeRO-{ds_config.get('zero_optimization', {}).get('stage', 0)}"
