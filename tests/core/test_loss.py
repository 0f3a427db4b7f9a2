"""Label-smoothed cross entropy: a hand computation, padding ignored, eps=0 is plain CE."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_branchnorm.model import label_smoothed_nll_loss
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
