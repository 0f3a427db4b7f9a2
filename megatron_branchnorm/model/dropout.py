"""Dropout whose CPU mask costs a quarter of ``torch.nn.Dropout``'s.

On CPU, ``F.dropout`` draws its mask with ``bernoulli_``: one generator call per element, and
6% of a 12L-12L fp32 training step (docs/performance.md). Here one 64-bit ``random_()`` word
gives four 16-bit lanes, of which 15 bits each are compared with ``round(p * 2**15)``: an
element is kept with probability ``1 - round(p * 2**15) / 2**15`` (p to within 1.5e-5), the
lanes are independent uniform draws, and the mask comes from torch's default generator, so
``torch.manual_seed`` and checkpointed RNG states reproduce it. Kept elements are scaled by
``1 / (1 - p)``; the backward multiplies by the same saved boolean mask.

On other devices (CUDA's dropout is one fused kernel) and in eval mode this is ``F.dropout``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

LANE_BITS = 15  # of each int16 lane: int64 random_() leaves the top bit of the word at 0


def keep_mask(shape: torch.Size, p: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """A boolean mask of ``shape``, each element True with probability ~1 - p."""
    n = shape.numel()
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=device).random_()
    lanes = words.view(torch.int16)[:n].view(shape)
    return (lanes & (2**LANE_BITS - 1)) >= round(p * 2**LANE_BITS)


class _MaskScale(torch.autograd.Function):
    """y = x * keep / (1 - p); dy/dx the same mask and scale."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return torch.mul(x, keep).mul_(scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (keep,) = ctx.saved_tensors
        return torch.mul(grad, keep).mul_(ctx.scale), None, None


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """Functional form of :class:`Dropout`."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or p >= 1.0:
        return F.dropout(x, p, True)
    return _MaskScale.apply(x, keep_mask(x.shape, p, x.device), 1.0 / (1.0 - p))


class Dropout(nn.Module):
    """Drop-in for ``torch.nn.Dropout`` (no parameters, same state dict)."""

    def __init__(self, p: float = 0.1) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability must be in [0, 1], got {p}")
        self.p = float(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"
