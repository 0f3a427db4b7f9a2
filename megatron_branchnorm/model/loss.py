"""Label-smoothed cross entropy over target tokens, padding ignored.

As in fairseq's label_smoothed_cross_entropy: with eps the smoothing and V the vocabulary,
loss = (1 - eps - eps/(V-1)) * nll + eps/(V-1) * sum_v(-log p_v). Sums are returned so that
the trainer normalises once, per target token, across micro-batches and data-parallel ranks.

With lse = logsumexp(z) of a row of logits z: nll = lse - z_y and sum_v(-log p_v) =
V * lse - sum_v z_v, so the loss needs only per-row scalars, never the (N, V) log-probabilities;
its gradient is softmax(z) - (1 - eps - eps_i) onehot(y) - eps_i, written into one (N, V)
buffer in the backward. Logits are upcast to fp32 once (bf16 training keeps bf16 logits).
"""

from __future__ import annotations

import torch

from megatron_branchnorm.tokens import PAD_ID


class _LabelSmoothedCE(torch.autograd.Function):
    """(N, V) logits, (N,) targets, (N,) keep mask -> per-row (loss, nll), fused backward."""

    @staticmethod
    def forward(ctx, logits, target, keep, epsilon: float):  # noqa: ANN001
        z = logits.float()  # (N, V); no copy when already fp32
        lse = torch.logsumexp(z, dim=-1)  # (N,)
        z_y = z.gather(1, target[:, None]).squeeze(1)
        nll = (lse - z_y).masked_fill(~keep, 0.0)
        smooth = (z.shape[1] * lse - z.sum(dim=-1)).masked_fill(~keep, 0.0)
        ctx.save_for_backward(logits, target, keep, lse)
        ctx.epsilon = epsilon
        return nll, smooth

    @staticmethod
    def backward(ctx, g_nll, g_smooth):  # noqa: ANN001
        logits, target, keep, lse = ctx.saved_tensors
        # d nll_n / dz = p - onehot(y); d smooth_n / dz = V p - 1 (rows kept only)
        g_nll = g_nll.masked_fill(~keep, 0.0)[:, None]  # (N, 1)
        g_smooth = g_smooth.masked_fill(~keep, 0.0)[:, None]
        v = logits.shape[1]
        grad = logits.float().sub(lse[:, None]).exp_()  # p, (N, V): the one full buffer
        grad.mul_(g_nll + v * g_smooth).sub_(g_smooth)
        grad.scatter_add_(1, target[:, None], -g_nll)
        return grad.to(logits.dtype), None, None, None


def label_smoothed_nll_loss(
    logits: torch.Tensor, target: torch.Tensor, epsilon: float, ignore_index: int = PAD_ID
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits (B, T, V), target (B, T) -> (loss_sum, nll_sum, ntokens) over non-pad targets."""
    v = logits.shape[-1]
    target = target.reshape(-1)
    keep = target != ignore_index
    nll, smooth = _LabelSmoothedCE.apply(
        logits.reshape(-1, v), target.clamp(min=0), keep, float(epsilon)
    )
    nll, smooth = nll.sum(), smooth.sum()
    eps_i = epsilon / (v - 1)
    loss = (1.0 - epsilon - eps_i) * nll + eps_i * smooth
    return loss, nll, keep.sum()


def reference_label_smoothed_nll_loss(
    logits: torch.Tensor, target: torch.Tensor, epsilon: float, ignore_index: int = PAD_ID
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unfused form (full log-probabilities through autograd), kept as the tests'
    reference for :func:`label_smoothed_nll_loss`."""
    lprobs = torch.log_softmax(logits.float(), dim=-1).view(-1, logits.shape[-1])  # (B*T, V)
    target = target.reshape(-1)
    keep = target != ignore_index
    nll = -lprobs.gather(1, target.clamp(min=0).unsqueeze(1)).squeeze(1)
    smooth = -lprobs.sum(dim=-1)
    nll = nll.masked_fill(~keep, 0.0).sum()
    smooth = smooth.masked_fill(~keep, 0.0).sum()
    eps_i = epsilon / (lprobs.shape[-1] - 1)
    loss = (1.0 - epsilon - eps_i) * nll + eps_i * smooth
    return loss, nll, keep.sum()
