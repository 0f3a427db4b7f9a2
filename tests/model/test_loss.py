"""Label-smoothed cross entropy: a hand computation, padding ignored, eps=0 is plain CE; the
loss chunked over rows against the reference and the unchunked loss, its op count
and its peak memory."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_branchnorm.experiments.launches import LaunchCounter
from megatron_branchnorm.model import label_smoothed_nll_loss
from megatron_branchnorm.model.loss import (
    CHUNK_ELEMENTS,
    chunk_rows,
    reference_label_smoothed_nll_loss,
)
from megatron_branchnorm.tokens import PAD_ID


def test_hand_computed_small_case() -> None:
    # One sentence, two target tokens, V = 4, eps = 0.1; the second row's target is id 3.
    logits_rows = [[2.0, 0.5, -1.0, 0.0], [0.1, 0.2, 0.3, 1.5]]
    targets = [1, 3]
    eps, v = 0.1, 4
    expected_loss = expected_nll = 0.0
    for row, y in zip(logits_rows, targets, strict=True):
        log_z = math.log(sum(math.exp(z) for z in row))
        logp = [z - log_z for z in row]
        expected_nll += -logp[y]
        # fairseq's smoothed target: 1 - eps on the gold word, eps / (V - 1) on each other word
        q = [(1 - eps) if k == y else eps / (v - 1) for k in range(v)]
        expected_loss += -sum(qk * lk for qk, lk in zip(q, logp, strict=True))
    logits = torch.tensor([logits_rows])  # (1, 2, 4)
    loss, nll, ntokens = label_smoothed_nll_loss(logits, torch.tensor([targets]), eps)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-6)
    assert nll.item() == pytest.approx(expected_nll, rel=1e-6)
    assert int(ntokens) == 2
    assert loss.item() > nll.item()  # smoothing penalises a confident correct prediction


def test_padding_is_ignored() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    target = torch.randint(4, 11, (2, 5))
    target[0, 3:] = PAD_ID
    target[1, 4] = PAD_ID
    loss, nll, ntokens = label_smoothed_nll_loss(logits, target, 0.1)
    assert int(ntokens) == 7
    # whatever the model predicts at pad positions changes nothing
    other = logits.clone()
    other[0, 3:] = torch.randn(2, 11) * 10
    other[1, 4] = torch.randn(11) * 10
    loss2, nll2, _ = label_smoothed_nll_loss(other, target, 0.1)
    assert loss2.item() == pytest.approx(loss.item(), rel=1e-6)
    assert nll2.item() == pytest.approx(nll.item(), rel=1e-6)
    # and equals the loss over the non-pad rows alone
    keep = target != PAD_ID
    ref, _, _ = label_smoothed_nll_loss(logits[keep][None], target[keep][None], 0.1)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)


def test_pad_positions_get_no_gradient() -> None:
    logits = torch.randn(1, 4, 9, requires_grad=True)
    target = torch.tensor([[5, 6, PAD_ID, PAD_ID]])
    loss, _, _ = label_smoothed_nll_loss(logits, target, 0.1)
    loss.backward()
    assert torch.count_nonzero(logits.grad[0, 2:]) == 0
    assert torch.count_nonzero(logits.grad[0, :2]) > 0


def test_zero_epsilon_is_cross_entropy_sum() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 6, 17)
    target = torch.randint(4, 17, (3, 6))
    target[2, 4:] = PAD_ID
    loss, nll, ntokens = label_smoothed_nll_loss(logits, target, 0.0)
    ce = F.cross_entropy(logits.view(-1, 17), target.view(-1), ignore_index=PAD_ID, reduction="sum")
    torch.testing.assert_close(loss, ce, rtol=1e-6, atol=0)
    torch.testing.assert_close(nll, ce, rtol=1e-6, atol=0)
    assert int(ntokens) == 16


# ---------------------------------------------------------------------------------------------
# Chunked over rows: parity, the chunking rule, op count and peak memory
# ---------------------------------------------------------------------------------------------


class _Unchunked(torch.autograd.Function):
    """The loss before the change (one fp32 copy of the (N, V) logits in the forward, two fp32
    (N, V) buffers in the backward), kept to compare bits, op counts and peak memory with."""

    @staticmethod
    def forward(ctx, logits, target, keep, epsilon: float):  # noqa: ANN001
        z = logits.float()  # (N, V)
        lse = torch.logsumexp(z, dim=-1)
        z_y = z.gather(1, target[:, None]).squeeze(1)
        nll = (lse - z_y).masked_fill(~keep, 0.0)
        smooth = (z.shape[1] * lse - z.sum(dim=-1)).masked_fill(~keep, 0.0)
        ctx.save_for_backward(logits, target, keep, lse)
        return nll, smooth

    @staticmethod
    def backward(ctx, g_nll, g_smooth):  # noqa: ANN001
        logits, target, keep, lse = ctx.saved_tensors
        g_nll = g_nll.masked_fill(~keep, 0.0)[:, None]
        g_smooth = g_smooth.masked_fill(~keep, 0.0)[:, None]
        v = logits.shape[1]
        grad = logits.float().sub(lse[:, None]).exp_()
        grad.mul_(g_nll + v * g_smooth).sub_(g_smooth)
        grad.scatter_add_(1, target[:, None], -g_nll)
        return grad.to(logits.dtype), None, None, None


def _unchunked_loss(
    logits: torch.Tensor, target: torch.Tensor, epsilon: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """label_smoothed_nll_loss as it was before the change."""
    v = logits.shape[-1]
    target = target.reshape(-1)
    keep = target != PAD_ID
    nll, smooth = _Unchunked.apply(logits.reshape(-1, v), target.clamp(min=0), keep, epsilon)
    nll, smooth = nll.sum(), smooth.sum()
    eps_i = epsilon / (v - 1)
    return (1.0 - epsilon - eps_i) * nll + eps_i * smooth, nll, keep.sum()


def _batch(n: int, v: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(2, n/2, v) logits of ``dtype`` and (2, n/2) targets, the last 5 + 9 of them padding."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(2, n // 2, v, generator=g) * 3).to(dtype)
    target = torch.randint(1, v, (2, n // 2), generator=g)
    target[0, -5:] = PAD_ID
    target[1, -9:] = PAD_ID
    return logits, target


def _run(loss_fn, logits: torch.Tensor, target: torch.Tensor, **kwargs):  # noqa: ANN001, ANN202
    """(loss, nll, ntokens, d(0.7 loss + 0.2 nll)/d logits) of ``loss_fn`` at eps 0.1."""
    x = logits.clone().requires_grad_()
    loss, nll, ntok = loss_fn(x, target, 0.1, **kwargs)
    (loss * 0.7 + nll * 0.2).backward()
    return loss.detach(), nll.detach(), ntok, x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_chunk_is_bitwise_the_unchunked_loss(dtype: torch.dtype) -> None:
    logits, target = _batch(300, 257, dtype)
    assert chunk_rows(300, 257) == 300  # the default rule: one chunk at this size
    new = _run(label_smoothed_nll_loss, logits, target)
    old = _run(_unchunked_loss, logits, target)
    for a, b in zip(new, old, strict=True):
        assert a.dtype == b.dtype
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64, 100, 299, 300])  # 7, 64, 100 and 299 leave a rest
def test_chunked_matches_reference_and_one_chunk(dtype: torch.dtype, rows: int) -> None:
    logits, target = _batch(300, 257, dtype, seed=rows)
    loss, nll, ntok, grad = _run(label_smoothed_nll_loss, logits, target, rows_per_chunk=rows)
    ref = _run(reference_label_smoothed_nll_loss, logits, target)
    one = _run(label_smoothed_nll_loss, logits, target, rows_per_chunk=300)
    assert int(ntok) == int(ref[2]) == 300 - 14
    # the reference's log-softmax rounds differently: fp32 sums of 286 rows agree to ~1e-6
    torch.testing.assert_close(loss, ref[0], rtol=2e-6, atol=0)
    torch.testing.assert_close(nll, ref[1], rtol=2e-6, atol=0)
    assert grad.dtype == dtype
    g_tol = {"rtol": 1e-5, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-5}
    torch.testing.assert_close(grad, ref[3].to(dtype), **g_tol)
    assert torch.count_nonzero(grad[0, -5:]) == 0 and torch.count_nonzero(grad[1, -9:]) == 0
    # chunks change no row's arithmetic and the row sums run over all N rows at once: on the
    # CPU the results are bitwise those of one chunk; 1e-6 leaves room for a device whose
    # row reductions split differently when a chunk has few rows
    torch.testing.assert_close(loss, one[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(nll, one[1], rtol=1e-6, atol=0)
    torch.testing.assert_close(grad, one[3], rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=0)


def test_chunk_rows_rule() -> None:
    assert chunk_rows(4096, 64000) == 256  # 16 equal chunks of 256 x 64,000 (62.5 MiB fp32)
    assert chunk_rows(4096, 64000) * 64000 <= CHUNK_ELEMENTS
    assert chunk_rows(262, 64000) == 262  # fits one chunk
    assert chunk_rows(100, 30, max_elements=1000) == 34  # 3 chunks: 34 + 34 + 32 rows
    assert chunk_rows(3, 10**8) == 1  # a row larger than a chunk: one row each
    assert chunk_rows(0, 64000) == 1
    for n, v in [(1, 1), (4095, 64000), (10**6, 7), (333, 50257)]:
        rows = chunk_rows(n, v)
        chunks = -(-n // rows)
        assert rows * v <= CHUNK_ELEMENTS + v  # whole rows: at most one row over
        assert chunks == max(1, -(-n * v // CHUNK_ELEMENTS))  # no more chunks than needed


def _counted(loss_fn, dtype: torch.dtype, n: int, v: int, **kwargs) -> LaunchCounter:  # noqa: ANN001
    """A LaunchCounter around the logits' creation and the loss' forward + backward."""
    target = _batch(n, v, torch.float32)[1]
    with LaunchCounter() as counter:
        logits = torch.randn(2, n // 2, v, dtype=dtype).requires_grad_()  # counted: 1 op
        loss, _, _ = loss_fn(logits, target, 0.1, **kwargs)
        loss.backward()
        assert logits.grad is not None
        del logits, loss
    return counter


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_chunk_launches_no_more_ops_than_before(dtype: torch.dtype) -> None:
    new = _counted(label_smoothed_nll_loss, dtype, 256, 128).kernel_ops
    old = _counted(_unchunked_loss, dtype, 256, 128).kernel_ops
    # 34 (fp32) and 37 (bf16) before, 29 and 32 now, with randn and autograd's ones_like
    assert new <= old - 5
    # each further chunk: 3 ops forward (logsumexp, gather, sum; bf16: + the fp32 copy) and 5
    # backward (sub, exp_, mul_, sub_, scatter_add_; bf16: + the fp32 copy and the cast back)
    per_chunk = 8 if dtype == torch.float32 else 11
    four = _counted(label_smoothed_nll_loss, dtype, 256, 128, rows_per_chunk=64).kernel_ops
    assert four == new + 3 * per_chunk


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_peak_memory_has_no_full_fp32_buffer(dtype: torch.dtype) -> None:
    n, v, rows = 512, 8192, 64
    size = n * v * dtype.itemsize  # the logits, and their gradient
    chunk_fp32 = rows * v * 4
    new = _counted(label_smoothed_nll_loss, dtype, n, v, rows_per_chunk=rows).peak_bytes
    old = _counted(_unchunked_loss, dtype, n, v).peak_bytes
    # logits + gradient + at most 3 fp32 chunks (1 seen: 18 MiB in bf16), per-row vectors
    assert new <= 2 * size + 3 * chunk_fp32 + 64 * 1024
    assert new >= 2 * size  # the counter sees the logits and the gradient
    if dtype == torch.bfloat16:  # before: the bf16 logits + 2 fp32 (N, V) buffers (40 MiB)
        assert old >= size + 2 * n * v * 4
        assert new <= 0.6 * old
    else:  # before: the fp32 logits + the gradient, computed in place; no more now
        assert old >= 2 * size
        assert new <= old + 64 * 1024
