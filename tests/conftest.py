"""Fixtures shared by every test."""

from __future__ import annotations

import os
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


RANK_VARIABLES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE", "MBN_RENDEZVOUS_FD",
)  # fmt: skip
"""What ``training.environment.setup_process_env`` writes into this process's environment."""


@pytest.fixture(autouse=True)
def _own_rank_variables():
    """Every test starts with this process's rank variables as before it: an in-process world of
    one (``setup_process_env``) joins the rendezvous store this process hosts, and a later test
    that passes ``os.environ`` to ranks or a launcher must not hand them that store."""
    saved = {key: os.environ.get(key) for key in RANK_VARIABLES}
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
