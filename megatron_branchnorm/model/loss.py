"""Label-smoothed cross entropy over target tokens, padding ignored.

As in fairseq's label_smoothed_cross_entropy: with eps the smoothing and V the vocabulary,
loss = (1 - eps - eps/(V-1)) * nll + eps/(V-1) * sum_v(-log p_v). Sums are returned so that
the trainer normalises once, per target token, across micro-batches and data-parallel ranks.

With lse = logsumexp(z) of a row of logits z: nll = lse - z_y and sum_v(-log p_v) =
V * lse - sum_v z_v, so the loss needs only per-row scalars, never the (N, V) log-probabilities;
its gradient is softmax(z) - (1 - eps - eps_i) onehot(y) - eps_i, written into one (N, V)
buffer in the backward.

Both passes run over row chunks: the forward upcasts one chunk of logits to fp32 at
a time for lse, z_y and sum_v z; the backward computes a chunk's fp32 softmax, scales it and
writes it into its rows of the gradient, in the logits' dtype (fp32 logits: straight into
the gradient). So no (N, V) fp32 buffer exists (bf16 training keeps bf16 logits): the fp32
workspace is a chunk's, about :data:`CHUNK_ELEMENTS` logits (64 MiB), logsumexp's own
temporary included. Chunking changes no row's arithmetic and the row sums still run over all
N rows at once, so the results do not depend on the chunk size (bitwise on the CPU).
"""

from __future__ import annotations

import torch

from megatron_branchnorm.tokens import PAD_ID

CHUNK_ELEMENTS = 1 << 24
"""Logits per row chunk (about: chunks are equal, in whole rows): a chunk's fp32 copy is 64 MiB.

At 4,096 tokens x 64,000 words that is 16 chunks of 256 rows: a workspace of 7% of the bf16
logits and their gradient (954 MB together), where the unchunked loss held 2 x 954 MB of fp32
in its backward. A chunk costs 11 ops in bf16 (4 forward, 7 backward; fp32: 3 and 5), all but
gather and scatter_add_ reading or writing 32-128 MB each: >= 10 us at an H100's 3.3 TB/s,
longer than a kernel launch (5-10 us), so the launches overlap the work. Up to 2^24 logits
(one chunk) the loss launches 5 ops fewer than the unchunked one did."""


def chunk_rows(rows: int, vocab: int, max_elements: int = CHUNK_ELEMENTS) -> int:
    """Rows per chunk of an (rows, vocab) logits matrix: the fewest equal chunks of at most
    ``max_elements`` logits each, rounded up to whole rows (at least 1 row)."""
    chunks = max(1, -(-rows * vocab // max_elements))
    return max(1, -(-rows // chunks))


class _LabelSmoothedCE(torch.autograd.Function):
    """(N, V) logits, (N,) targets, (N,) padding mask, rows per chunk -> per-row (nll, smooth)
    with padding rows 0, both views of one (2, N) fp32 buffer; the backward writes the (N, V)
    gradient chunk by chunk."""

    @staticmethod
    def forward(ctx, logits, target, drop, rows: int):  # noqa: ANN001
        n, v = logits.shape
        stats = torch.empty((3, n), dtype=torch.float32, device=logits.device)
        lse, z_y, z_sum = stats[0], stats[1], stats[2]  # (N,) each
        for s in range(0, n, rows):
            e = min(s + rows, n)
            z = logits[s:e].float()  # (rows, V); no copy when already fp32
            torch.logsumexp(z, dim=-1, out=lse[s:e])
            torch.gather(z, 1, target[s:e, None], out=z_y[s:e, None])
            torch.sum(z, dim=-1, out=z_sum[s:e])
            del z  # before the next chunk's copy: one chunk's workspace at a time
        out = torch.empty((2, n), dtype=torch.float32, device=logits.device)  # (nll, smooth)
        torch.sub(lse, z_y, out=out[0])
        torch.mul(lse, v, out=out[1]).sub_(z_sum)
        out.masked_fill_(drop, 0.0)  # (N,) mask over both rows
        ctx.save_for_backward(logits, target, drop, lse)
        ctx.rows = rows
        return out[0], out[1]

    @staticmethod
    def backward(ctx, g_nll, g_smooth):  # noqa: ANN001
        logits, target, drop, lse = ctx.saved_tensors
        n, v = logits.shape
        # d nll_n / dz = p - onehot(y); d smooth_n / dz = V p - 1 (rows kept only)
        g_nll = g_nll.masked_fill(drop, 0.0)[:, None]  # (N, 1)
        g_smooth = g_smooth.masked_fill(drop, 0.0)[:, None]
        scale = g_nll + v * g_smooth  # (N, 1): the coefficient of p
        neg_nll = -g_nll
        grad = torch.empty((n, v), dtype=logits.dtype, device=logits.device)  # the one buffer
        fp32 = logits.dtype == torch.float32
        for s in range(0, n, ctx.rows):
            e = min(s + ctx.rows, n)
            if fp32:  # straight into the gradient's rows: no workspace
                p = torch.sub(logits[s:e], lse[s:e, None], out=grad[s:e])
            else:  # one fp32 chunk, cast into the gradient's rows at the end
                p = logits[s:e].float().sub_(lse[s:e, None])
            p.exp_().mul_(scale[s:e]).sub_(g_smooth[s:e])  # (rows, V)
            p.scatter_add_(1, target[s:e, None], neg_nll[s:e])
            if not fp32:
                grad[s:e].copy_(p)
            del p  # before the next chunk's copy
        return grad, None, None, None


def label_smoothed_nll_loss(
    logits: torch.Tensor,
    target: torch.Tensor,
    epsilon: float,
    ignore_index: int = PAD_ID,
    rows_per_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits (B, T, V), target (B, T) -> (loss_sum, nll_sum, ntokens) over non-pad targets.

    Computed over chunks of ``rows_per_chunk`` rows of the (B*T, V) logits (default
    :func:`chunk_rows`: chunks of at most about :data:`CHUNK_ELEMENTS` logits)."""
    v = logits.shape[-1]
    logits = logits.reshape(-1, v)  # (N, V)
    target = target.reshape(-1)  # (N,)
    keep = target != ignore_index
    drop = ~keep
    if ignore_index < 0:  # a negative ignore_index cannot be gathered
        target = target.clamp(min=0)
    rows = rows_per_chunk or chunk_rows(logits.shape[0], v)
    nll, smooth = _LabelSmoothedCE.apply(logits, target, drop, int(rows))
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
