"""Data pipeline: raw corpora -> SentencePiece + indexed datasets -> token-budget batches.

See docs/data.md for the DATA_DIR layout and the manifest. Names are imported on first use, so
the command-line tools (which never build tensors) start without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from megatron_branchnorm.formats.data_dir import DataError

if TYPE_CHECKING:
    from megatron_branchnorm.data.dataset import (
        BatchSampler,
        SampleSource,
        TranslationData,
        open_manifest,
        read_references,
    )
    from megatron_branchnorm.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
    from megatron_branchnorm.data.sampling import temperature_probs

_LAZY = {
    "BatchSampler": "dataset",
    "SampleSource": "dataset",
    "TranslationData": "dataset",
    "open_manifest": "dataset",
    "read_references": "dataset",
    "IndexedDataset": "indexed_dataset",
    "IndexedDatasetWriter": "indexed_dataset",
    "temperature_probs": "sampling",
}

__all__ = [
    "BatchSampler",
    "DataError",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "SampleSource",
    "TranslationData",
    "open_manifest",
    "read_references",
    "temperature_probs",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(f"megatron_branchnorm.data.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
