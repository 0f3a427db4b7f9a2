"""The residual module: DeepNorm constants, BranchNorm schedules, the four block equations."""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
import torch.nn.functional as F

from megatron_branchnorm.config import RESIDUAL_SCHEMES
from megatron_branchnorm.model.residual import (
    SCHEMES,
    Residual,
    branchnorm_alpha,
    deepnorm_constants,
    residual_constants,
    scheme_named,
)


@pytest.mark.parametrize("n, m", [(1, 1), (6, 6), (18, 18), (100, 100), (500, 500), (12, 3)])
def test_deepnorm_constants_match_the_paper(n: int, m: int) -> None:
    # DeepNet (Wang et al., 2022), encoder-decoder column, written out independently:
    # alpha_enc = 0.81 (N^4 M)^(1/16), beta_enc = 0.87 (N^4 M)^(-1/16),
    # alpha_dec = (3M)^(1/4), beta_dec = (12M)^(-1/4).
    expected = (
        0.81 * (n**4 * m) ** (1 / 16),
        0.87 * (n**4 * m) ** (-1 / 16),
        (3 * m) ** 0.25,
        (12 * m) ** -0.25,
    )
    got = deepnorm_constants(n, m)
    assert len(got) == 4
    for g, e in zip(got, expected, strict=True):
        assert g == pytest.approx(e, rel=1e-12)


def test_deepnorm_constants_known_values() -> None:
    # Hand-evaluated 6L-6L values: (6^5)^(1/16) = 7776^(1/16) = 1.75054...
    alpha_enc, beta_enc, alpha_dec, beta_dec = deepnorm_constants(6, 6)
    assert alpha_enc == pytest.approx(1.41794, abs=1e-4)
    assert beta_enc == pytest.approx(0.49699, abs=1e-4)
    assert alpha_dec == pytest.approx(18**0.25, abs=1e-12)  # 2.0598
    assert beta_dec == pytest.approx(72**-0.25, abs=1e-12)  # 0.3433
    # The paper's 0.87, not torchscale's 1.15.
    assert beta_enc == pytest.approx(0.87 / 7776 ** (1 / 16), rel=1e-12)


def test_residual_constants_per_scheme() -> None:
    a_enc, b_enc, a_dec, b_dec = deepnorm_constants(8, 4)
    assert residual_constants("deepnorm", 8, 4) == {
        "encoder": (a_enc, b_enc),
        "decoder": (a_dec, b_dec),
    }
    # BranchNorm: DeepNet's init (beta) but no residual up-weighting (alpha = 1).
    assert residual_constants("branchnorm", 8, 4) == {
        "encoder": (1.0, b_enc),
        "decoder": (1.0, b_dec),
    }
    for scheme in ("postln", "preln"):
        assert residual_constants(scheme, 8, 4) == {"encoder": (1.0, 1.0), "decoder": (1.0, 1.0)}


def test_branch_init_overrides_the_schemes_gain_only() -> None:
    a_enc, _, a_dec, _ = deepnorm_constants(8, 4)
    # Post-LN with DeepNet's init: BranchNorm's constants (the ablation of its ramp).
    assert residual_constants("postln", 8, 4, "deepnet") == residual_constants("branchnorm", 8, 4)
    # BranchNorm with gain 1: Post-LN's constants; DeepNorm keeps its residual alpha.
    assert residual_constants("branchnorm", 8, 4, "xavier") == residual_constants("postln", 8, 4)
    assert residual_constants("deepnorm", 8, 4, "xavier") == {
        "encoder": (a_enc, 1.0),
        "decoder": (a_dec, 1.0),
    }
    for scheme in ("branchnorm", "deepnorm", "postln", "preln"):
        assert residual_constants(scheme, 8, 4, "auto") == residual_constants(scheme, 8, 4)
    with pytest.raises(ValueError, match="kaiming"):
        residual_constants("postln", 8, 4, "kaiming")


# ---- BranchNorm's alpha_t ------------------------------------------------------------------


