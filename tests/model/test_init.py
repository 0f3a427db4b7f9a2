"""Initialisation: DeepNet's gains on the branch projections, and seeding per layer.

Std tolerance: for n i.i.d. N(0, s^2) draws the sample std has standard error s / sqrt(2n).
We allow 6 standard errors (relative tolerance 6 / sqrt(2n): 6.6% for a 64x64 slice, 4.7%
for a 128x64 FFN matrix): a correct init fails this with probability ~1e-9 per tensor,
while a wrong gain is off by far more (beta is 0.34-0.50 here, i.e. a 2-3x difference,
and fans computed over the whole fused QKV instead of per slice would be off by sqrt(2)).
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_branchnorm.model import build_model, deepnorm_constants
from megatron_branchnorm.tokens import PAD_ID
from tests.core.helpers import tiny_config

D, FFN, LAYERS = 64, 128, 6


def _assert_std(weight: torch.Tensor, expected: float, what: str) -> None:
    w = weight.detach().double()
    rel_tol = 6.0 / math.sqrt(2.0 * w.numel())
    std = w.std().item()
    assert abs(std / expected - 1.0) < rel_tol, (
        f"{what}: std {std:.5f}, expected {expected:.5f} (+-{100 * rel_tol:.1f}%)"
    )
    assert abs(w.mean().item()) < 6.0 * expected / math.sqrt(w.numel()), f"{what}: mean"


def _xavier_std(gain: float, fan_in: int, fan_out: int) -> float:
    return gain * math.sqrt(2.0 / (fan_in + fan_out))


def _check_layer_gains(layer: torch.nn.Module, beta: float, decoder: bool) -> None:
    """Branch weights (v, out, fc1, fc2, and cross-attn v/out) carry beta; q and k gain 1."""
    qkv = layer.self_attn.qkv.weight  # (3D, D): q, k, v slices, each D x D
    _assert_std(qkv[:D], _xavier_std(1.0, D, D), "self-attn q")
    _assert_std(qkv[D : 2 * D], _xavier_std(1.0, D, D), "self-attn k")
    _assert_std(qkv[2 * D :], _xavier_std(beta, D, D), "self-attn v")
    _assert_std(layer.self_attn.out.weight, _xavier_std(beta, D, D), "self-attn out")
    _assert_std(layer.ffn.fc1.weight, _xavier_std(beta, D, FFN), "fc1")
    _assert_std(layer.ffn.fc2.weight, _xavier_std(beta, FFN, D), "fc2")
    linears = [layer.self_attn.qkv, layer.self_attn.out, layer.ffn.fc1, layer.ffn.fc2]
    if decoder:
        cross = layer.cross_attn
        _assert_std(cross.q.weight, _xavier_std(1.0, D, D), "cross-attn q")
        _assert_std(cross.kv.weight[:D], _xavier_std(1.0, D, D), "cross-attn k")
        _assert_std(cross.kv.weight[D:], _xavier_std(beta, D, D), "cross-attn v")
        _assert_std(cross.out.weight, _xavier_std(beta, D, D), "cross-attn out")
        linears += [cross.q, cross.kv, cross.out]
    for linear in linears:
        assert torch.count_nonzero(linear.bias) == 0


def _cfg(residual: str, **kw):
    return tiny_config(
        residual=residual,
        encoder_layers=LAYERS,
        decoder_layers=LAYERS,
        hidden_size=D,
        ffn_hidden_size=FFN,
        **kw,
    )


@pytest.mark.parametrize(
    ("residual", "branch_init", "deepnet_gain"),
    [
        ("deepnorm", "auto", True),
        ("branchnorm", "auto", True),
        ("postln", "auto", False),
        ("postln", "deepnet", True),  # model.branch_init: the ablation knobs
        ("branchnorm", "xavier", False),
    ],
)
def test_branch_weights_have_the_promised_std(
    residual: str, branch_init: str, deepnet_gain: bool
) -> None:
    model = build_model(_cfg(residual, branch_init=branch_init), seed=3)
    _, beta_enc, _, beta_dec = deepnorm_constants(LAYERS, LAYERS)
    if not deepnet_gain:
        beta_enc = beta_dec = 1.0
    else:
        assert beta_enc < 0.6 and beta_dec < 0.4  # far enough from 1 for the test to bite
    for layer in model.encoder_layers:
        _check_layer_gains(layer, beta_enc, decoder=False)
    for layer in model.decoder_layers:
        _check_layer_gains(layer, beta_dec, decoder=True)


def test_embedding_init() -> None:
    model = build_model(_cfg("branchnorm", vocab_size=512), seed=3)
    weight = model.embedding.weight
    assert torch.count_nonzero(weight[PAD_ID]) == 0
    _assert_std(weight[PAD_ID + 1 :], D**-0.5, "embedding")
    # one matrix shared by encoder input, decoder input and output projection
    vocab_shaped = [n for n, p in model.named_parameters() if p.shape[0] == 512]
    assert vocab_shaped == ["embedding.weight"]


def _assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_same_seed_same_weights_other_seed_other_weights() -> None:
    cfg = tiny_config(residual="branchnorm")
    torch.manual_seed(123)  # the global RNG must play no part
    first = build_model(cfg, seed=7).state_dict()
    torch.manual_seed(456)
    torch.randn(1000)
    second = build_model(cfg, seed=7).state_dict()
    _assert_same_state(first, second)
    other = build_model(cfg, seed=8).state_dict()
    assert not torch.equal(
        first["encoder_layers.0.ffn.fc1.weight"], other["encoder_layers.0.ffn.fc1.weight"]
    )


def test_layer_init_does_not_depend_on_model_depth() -> None:
    # What pipeline stages rely on: encoder layer i is the same whether the model has 4 or 6.
    small = build_model(tiny_config(encoder_layers=4, decoder_layers=3), seed=5)
    large = build_model(tiny_config(encoder_layers=6, decoder_layers=3), seed=5)
    small_sd, large_sd = small.state_dict(), large.state_dict()
    for key, value in small_sd.items():
        assert torch.equal(value, large_sd[key]), key  # embedding, 4 encoder, 3 decoder layers
    # Layers are distinct from each other (not one draw repeated).
    assert not torch.equal(
        large_sd["encoder_layers.4.ffn.fc1.weight"], large_sd["encoder_layers.3.ffn.fc1.weight"]
    )
    assert not torch.equal(
        large_sd["encoder_layers.0.ffn.fc1.weight"], large_sd["decoder_layers.0.ffn.fc1.weight"]
    )


def test_branchnorm_layers_are_the_same_draws_scaled_by_beta() -> None:
    # With DeepNet's init, depth changes beta (a scale) but not the underlying normal draws.
    n_small, n_large, m = 4, 6, 3
    small = build_model(
        tiny_config(residual="branchnorm", encoder_layers=n_small, decoder_layers=m), 5
    )
    large = build_model(
        tiny_config(residual="branchnorm", encoder_layers=n_large, decoder_layers=m), 5
    )
    beta_small = deepnorm_constants(n_small, m)[1]
    beta_large = deepnorm_constants(n_large, m)[1]
    for i in range(n_small):
        a, b = small.encoder_layers[i], large.encoder_layers[i]
        torch.testing.assert_close(a.ffn.fc1.weight / beta_small, b.ffn.fc1.weight / beta_large)
        torch.testing.assert_close(a.self_attn.qkv.weight[:64], b.self_attn.qkv.weight[:64])
    for i in range(m):  # beta_dec depends on M only: identical
        for key, value in small.decoder_layers[i].state_dict().items():
            assert torch.equal(value, large.decoder_layers[i].state_dict()[key]), key
