"""The flat encoder-decoder: single process; the reference for tests, inference and export.

model = build_model(cfg.model, seed=1)
model.set_step(t)                               # BranchNorm alpha_t for update t
logits = model(src_tokens, prev_output_tokens)  # (B, T, V)
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

from megatron_branchnorm.config import ModelConfig, validate_model
from megatron_branchnorm.model.attention import (
    Cache,
    DictCache,
    StepCache,
    reorder_cache,
    reorder_step_caches,
)
from megatron_branchnorm.model.embedding import Embed, TokenEmbedding, output_logits
from megatron_branchnorm.model.layers import DecoderLayer, EncoderLayer
from megatron_branchnorm.model.residual import (
    Residual,
    Scheme,
    scheme_of,
    set_branch_scale,
    stack_constants,
    stack_final_norm,
)
from megatron_branchnorm.tokens import PAD_ID


class EncoderDecoder(nn.Module):
    """Transformer encoder-decoder with shared embeddings and one residual scheme."""

    def __init__(self, cfg: ModelConfig, seed: int = 1) -> None:
        super().__init__()
        validate_model(cfg)
        self.cfg = cfg
        (a_enc, b_enc), (a_dec, b_dec) = stack_constants(cfg)
        self.embedding = TokenEmbedding(cfg, seed)
        self.encoder_embed = Embed(cfg)
        self.decoder_embed = Embed(cfg)
        self.encoder_layers = nn.ModuleList(
            EncoderLayer(cfg, a_enc, b_enc, seed, i) for i in range(cfg.encoder_layers)
        )
        self.decoder_layers = nn.ModuleList(
            DecoderLayer(cfg, a_dec, b_dec, seed, i) for i in range(cfg.decoder_layers)
        )
        eps, impl = cfg.layernorm_eps, cfg.layernorm_impl
        self.encoder_final_norm = stack_final_norm(cfg.residual, cfg.hidden_size, eps, impl)
        self.decoder_final_norm = stack_final_norm(cfg.residual, cfg.hidden_size, eps, impl)
        self.step = 0
        self.set_step(1)

    # ---- BranchNorm factor ------------------------------------------------------------------

    def residual_blocks(self) -> list[Residual]:
        """Every residual block of the model, encoder first."""
        return [m for m in self.modules() if isinstance(m, Residual)]

    def set_step(self, step: int) -> float:
        """Set BranchNorm's alpha_t for update ``step`` (from 1); returns alpha_t (1.0 for
        other schemes). A freshly built model is at step 1."""
        self.step = int(step)
        return set_branch_scale(self, self.cfg, step)

    # ---- forward ----------------------------------------------------------------------------

    def encode(self, src_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """src_tokens (B, S) -> (encoder states (B, S, C), padding mask (B, S))."""
        pad_mask = src_tokens.eq(PAD_ID)
        x = self.encoder_embed(src_tokens, self.embedding.weight)
        for layer in self.encoder_layers:
            x = layer(x, pad_mask)
        return self.encoder_final_norm(x), pad_mask

    def decode(
        self,
        prev_output_tokens: torch.Tensor,
        memory: torch.Tensor,
        memory_pad_mask: torch.Tensor,
        caches: list[Cache] | None = None,
        start: int = 0,
    ) -> torch.Tensor:
        """prev_output_tokens (B, T) -> logits (B, T, V); with ``caches`` (one per decoder
        layer), T new positions starting at ``start`` are decoded incrementally."""
        x = self.decode_features(prev_output_tokens, memory, memory_pad_mask, caches, start)
        return output_logits(x, self.embedding.weight)

    def decode_features(
        self,
        prev_output_tokens: torch.Tensor,
        memory: torch.Tensor,
        memory_pad_mask: torch.Tensor,
        caches: list[Cache] | None = None,
        start: int = 0,
    ) -> torch.Tensor:
        """Like :meth:`decode`, but the decoder's final states (B, T, C) instead of logits."""
        x = self.decoder_embed(prev_output_tokens, self.embedding.weight, start)
        for i, layer in enumerate(self.decoder_layers):
            x = layer(x, memory, memory_pad_mask, None if caches is None else caches[i])
        return self.decoder_final_norm(x)

    def forward(self, src_tokens: torch.Tensor, prev_output_tokens: torch.Tensor) -> torch.Tensor:
        """(B, S), (B, T) -> logits (B, T, V)."""
        memory, pad_mask = self.encode(src_tokens)
        return self.decode(prev_output_tokens, memory, pad_mask)

    # ---- incremental decoding ---------------------------------------------------------------

    def new_caches(self) -> list[DictCache]:
        """Empty key/value caches, one per decoder layer."""
        return [{} for _ in self.decoder_layers]

    def new_step_caches(self, max_len: int) -> list[StepCache]:
        """Preallocating caches for up to ``max_len`` one-position steps (beam search), one per
        decoder layer. With them, ``decode_step`` takes memory and its padding mask with one
        row per source sentence, and the token rows in groups of equal size per sentence."""
        return [StepCache(max_len) for _ in self.decoder_layers]

    def decode_step(
        self,
        tokens: torch.Tensor,
        memory: torch.Tensor,
        memory_pad_mask: torch.Tensor,
        caches: list[Cache],
        step: int,
        output_weight_t: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Last tokens (B,) at position ``step`` -> next-token logits (B, V), caches updated.

        ``output_weight_t``: the embedding matrix transposed into a contiguous (C, V) copy
        (:meth:`output_weight_t`), for a faster output matmul when decoding many steps.
        """
        if output_weight_t is None:
            return self.decode(tokens[:, None], memory, memory_pad_mask, caches, start=step)[:, 0]
        x = self.decode_features(tokens[:, None], memory, memory_pad_mask, caches, start=step)
        return x[:, 0] @ output_weight_t

    def output_weight_t(self) -> torch.Tensor:
        """The output projection (the shared embedding matrix) as a contiguous (C, V) copy."""
        return self.embedding.weight.detach().t().contiguous()

    @staticmethod
    def reorder_caches(caches: list[DictCache], new_order: torch.Tensor) -> None:
        """Keep batch rows ``new_order`` of every dict cache."""
        reorder_cache(caches, new_order)

    @staticmethod
    def reorder_step_caches(
        caches: list[StepCache], rows: torch.Tensor | None, sentences: torch.Tensor | None
    ) -> None:
        """Keep token rows ``rows`` and source sentences ``sentences`` of step caches (beam
        search); None leaves that part as it is."""
        reorder_step_caches(caches, rows, sentences)


def build_model(cfg: ModelConfig, seed: int = 1) -> EncoderDecoder:
    """The flat encoder-decoder for ``cfg``; each layer's init is seeded from (seed, layer)."""
    return EncoderDecoder(cfg, seed)


def fold_to_postln(model: EncoderDecoder) -> EncoderDecoder:
    """A vanilla Post-LN model computing the same function as ``model``.

    Each block's residual weight folds into its sublayer's output projection (weight and
    bias): BranchNorm at the model's current alpha_t exactly; DeepNorm up to LayerNorm's
    epsilon (LN(a x + F x) = LN(x + F x / a) only approximately). Pre-LN cannot be folded:
    a scheme folds when it is ``foldable_to_postln`` (model/residual.py).
    """
    scheme = scheme_of(model.cfg)
    if not scheme.foldable_to_postln:
        raise ValueError(f"fold_to_postln: a {scheme.label} model has no Post-LN equivalent")
    cfg = dataclasses.replace(model.cfg, residual=Scheme.POSTLN.name)
    folded = copy.deepcopy(model)
    folded.cfg = cfg
    for layer in list(folded.encoder_layers) + list(folded.decoder_layers):
        for block, sublayer in layer.blocks():
            scale = block.output_scale_for_postln()
            out = sublayer.output_projection()
            with torch.no_grad():
                out.weight.mul_(scale)
                out.bias.mul_(scale)
            block.scheme = Scheme.POSTLN
            block.deepnorm_alpha = 1.0
            block.branch_scale = 1.0
    return folded


def as_postln(model: EncoderDecoder) -> EncoderDecoder:
    """``model`` itself when it already is vanilla Post-LN, else :func:`fold_to_postln` of it
    (no copy of a model that has nothing to fold)."""
    return model if scheme_of(model.cfg) is Scheme.POSTLN else fold_to_postln(model)
