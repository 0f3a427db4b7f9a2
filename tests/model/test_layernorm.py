"""LayerNorm implementation choice: Apex FusedLayerNorm on CUDA when importable, else torch.

Real Apex is not installed on CPU test machines; a stand-in module
``apex.normalization.FusedLayerNorm`` (a counting torch.nn.LayerNorm subclass) is injected into
sys.modules, which is what ``import apex.normalization`` finds first.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from megatron_branchnorm.model import build_model
from megatron_branchnorm.model.residual import LayerNorm, describe_layernorm, select_layernorm
from tests.core.helpers import random_tokens, tiny_config


class CountingFusedLayerNorm(torch.nn.LayerNorm):
    """Stand-in for apex.normalization.FusedLayerNorm: torch's LN, counting its calls."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        return super().forward(x)


@pytest.fixture
def fake_apex(monkeypatch: pytest.MonkeyPatch) -> type[CountingFusedLayerNorm]:
    apex = types.ModuleType("apex")
    normalization = types.ModuleType("apex.normalization")
    normalization.FusedLayerNorm = CountingFusedLayerNorm
    apex.normalization = normalization
    monkeypatch.setitem(sys.modules, "apex", apex)
    monkeypatch.setitem(sys.modules, "apex.normalization", normalization)
    monkeypatch.setattr(CountingFusedLayerNorm, "calls", 0)
    return CountingFusedLayerNorm


@pytest.fixture
def no_apex(monkeypatch: pytest.MonkeyPatch) -> None:
    # None in sys.modules makes `import apex` raise ImportError, even if some apex is installed.
    monkeypatch.setitem(sys.modules, "apex", None)
    monkeypatch.delitem(sys.modules, "apex.normalization", raising=False)


def test_auto_picks_apex_on_cuda_only(fake_apex) -> None:
    assert select_layernorm("auto", "cuda") == "apex"
    assert select_layernorm("auto", "cpu") == "torch"
    assert select_layernorm("torch", "cuda") == "torch"
    assert select_layernorm("apex", "cpu") == "apex"


def test_auto_without_apex_is_torch(no_apex) -> None:
    assert select_layernorm("auto", "cuda") == "torch"
    assert select_layernorm("auto", "cpu") == "torch"


def test_apex_requested_but_missing_is_a_clear_error(no_apex) -> None:
    with pytest.raises(RuntimeError, match=r"layernorm_impl=apex.*not importable"):
        select_layernorm("apex", "cuda")
    norm = LayerNorm(8, impl="apex")
    with pytest.raises(RuntimeError, match="FusedLayerNorm"):
        norm(torch.randn(2, 8))


def test_unknown_impl_is_an_error() -> None:
    with pytest.raises(ValueError, match="layernorm_impl"):
        select_layernorm("fused", "cpu")


def test_describe_reports_the_choice(fake_apex, monkeypatch: pytest.MonkeyPatch) -> None:
    line = describe_layernorm("auto", "cuda")
    assert "apex" in line and "FusedLayerNorm" in line and "\n" not in line
    line = describe_layernorm("auto", "cpu")
    assert "torch.nn.LayerNorm" in line and "cpu" in line
    assert "requested" in describe_layernorm("torch", "cuda")
    monkeypatch.setitem(sys.modules, "apex", None)
    monkeypatch.delitem(sys.modules, "apex.normalization")
    assert "apex not importable" in describe_layernorm("auto", "cuda")


def test_apex_impl_runs_the_fused_class_and_matches_torch(fake_apex) -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16)
    norm = LayerNorm(16, impl="apex")
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    y = norm(x)
    assert fake_apex.calls == 1
    assert norm.last_backend == "apex"
    expected = F.layer_norm(x, (16,), norm.weight, norm.bias, 1e-5)
    torch.testing.assert_close(y, expected, rtol=0, atol=1e-6)
    # the fused module uses our parameters: gradients reach them, state dict keys unchanged
    y.sum().backward()
    assert norm.weight.grad is not None and norm.bias.grad is not None
    assert sorted(norm.state_dict()) == ["bias", "weight"]


def test_auto_impl_on_cpu_does_not_call_apex(fake_apex) -> None:
    norm = LayerNorm(16, impl="auto")
    norm(torch.randn(2, 16))
    assert fake_apex.calls == 0
    assert norm.last_backend == "torch"


def test_model_with_apex_impl_computes_the_torch_model(fake_apex) -> None:
    src, prev = random_tokens(2, 6, seed=1), random_tokens(2, 5, seed=2)
    apex_model = build_model(tiny_config(layernorm_impl="apex"), 3).eval()
    torch_model = build_model(tiny_config(layernorm_impl="torch"), 3).eval()
    assert sorted(apex_model.state_dict()) == sorted(torch_model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(apex_model(src, prev), torch_model(src, prev), rtol=0, atol=1e-5)
    assert fake_apex.calls == 2 * 2 + 3 * 2  # one LN per residual block of the 2L-2L model
