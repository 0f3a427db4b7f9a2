"""Multi-head attention through ``scaled_dot_product_attention``, with a key/value cache.

Self-attention uses one fused QKV projection; cross-attention projects queries from the
decoder and keys/values (fused) from the encoder output. Masks are boolean ``[B, S]`` with
True at padding positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

Cache = dict[str, torch.Tensor]


class MultiheadAttention(nn.Module):
    """Self- or cross-attention. Parameter names: ``qkv`` (self) or ``q`` + ``kv`` (cross),
    and ``out``."""

    def __init__(self, dim: int, heads: int, dropout: float, cross: bool = False) -> None:
        super().__init__()
        self.dim, self.heads, self.head_dim = dim, heads, dim // heads
        self.cross = cross
        self.dropout = dropout
        if cross:
            self.q = nn.Linear(dim, dim)
            self.kv = nn.Linear(dim, 2 * dim)
        else:
            self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def projections(self) -> list[tuple[nn.Linear, tuple[bool, ...]]]:
        """(linear, is-branch per stacked chunk): value and output are branch projections."""
        if self.cross:
            return [(self.q, (False,)), (self.kv, (False, True)), (self.out, (True,))]
        return [(self.qkv, (False, False, True)), (self.out, (True,))]

    def output_projection(self) -> nn.Linear:
        """The last linear map of the sublayer (where a residual scale folds in)."""
        return self.out

    def _split(self, x: torch.Tensor, n: int) -> list[torch.Tensor]:
        b, t, _ = x.shape
        x = x.view(b, t, n, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)  # (n, B, H, T, Dh)
        return list(x.unbind(0))

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        causal: bool = False,
        cache: Cache | None = None,
    ) -> torch.Tensor:
        """x: (B, T, C) queries; memory: (B, S, C) for cross-attention; returns (B, T, C).

        With ``cache`` (incremental decoding, T == 1 new position): self-attention appends
        its keys/values to the cache; cross-attention computes them once and reuses them.
        """
        b, t, c = x.shape
        if self.cross:
            q = self._split(self.q(x), 1)[0]
            if cache is not None and "cross_k" in cache:
                k, v = cache["cross_k"], cache["cross_v"]
            else:
                k, v = self._split(self.kv(memory), 2)
                if cache is not None:
                    cache["cross_k"], cache["cross_v"] = k, v
        else:
            q, k, v = self._split(self.qkv(x), 3)  # each (B, H, T, Dh)
            if cache is not None:
                if "self_k" in cache:
                    k = torch.cat([cache["self_k"], k], dim=2)
                    v = torch.cat([cache["self_v"], v], dim=2)
                cache["self_k"], cache["self_v"] = k, v
        s = k.shape[2]
        attn_mask = None
        if key_padding_mask is not None:
            attn_mask = ~key_padding_mask[:, None, None, :]  # (B, 1, 1, S): True = attend
        if causal and t == 1:
            causal = False  # one new query (the last position) attends to every key
        elif causal and (attn_mask is not None or s != t):
            # Explicit causal mask: query i sits at position s - t + i (after s - t cached
            # keys) and sees keys 0 .. s - t + i; SDPA's is_causal aligns top-left instead.
            allowed = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)  # (T, S)
            attn_mask = allowed if attn_mask is None else attn_mask & allowed
            causal = False
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=causal and attn_mask is None,
        )  # (B, H, T, Dh)
        y = y.transpose(1, 2).reshape(b, t, c)
        return self.out(y)


def reorder_cache(caches: list[Cache], new_order: torch.Tensor, cross: bool = True) -> None:
    """Select batch rows of every cached key/value in place (beam search).

    ``cross=False`` leaves the cross-attention keys/values as they are: they depend only on
    the source sentence, so a reorder among the beams of one sentence does not change them.
    """
    for cache in caches:
        for key, value in cache.items():
            if cross or not key.startswith("cross_"):
                cache[key] = value.index_select(0, new_order)
