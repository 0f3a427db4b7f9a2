"""The model package: single-device code only (no DeepSpeed import here; see pipeline.py)."""

from megatron_branchnorm.model.encoder_decoder import EncoderDecoder, build_model, fold_to_postln
from megatron_branchnorm.model.loss import label_smoothed_nll_loss
from megatron_branchnorm.model.residual import branchnorm_alpha, deepnorm_constants

__all__ = [
    "EncoderDecoder",
    "build_model",
    "fold_to_postln",
    "label_smoothed_nll_loss",
    "branchnorm_alpha",
    "deepnorm_constants",
]
