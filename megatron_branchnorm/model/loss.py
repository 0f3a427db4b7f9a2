"""Label-smoothed cross entropy over target tokens, padding ignored.

As in fairseq's label_smoothed_cross_entropy: with eps the smoothing and V the vocabulary,
loss = (1 - eps - eps/(V-1)) * nll + eps/(V-1) * sum_v(-log p_v). Sums are returned so that
the trainer normalises once, per target token, across micro-batches and data-parallel ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_branchnorm.tokens import PAD_ID


def label_smoothed_nll_loss(
    logits: torch.Tensor, target: torch.Tensor, epsilon: float, ignore_index: int = PAD_ID
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits (B, T, V), target (B, T) -> (loss_sum, nll_sum, ntokens) over non-pad targets."""
    lprobs = F.log_softmax(logits.float(), dim=-1).view(-1, logits.shape[-1])  # (B*T, V)
    target = target.reshape(-1)
    keep = target != ignore_index
    nll = -lprobs.gather(1, target.clamp(min=0).unsqueeze(1)).squeeze(1)
    smooth = -lprobs.sum(dim=-1)
    nll = nll.masked_fill(~keep, 0.0).sum()
    smooth = smooth.masked_fill(~keep, 0.0).sum()
    eps_i = epsilon / (lprobs.shape[-1] - 1)
    loss = (1.0 - epsilon - eps_i) * nll + eps_i * smooth
    return loss, nll, keep.sum()
