"""megatron-branchnorm: very deep encoder-decoder Transformers with BranchNorm on DeepSpeed."""

__version__ = "0.1.0"