def test_linear_schedule() -> None:
    t_total = 4000
    assert branchnorm_alpha(1, t_total) == pytest.approx(1 / t_total, rel=1e-12)
    assert branchnorm_alpha(t_total // 2, t_total) == 0.5
    assert branchnorm_alpha(1000, t_total, "linear") == 0.25
    assert branchnorm_alpha(t_total - 1, t_total) == pytest.approx(1 - 1 / t_total)
    for t in (t_total, t_total + 1, 10 * t_total):
        assert branchnorm_alpha(t, t_total) == 1.0
    assert branchnorm_alpha(0, t_total) == 0.0  # before the first update


@pytest.mark.parametrize("schedule", ["exp", "sigmoid"])
def test_exp_and_sigmoid_are_monotone_in_unit_interval_and_clipped(schedule: str) -> None:
    t_total = 200
    values = [branchnorm_alpha(t, t_total, schedule) for t in range(0, 3 * t_total)]
    assert all(0.0 < v <= 1.0 for v in values)
    assert all(b >= a for a, b in zip(values, values[1:], strict=False))
    assert all(values[t] == 1.0 for t in range(t_total, 3 * t_total))  # clipped at 1
    assert values[t_total - 1] < 1.0
    assert values[1] < 0.01  # starts near zero, like linear


def test_schedule_formulas_match_the_docstring() -> None:
    # The docstring of branchnorm_alpha states, with r = t / T:
    #   exp:     exp(-5 (1 - r))
    #   sigmoid: 1 / (1 + exp(-10 (r - 1/2)))
    doc = branchnorm_alpha.__doc__
    assert "exp(-5 (1 - r))" in doc
    assert "1 / (1 + exp(-10 (r - 1/2)))" in doc
    assert "min(1, r)" in doc
    t_total = 1000
    for t in (1, 10, 250, 500, 999):
        r = t / t_total
        assert branchnorm_alpha(t, t_total, "exp") == pytest.approx(math.exp(-5 * (1 - r)))
        assert branchnorm_alpha(t, t_total, "sigmoid") == pytest.approx(
            1 / (1 + math.exp(-10 * (r - 0.5)))
        )
    assert branchnorm_alpha(500, 1000, "sigmoid") == pytest.approx(0.5)


def test_branchnorm_alpha_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="schedule"):
        branchnorm_alpha(1, 10, "cosine")
    with pytest.raises(ValueError, match="total_steps"):
        branchnorm_alpha(1, 0)


# ---- the four block equations -------------------------------------------------------------


def _ln(x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], eps=1e-5)


@pytest.mark.parametrize("scheme", ["postln", "preln", "deepnorm", "branchnorm"])
def test_block_equations(scheme: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16)
    weight = torch.randn(16, 16) / 4

    def f(h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h @ weight)

    block = Residual(scheme, 16, dropout=0.0, deepnorm_alpha=1.7, layernorm_impl="torch")
    block.branch_scale = 0.3
    expected = {
        "postln": _ln(x + f(x)),
        "preln": x + f(_ln(x)),
        "deepnorm": _ln(1.7 * x + f(x)),
        "branchnorm": _ln(x + 0.3 * f(x)),
    }[scheme]
    torch.testing.assert_close(block(x, f), expected, rtol=0, atol=1e-6)


def test_blocks_share_parameter_names_across_schemes() -> None:
    names = {
        scheme: sorted(Residual(scheme, 8, 0.0).state_dict())
        for scheme in ("postln", "preln", "deepnorm", "branchnorm")
    }
    assert len({tuple(v) for v in names.values()}) == 1
    # alpha and alpha_t are Python floats, never parameters or buffers
    assert names["branchnorm"] == ["norm.bias", "norm.weight"]


# ---- the registry of schemes ----------------------------------------------------------------


def test_the_registry_names_configs_schemes_with_their_traits() -> None:
    """One registry (docs/design.md §11): config's names, each scheme's traits as the sites
    ask them (final LN, fold to Post-LN, Marian export, DeepNet alpha and init, alpha_t)."""
    assert set(SCHEMES) == set(RESIDUAL_SCHEMES)
    traits = {
        name: (
            s.final_norm,
            s.foldable_to_postln,
            s.marian_exportable,
            s.deepnet_alpha,
            s.deepnet_init,
            s.step_scaled,
        )
        for name, s in SCHEMES.items()
    }
    assert traits == {
        "postln": (False, True, True, False, False, False),
        "preln": (True, False, False, False, False, False),
        "deepnorm": (False, True, True, True, True, False),
        "branchnorm": (False, True, True, False, True, True),
    }
    assert [SCHEMES[n].label for n in ("postln", "preln")] == ["Post-LN", "Pre-LN"]


def test_a_block_keeps_the_registrys_scheme_through_copies() -> None:
    block = Residual("deepnorm", 8, 0.0)
    assert block.scheme is SCHEMES["deepnorm"] is scheme_named(SCHEMES["deepnorm"])
    assert copy.deepcopy(block).scheme is SCHEMES["deepnorm"]
    assert pickle.loads(pickle.dumps(block)).scheme is SCHEMES["deepnorm"]
    with pytest.raises(ValueError, match="unknown residual scheme 'rezero'"):
        Residual("rezero", 8, 0.0)
    with pytest.raises(ValueError, match="a Pre-LN block has no Post-LN equivalent"):
        Residual("preln", 8, 0.0).output_scale_for_postln()
