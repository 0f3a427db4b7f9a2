"""DeepSpeed's checkpoint engine with a load that unpickles no code.

Every file DeepSpeed 0.19.8 reads when it resumes a pipeline checkpoint goes through its
engine's ``checkpoint_engine.load``: the stage's engine state (``SDLoader`` in
runtime/state_dict_factory.py, from ``DeepSpeedEngine._load_checkpoint``), the layer files
(``PipelineModule.load_state_dir``, given the engine's checkpoint engine by the pipeline
engine's ``load_module_state_dict``) and the bf16 and ZeRO optimizer files
(``_get_all_zero_checkpoint_state_dicts``). Its ``TorchCheckpointEngine`` reads them with
``torch.load(weights_only=False)``: a pickle there runs code. Ours reads them with
``weights_only=True`` and the few DeepSpeed types of
:data:`megatron_branchnorm.formats.checkpoint.ALLOWED_GLOBALS`; saving is DeepSpeed's.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

from megatron_branchnorm.config import ConfigError
from megatron_branchnorm.formats import checkpoint as ckpt


def allowed_globals() -> list[type]:
    """The DeepSpeed types named in ``ALLOWED_GLOBALS``, imported by their qualified names."""
    found = []
    for name in ckpt.ALLOWED_GLOBALS:
        module, _, attr = name.rpartition(".")
        found.append(getattr(importlib.import_module(module), attr))
    return found


class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch checkpoint engine whose ``load`` reads with ``weights_only=True``
    (tensors, containers, numbers, strings and ``ALLOWED_GLOBALS``); a file holding anything
    else is refused with a CheckpointError naming it, and nothing in it is run."""

    def load(self, path: str, map_location=None):
        """The object saved in ``path`` (DeepSpeed's signature)."""
        return ckpt.load_torch_file(Path(path), map_location, allowed_globals())


def install_checkpoint_engine(engine, ds_config_path: str) -> None:
    """Make ``engine`` read checkpoints through :class:`WeightsOnlyCheckpointEngine` (call it
    before ``load_checkpoint``). DeepSpeed's other engines (its JSON's ``checkpoint.writer``,
    ``datastates``) load with pickles of their own: a ConfigError naming the JSON."""
    current = engine.checkpoint_engine
    if isinstance(current, WeightsOnlyCheckpointEngine):
        return
    if type(current) is not TorchCheckpointEngine:
        raise ConfigError(
            f"config key train.deepspeed_config: {ds_config_path}: DeepSpeed's "
            f"{type(current).__name__} is not supported (checkpoints are read with "
            "weights_only=True through DeepSpeed's torch engine); remove the JSON's "
            "checkpoint.writer and datastates settings"
        )
    # built as DeepSpeed builds its own (runtime/engine.py _configure_checkpointing)
    engine.checkpoint_engine = WeightsOnlyCheckpointEngine(engine._config)
