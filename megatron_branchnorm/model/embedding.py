"""Shared token embeddings (scaled by sqrt(d)) plus sinusoidal positions.

One embedding matrix serves the encoder input, the decoder input and the output projection.
Positions start at 0; channel i < d/2 holds sin(p * w_i), channel d/2 + i holds cos(p * w_i),
w_i = 10000^(-2i/d): the layout Marian uses, so exports need no permutation.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron_branchnorm.config import ModelConfig
from megatron_branchnorm.model.dropout import Dropout
from megatron_branchnorm.model.residual import layer_generator
from megatron_branchnorm.tokens import PAD_ID


def sinusoidal_table(num_positions: int, dim: int) -> torch.Tensor:
    """(P, C) table: [sin(p w_0..w_{d/2-1}), cos(p w_0..w_{d/2-1})], w_i = 10000^(-2i/d)."""
    half = dim // 2
    inv_freq = torch.exp(torch.arange(half, dtype=torch.float64) * (-2.0 * math.log(10000.0) / dim))
    angles = torch.arange(num_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    table = torch.zeros(num_positions, dim, dtype=torch.float64)
    table[:, :half] = torch.sin(angles)
    table[:, half : 2 * half] = torch.cos(angles)
    return table.float()


class TokenEmbedding(nn.Module):
    """The shared embedding matrix ``weight`` (V, C); row PAD_ID is zero at init."""

    def __init__(self, cfg: ModelConfig, seed: int) -> None:
        super().__init__()
        if cfg.vocab_size is None:
            raise ValueError("config key model.vocab_size: not set (and no data manifest gave it)")
        self.weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        with torch.no_grad():
            self.weight.normal_(
                0.0, cfg.hidden_size**-0.5, generator=layer_generator(seed, "embed", 0)
            )
            self.weight[PAD_ID].zero_()


class Embed(nn.Module):
    """tokens (B, T), E [+ start position] -> dropout(sqrt(d) E[tokens] + P[positions]).

    Holds no weight: the shared matrix E is passed in, so it appears once in state dicts.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.scale = math.sqrt(cfg.hidden_size)
        self.dropout = Dropout(cfg.dropout)
        self.register_buffer(
            "positions", sinusoidal_table(cfg.max_positions, cfg.hidden_size), persistent=False
        )

    def forward(self, tokens: torch.Tensor, weight: torch.Tensor, start: int = 0) -> torch.Tensor:
        t = tokens.shape[1]
        if start + t > self.positions.shape[0]:
            raise ValueError(
                f"sequence of {start + t} positions exceeds model.max_positions="
                f"{self.positions.shape[0]}"
            )
        x = self.scale * F.embedding(tokens, weight, PAD_ID)  # (B, T, C)
        x = x + self.positions[start : start + t].to(x.dtype)
        return self.dropout(x)


def output_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(B, T, C) -> (B, T, V) through the shared embedding matrix (V, C)."""
    return x @ weight.t()
