"""The CPU dropout (model/dropout.py): distribution, scaling, gradient, reproducibility."""

from __future__ import annotations

import pytest
import torch

from megatron_branchnorm.model.dropout import Dropout, dropout, keep_mask


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_keep_fraction_per_lane(p):
    torch.manual_seed(0)
    n = 1 << 20
    keep = keep_mask(torch.Size([n]), p).float()
    # each of the four 16-bit lanes of a 64-bit word is its own draw: check each one
    lanes = keep.view(-1, 4).mean(0)
    sd = (p * (1 - p) / (n / 4)) ** 0.5
    assert torch.all((lanes - (1 - p)).abs() < 5 * sd), lanes
    # neighbouring elements are independent: P(both kept) = (1 - p)^2
    both = (keep[:-1] * keep[1:]).mean()
    assert abs(float(both) - (1 - p) ** 2) < 5 * (((1 - p) ** 2 * (1 - (1 - p) ** 2)) / n) ** 0.5


def test_values_scaled_or_zero_and_gradient_uses_the_same_mask():
    torch.manual_seed(1)
    x = torch.randn(3, 7, 5, requires_grad=True)  # 105 elements: not a multiple of 4
    y = dropout(x, 0.25)
    kept = y != 0
    assert 0 < int(kept.sum()) < x.numel()
    assert torch.allclose(y[kept], x.detach()[kept] / 0.75)
    g = torch.randn_like(y)
    y.backward(g)
    assert torch.allclose(x.grad, torch.where(kept, g / 0.75, torch.zeros_like(g)))


def test_reproducible_from_the_seed_and_identity_in_eval():
    x = torch.randn(64, 33)
    torch.manual_seed(5)
    a = Dropout(0.1)(x)
    torch.manual_seed(5)
    b = Dropout(0.1)(x)
    assert torch.equal(a, b)
    assert not torch.equal(Dropout(0.1)(x), a)  # the generator advanced
    m = Dropout(0.1).eval()
    assert m(x) is x
    assert Dropout(0.0)(x) is x
    assert torch.equal(Dropout(1.0)(x), torch.zeros_like(x))


def test_mean_preserved():
    torch.manual_seed(2)
    x = torch.ones(1 << 18)
    assert abs(float(dropout(x, 0.1).mean()) - 1.0) < 0.01


def test_bad_probability_is_rejected():
    with pytest.raises(ValueError, match="dropout probability"):
        Dropout(1.5)


def test_no_state_in_the_state_dict():
    assert Dropout(0.1).state_dict() == {}
