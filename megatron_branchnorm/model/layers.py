"""Encoder and decoder layers. Their forwards never mention a residual scheme: each sublayer
is wrapped in a :class:`~megatron_branchnorm.model.residual.Residual` block that owns it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_branchnorm.config import ModelConfig
from megatron_branchnorm.model.attention import Cache, MultiheadAttention
from megatron_branchnorm.model.dropout import Dropout
from megatron_branchnorm.model.residual import Residual, init_sublayer, layer_generator


class FeedForward(nn.Module):
    """fc2(dropout(act(fc1(x)))): (B, T, C) -> (B, T, C)."""

    def __init__(self, dim: int, hidden: int, activation: str, activation_dropout: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.act = F.relu if activation == "relu" else F.gelu
        self.activation_dropout = Dropout(activation_dropout)

    def projections(self) -> list[tuple[nn.Linear, tuple[bool, ...]]]:
        """Both FFN matrices are branch projections (DeepNet init)."""
        return [(self.fc1, (True,)), (self.fc2, (True,))]

    def output_projection(self) -> nn.Linear:
        """The last linear map of the sublayer."""
        return self.fc2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation_dropout(self.act(self.fc1(x))))


def _residual(cfg: ModelConfig, deepnorm_alpha: float) -> Residual:
    return Residual(
        cfg.residual,
        cfg.hidden_size,
        cfg.dropout,
        deepnorm_alpha,
        cfg.layernorm_eps,
        cfg.layernorm_impl,
    )


class EncoderLayer(nn.Module):
    """Self-attention then FFN, each in a residual block."""

    def __init__(
        self, cfg: ModelConfig, deepnorm_alpha: float, beta: float, seed: int, index: int
    ) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.self_attn = MultiheadAttention(d, cfg.num_attention_heads, cfg.attention_dropout)
        self.ffn = FeedForward(d, cfg.ffn_hidden_size, cfg.activation, cfg.activation_dropout)
        self.self_attn_block = _residual(cfg, deepnorm_alpha)
        self.ffn_block = _residual(cfg, deepnorm_alpha)
        gen = layer_generator(seed, "encoder", index)
        for sublayer in (self.self_attn, self.ffn):
            init_sublayer(sublayer, beta, gen)

    def blocks(self) -> list[tuple[Residual, nn.Module]]:
        """(residual block, its sublayer) pairs, in order."""
        return [(self.self_attn_block, self.self_attn), (self.ffn_block, self.ffn)]

    def forward(self, x: torch.Tensor, pad_mask: torch.Tensor) -> torch.Tensor:
        """x: (B, S, C), pad_mask: (B, S) bool, True at padding -> (B, S, C)."""
        x = self.self_attn_block(x, lambda h: self.self_attn(h, key_padding_mask=pad_mask))
        return self.ffn_block(x, self.ffn)


class DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention to the encoder, FFN: each in a residual block."""

    def __init__(
        self, cfg: ModelConfig, deepnorm_alpha: float, beta: float, seed: int, index: int
    ) -> None:
        super().__init__()
        d, h = cfg.hidden_size, cfg.num_attention_heads
        self.self_attn = MultiheadAttention(d, h, cfg.attention_dropout)
        self.cross_attn = MultiheadAttention(d, h, cfg.attention_dropout, cross=True)
        self.ffn = FeedForward(d, cfg.ffn_hidden_size, cfg.activation, cfg.activation_dropout)
        self.self_attn_block = _residual(cfg, deepnorm_alpha)
        self.cross_attn_block = _residual(cfg, deepnorm_alpha)
        self.ffn_block = _residual(cfg, deepnorm_alpha)
        gen = layer_generator(seed, "decoder", index)
        for sublayer in (self.self_attn, self.cross_attn, self.ffn):
            init_sublayer(sublayer, beta, gen)

    def blocks(self) -> list[tuple[Residual, nn.Module]]:
        """(residual block, its sublayer) pairs, in order."""
        return [
            (self.self_attn_block, self.self_attn),
            (self.cross_attn_block, self.cross_attn),
            (self.ffn_block, self.ffn),
        ]

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor,
        memory_pad_mask: torch.Tensor,
        cache: Cache | None = None,
    ) -> torch.Tensor:
        """x: (B, T, C), memory: (B, S, C), memory_pad_mask: (B, S) -> (B, T, C)."""
        x = self.self_attn_block(x, lambda h: self.self_attn(h, causal=True, cache=cache))
        x = self.cross_attn_block(
            x, lambda h: self.cross_attn(h, memory, memory_pad_mask, cache=cache)
        )
        return self.ffn_block(x, self.ffn)
