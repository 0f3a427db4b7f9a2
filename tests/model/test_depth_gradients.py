"""The paper's motivation at small scale: Post-LN's gradients vary wildly across depth at init.

A deep narrow stack (18L-18L, d=32), one batch, loss = summed cross entropy; per layer we take
the L2 norm of the gradient of all its parameters and, per stack, the spread max/min across
layers. Measured with this model and batch for seeds 1-8 (test_depth_gradients prints seed 1):

    post-ln          decoder spread 123 .. 1047 (seed 1: 329): gradients vanish toward the
                     bottom decoder layers (0.30 at layer 1 .. 99 at layer 18); encoder 2-6
    deepnorm         1.4 .. 1.6
    branchnorm, t=1  1.5 .. 1.7

Spreads are per stack: at t=1 BranchNorm's encoder gradients are all ~0.003, its decoder's ~41,
because the encoder reaches the loss only through cross-attention branches scaled by 1/T.

Thresholds: Post-LN's spread must exceed 30 (4x below the smallest value seen), DeepNorm's and
BranchNorm's must stay below 4 (2.4x above the largest seen), and Post-LN's must be at least
20x theirs (the smallest measured ratio is 72). A model where all three behave alike (e.g. a
scheme switch that does nothing) fails these by orders of magnitude.
"""

from __future__ import annotations

import pytest
import torch

from megatron_branchnorm.model import build_model, label_smoothed_nll_loss
from tests.core.helpers import random_tokens, tiny_config

LAYERS, WIDTH = 18, 32


def layer_grad_spread(residual: str, seed: int = 1) -> tuple[float, list[float], list[float]]:
    """(largest max/min spread over both stacks, encoder norms, decoder norms) at init."""
    cfg = tiny_config(
        residual=residual,
        encoder_layers=LAYERS,
        decoder_layers=LAYERS,
        hidden_size=WIDTH,
        ffn_hidden_size=2 * WIDTH,
        num_attention_heads=2,
    )
    model = build_model(cfg, seed=seed)
    model.set_step(1)  # BranchNorm at t=1: alpha = 1/T
    src, prev, target = (random_tokens(8, n, seed=s) for n, s in ((12, 1), (10, 2), (10, 3)))
    loss, _, _ = label_smoothed_nll_loss(model(src, prev), target, 0.0)
    loss.backward()

    def norms(layers: torch.nn.ModuleList) -> list[float]:
        return [
            torch.sqrt(sum(p.grad.pow(2).sum() for p in layer.parameters())).item()
            for layer in layers
        ]

    enc, dec = norms(model.encoder_layers), norms(model.decoder_layers)
    spread = max(max(v) / min(v) for v in (enc, dec))
    return spread, enc, dec


@pytest.fixture(scope="module")
def spreads() -> dict[str, float]:
    out = {}
    for residual in ("postln", "deepnorm", "branchnorm"):
        spread, enc, dec = layer_grad_spread(residual)
        print(f"{residual:10s} spread {spread:8.1f}")
        print("  encoder grad norms", " ".join(f"{g:.3g}" for g in enc))
        print("  decoder grad norms", " ".join(f"{g:.3g}" for g in dec))
        out[residual] = spread
    return out


def test_postln_gradients_vary_across_depth(spreads: dict[str, float]) -> None:
    assert spreads["postln"] > 30.0


@pytest.mark.parametrize("residual", ["branchnorm", "deepnorm"])
def test_branchnorm_and_deepnorm_keep_gradients_even(
    spreads: dict[str, float], residual: str
) -> None:
    assert spreads[residual] < 4.0
    assert spreads["postln"] > 20.0 * spreads[residual]


def test_postln_bottom_decoder_layers_get_the_smallest_gradients() -> None:
    _, _, dec = layer_grad_spread("postln", seed=2)
    third = LAYERS // 3
    assert sum(dec[:third]) * 10 < sum(dec[-third:])
