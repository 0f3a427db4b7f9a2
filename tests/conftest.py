"""Fixtures shared by every test."""

from __future__ import annotations

import signal

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    """The Ctrl-C tests send SIGINT to the tools they start and expect exit 130. A test run
    started as a background job of a non-interactive shell (``make test &``) begins with
    SIGINT ignored, and an ignored signal stays ignored across exec, so every tool would
    ignore the Ctrl-C and finish (seen: 5 tests failing that way). A Python handler is reset
    to the default at exec: with one installed here, the tools start as from a terminal."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _fp32_default_dtype():
    """Every test runs in fp32, whatever a previous test did."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    yield
    torch.set_default_dtype(previous)
