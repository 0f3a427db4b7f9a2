"""The Post-LN family: BranchNorm at alpha=1 is Post-LN; every member folds into Post-LN.

Tolerances from docs/design.md §5: alpha=1 vs Post-LN exact (same arithmetic); folded BranchNorm
1e-6 (a scale folds exactly into a linear map, up to float rounding); folded DeepNorm 1e-4
(LN(a*y) = LN(y) only up to LayerNorm's epsilon).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_branchnorm.model import EncoderDecoder, build_model, fold_to_postln
from megatron_branchnorm.model.residual import Scheme
from tests.core.helpers import random_tokens, tiny_config

T_STEPS = 400


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return random_tokens(2, 7, seed=21), random_tokens(2, 6, seed=22)


def test_branchnorm_at_alpha_one_is_exactly_postln() -> None:
    cfg = tiny_config(residual="branchnorm", branchnorm_steps=T_STEPS, encoder_layers=3)
    branchnorm = build_model(cfg, seed=3).eval()
    postln = build_model(tiny_config(residual="postln", encoder_layers=3), seed=99).eval()
    postln.load_state_dict(branchnorm.state_dict(), strict=True)
    src, prev = _batch()
    assert branchnorm.set_step(T_STEPS) == 1.0
    with torch.no_grad():
        assert torch.equal(branchnorm(src, prev), postln(src, prev))
        branchnorm.set_step(T_STEPS // 2)  # and before T it is not Post-LN
        assert not torch.allclose(branchnorm(src, prev), postln(src, prev), atol=1e-3)


def test_state_dicts_load_into_each_other() -> None:
    schemes = ["postln", "deepnorm", "branchnorm"]
    models = {s: build_model(tiny_config(residual=s), seed=i) for i, s in enumerate(schemes)}
    for source, target in itertools.permutations(schemes, 2):
        state = models[source].state_dict()
        fresh = build_model(tiny_config(residual=target), seed=50)
        fresh.load_state_dict(state, strict=True)
        for key, value in fresh.state_dict().items():
            assert torch.equal(value, state[key]), (source, target, key)


def _assert_folds(model: EncoderDecoder, atol: float) -> EncoderDecoder:
    src, prev = _batch()
    folded = fold_to_postln(model)
    assert folded.cfg.residual == "postln"
    assert all(b.scheme is Scheme.POSTLN for b in folded.residual_blocks())
    with torch.no_grad():
        expected, got = model(src, prev), folded(src, prev)
    torch.testing.assert_close(got, expected, rtol=0, atol=atol)
    # the folded weights are plain Post-LN weights: a freshly built Post-LN model runs them
    vanilla = build_model(folded.cfg, seed=77).eval()
    vanilla.load_state_dict(folded.state_dict(), strict=True)
    with torch.no_grad():
        assert torch.equal(vanilla(src, prev), got)
    return folded


def test_fold_branchnorm_at_quarter_alpha() -> None:
    model = build_model(tiny_config(residual="branchnorm", branchnorm_steps=T_STEPS), 3).eval()
    assert model.set_step(T_STEPS // 4) == 0.25
    _assert_folds(model, atol=1e-6)
    # the original is untouched by folding
    assert all(b.branch_scale == 0.25 for b in model.residual_blocks())
    assert model.cfg.residual == "branchnorm"


def test_fold_is_not_trivial() -> None:
    # Post-LN with the BranchNorm weights but no fold gives different logits: the fold matters.
    model = build_model(tiny_config(residual="branchnorm", branchnorm_steps=T_STEPS), 3).eval()
    model.set_step(T_STEPS // 4)
    unfolded = build_model(tiny_config(residual="postln"), 3).eval()
    unfolded.load_state_dict(model.state_dict(), strict=True)
    src, prev = _batch()
    with torch.no_grad():
        assert (unfolded(src, prev) - model(src, prev)).abs().max() > 1e-2


def test_fold_deepnorm() -> None:
    # 6L-6L: alpha_enc = 1.42, alpha_dec = 2.06, far from 1.
    cfg = tiny_config(residual="deepnorm", encoder_layers=6, decoder_layers=6)
    model = build_model(cfg, seed=4).eval()
    assert min(b.deepnorm_alpha for b in model.residual_blocks()) > 1.4
    _assert_folds(model, atol=1e-4)


def test_fold_postln_is_identity() -> None:
    model = build_model(tiny_config(residual="postln"), 4).eval()
    folded = _assert_folds(model, atol=0.0)
    for key, value in model.state_dict().items():
        assert torch.equal(value, folded.state_dict()[key])


def test_fold_refuses_preln() -> None:
    with pytest.raises(ValueError, match="Pre-LN"):
        fold_to_postln(build_model(tiny_config(residual="preln"), 4))
