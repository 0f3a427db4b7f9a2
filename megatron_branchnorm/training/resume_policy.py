"""Which config keys a resumed run may change, key by key, and the run's config history.

A checkpoint records the config that trained it (``train_config.json``). On resume, every key
is compared with it: a key in :data:`FIXED` that differs is an error naming the key (the
weights, the alpha_t schedule or the data position in the checkpoint would no longer match
what the config says); every other key may change, and the change is logged and appended to
``SAVE_DIR/config_history.jsonl`` (one record per start: time, step, what changed).
``config.yaml`` in the save_dir is the config of the latest start. Every config key is in
exactly one of :data:`FIXED` (with the reason the error gives) and :data:`MAY_CHANGE`; a test
keeps it so when a key is added. The DeepSpeed JSON's precision and ZeRO stage are compared
apart (``Trainer.maybe_resume``): DeepSpeed's optimizer state differs between them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from megatron_branchnorm.errors import UserError

FIXED: dict[str, str] = {
    "model.encoder_layers": "the architecture of the saved weights",
    "model.decoder_layers": "the architecture of the saved weights",
    "model.hidden_size": "the architecture of the saved weights",
    "model.ffn_hidden_size": "the architecture of the saved weights",
    "model.num_attention_heads": "the architecture of the saved weights",
    "model.vocab_size": "the architecture of the saved weights",
    "model.residual": "the residual scheme the weights were trained under",
    "model.branchnorm_steps": "alpha_t = min(1, t/T) would jump at the resumed step",
    "model.branchnorm_schedule": "alpha_t would jump at the resumed step",
    "model.branch_init": "the init the run started from (an export would misdescribe it)",
    "model.activation": "the function the FFN weights were trained with",
    "model.layernorm_eps": "the LayerNorm the weights were trained with",
    "model.max_positions": "the position table the model was trained with",
    "data.dataset": "the corpus the saved data position refers to (checked by its manifest)",
    "data.max_tokens": "the batches the saved data position counts",
    "data.max_length": "the samples the saved data position counts",
    "data.sampling_temperature": "the sample stream the saved data position refers to",
    "data.synthetic_size": "the synthetic corpus the saved data position refers to",
    "train.seed": "the data order and dropout stream of the run",
}
"""Keys a resume may not change, with the reason given in the error."""

MAY_CHANGE: tuple[str, ...] = (
    "model.dropout",
    "model.attention_dropout",
    "model.activation_dropout",
    "model.layernorm_impl",
    "model.compile",
    "model.cuda_graphs",  # how the layers run, not what they compute
    "model.cuda_graph_link_layers",
    "pipeline.stages",
    "pipeline.fallback_stages",
    "pipeline.data_parallel",
    "pipeline.partition",
    "pipeline.activation_checkpoint_interval",
    "train.max_steps",
    "train.max_time_minutes",
    "train.micro_batches",
    "train.lr",
    "train.warmup_steps",
    "train.warmup_init_lr",
    "train.adam_beta1",
    "train.adam_beta2",
    "train.adam_eps",
    "train.weight_decay",
    "train.label_smoothing",
    "train.clip_grad",
    "train.save_dir",
    "train.save_interval",
    "train.eval_interval",
    "data.valid_samples_per_direction",
    # its own check: the sampler state holds the shapes' digest, and a resume into other
    # shapes is refused in one line naming the key (docs/design.md §18)
    "data.bucket_shapes",
    "train.patience",
    "train.keep_last",
    "train.keep_best",
    "train.best_metric",
    "train.log_interval",
    "train.deepspeed_config",
    "train.max_consecutive_skips",
    "train.collective_timeout_s",
)
"""Keys a resume may change: schedules, intervals, regularisation, the stage layout (weights
are reloaded layer by layer), the optimizer's hyperparameters (applied over the restored
optimizer state), the DeepSpeed JSON's path (its precision and ZeRO stage are checked apart)."""

HISTORY = "config_history.jsonl"


class ResumeConfigError(UserError, ValueError):
    """A resume that changes a fixed key: the message names it."""


def flatten(config: dict[str, Any]) -> dict[str, Any]:
    """``{"model": {"hidden_size": 8}}`` -> ``{"model.hidden_size": 8}``."""
    return {
        f"{section}.{key}": value
        for section, values in config.items()
        for key, value in (values or {}).items()
    }


def changes(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, list]:
    """``{key: [saved value, current value]}`` for every key that differs (keys the saved
    config lacks, from older checkpoints, compare against the current value: not a change)."""
    old, new = flatten(saved), flatten(current)
    return {k: [old[k], v] for k, v in sorted(new.items()) if k in old and old[k] != v}


def check_resume(
    saved: dict[str, Any], current: dict[str, Any], where: str, same_data: bool = False
) -> dict[str, list]:
    """The allowed changes between a checkpoint's config and this run's; raises
    :class:`ResumeConfigError` for the first fixed key that differs. ``same_data``: the
    corpus at the new ``data.dataset`` path is the checkpoint's (same manifest), so a moved
    DATA_DIR is allowed."""
    diff = changes(saved, current)
    for key, (old, new) in diff.items():
        if key == "data.dataset" and same_data:
            continue
        if key in FIXED:
            raise ResumeConfigError(
                f"config key {key}: {new!r} differs from the checkpoint's {old!r} ({where}); "
                f"it cannot change on resume ({FIXED[key]}): set it back, or use a new "
                "train.save_dir"
            )
    return diff


def append_history(save_dir: Path, step: int, resumed_from: str | None, diff: dict) -> None:
    """One record of this start in ``SAVE_DIR/config_history.jsonl``."""
    record = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "step": step,
        "resumed_from": resumed_from,
        "changed": diff,
    }
    with open(save_dir / HISTORY, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record, default=str) + "\n")
