"""The optimised paths compute what the reference paths compute (no timing here)."""

from __future__ import annotations

import pytest
import torch

from megatron_branchnorm.model import build_model
from megatron_branchnorm.model.loss import (
    label_smoothed_nll_loss,
    reference_label_smoothed_nll_loss,
)
from megatron_branchnorm.model.residual import Residual, select_layernorm
from megatron_branchnorm.tokens import PAD_ID

from .helpers import random_tokens, tiny_config


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_fused_loss_matches_reference_values_and_gradients(eps: float) -> None:
    torch.manual_seed(0)
    logits = (torch.randn(3, 7, 50) * 4).requires_grad_()
    target = torch.randint(4, 50, (3, 7))
    target[0, 4:] = PAD_ID
    target[2, 6] = PAD_ID
    fused = label_smoothed_nll_loss(logits, target, eps)
    (fused[0] * 0.7 + fused[1] * 0.2).backward()
    g_fused, logits.grad = logits.grad.clone(), None
    ref = reference_label_smoothed_nll_loss(logits, target, eps)
    (ref[0] * 0.7 + ref[1] * 0.2).backward()
    torch.testing.assert_close(fused[0], ref[0], rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(fused[1], ref[1], rtol=1e-6, atol=1e-5)
    assert int(fused[2]) == int(ref[2]) == 17
    torch.testing.assert_close(g_fused, logits.grad, rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(g_fused[0, 4:]) == 0


def test_fused_loss_keeps_bf16_gradient_dtype() -> None:
    logits = torch.randn(2, 3, 20).bfloat16().requires_grad_()
    target = torch.randint(4, 20, (2, 3))
    loss, _, _ = label_smoothed_nll_loss(logits, target, 0.1)
    assert loss.dtype == torch.float32
    loss.backward()
    assert logits.grad.dtype == torch.bfloat16
    ref, _, _ = reference_label_smoothed_nll_loss(logits, target, 0.1)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("scheme", ["branchnorm", "deepnorm", "postln"])
def test_fused_residual_add_equals_the_written_equation(scheme: str) -> None:
    torch.manual_seed(1)
    block = Residual(scheme, 16, dropout=0.0, deepnorm_alpha=1.7, layernorm_impl="torch")
    block.branch_scale = 0.3
    x = torch.randn(2, 5, 16)

    def f(h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h) * 2.0

    expected_pre = {
        "branchnorm": x + 0.3 * f(x),
        "deepnorm": 1.7 * x + f(x),
        "postln": x + f(x),
    }[scheme]
    expected = torch.nn.functional.layer_norm(expected_pre, (16,))
    torch.testing.assert_close(block(x, f), expected, rtol=0, atol=1e-6)


def test_branchnorm_at_alpha_one_is_postln_bitwise() -> None:
    src, prev = random_tokens(2, 6, seed=1), random_tokens(2, 5, seed=2)
    a = build_model(tiny_config(residual="branchnorm", branchnorm_steps=10), 3).eval()
    b = build_model(tiny_config(residual="postln"), 3).eval()
    b.load_state_dict(a.state_dict())
    a.set_step(10)
    assert torch.equal(a(src, prev), b(src, prev))


def test_auto_layernorm_on_cpu_never_tries_apex(monkeypatch: pytest.MonkeyPatch) -> None:
    import megatron_branchnorm.model.residual as residual

    def boom() -> None:
        raise AssertionError("apex import attempted on CPU")

    monkeypatch.setattr(residual, "apex_layernorm_class", boom)
    assert select_layernorm("auto", "cpu") == "torch"
