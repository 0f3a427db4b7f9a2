"""Data pipeline: raw corpora -> SentencePiece + indexed datasets -> token-budget batches.

See docs/data.md for the DATA_DIR layout and the manifest.
"""

from megatron_branchnorm.data.dataset import (
    BatchSampler,
    SampleSource,
    TranslationData,
    open_manifest,
    read_references,
)
from megatron_branchnorm.data.errors import DataError
from megatron_branchnorm.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from megatron_branchnorm.data.sampling import temperature_probs

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
