"""Fixtures shared by every test."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _fp32_default_dtype():
    """Every test runs in fp32, whatever a previous test did."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    yield
    torch.set_default_dtype(previous)
