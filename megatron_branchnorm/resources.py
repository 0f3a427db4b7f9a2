"""Files shipped inside the package, found the same way from a checkout and an installed copy.

``configs/*.yaml`` (the training configs, ``--config NAME``; ``config.CONFIG_DIR``) and
``ds_configs/*.json`` (the DeepSpeed JSONs, ``ds_configs/README.md``) are package data. The
YAMLs, the docs and the SLURM launchers name a DeepSpeed JSON as ``ds_configs/<name>.json``;
``find_ds_config`` turns that into the shipped file unless a file of that name exists where
the value points.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
DS_CONFIG_DIR = PACKAGE_DIR / "ds_configs"
"""The shipped DeepSpeed JSONs."""

_SHIPPED_PREFIXES = ((), ("ds_configs",), ("megatron_branchnorm", "ds_configs"))


def find_ds_config(value: str | os.PathLike[str]) -> Path:
    """The DeepSpeed JSON that ``train.deepspeed_config = value`` names.

    The value itself when that file exists (absolute, or relative to the working directory);
    otherwise, for a relative ``NAME.json``, ``ds_configs/NAME.json`` or
    ``megatron_branchnorm/ds_configs/NAME.json``, the shipped file of that name when there is
    one; otherwise the value unchanged (the caller reports that there is no such file).
    """
    path = Path(value)
    if path.is_file() or path.is_absolute():
        return path
    if path.parts[:-1] in _SHIPPED_PREFIXES:
        shipped = DS_CONFIG_DIR / path.name
        if shipped.is_file():
            return shipped
    return path
