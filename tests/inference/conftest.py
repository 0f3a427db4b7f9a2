"""Fixtures shared by the inference tests (built once per session: they cost seconds)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_branchnorm.inference.export import save_export
from megatron_branchnorm.model import EncoderDecoder, build_model

from .helpers import LANGS, tiny_config, train_copy_model, train_spm


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    """Tiny models only lose from intra-op threads (and the test machine has 2 cores)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def copy_model() -> EncoderDecoder:
    """A tiny model trained for 200 steps to copy its input."""
    return train_copy_model(200)


@pytest.fixture(scope="session")
def spm_path(tmp_path_factory) -> Path:
    """A SentencePiece model with <2de>, <2en>, <2zh> tags."""
    return train_spm(tmp_path_factory.mktemp("spm"))


@pytest.fixture(scope="session")
def text_export(tmp_path_factory, spm_path) -> Path:
    """An export of a random BranchNorm model (mid-warm-up) with the tiny SentencePiece model."""
    import sentencepiece as spm

    vocab = spm.SentencePieceProcessor(model_file=str(spm_path)).get_piece_size()
    model = build_model(
        tiny_config(vocab_size=vocab, residual="branchnorm", branchnorm_steps=100), 3
    )
    model.set_step(40)
    out = tmp_path_factory.mktemp("exports") / "text"
    save_export(model, out, spm_path, {"languages": list(LANGS), "source_checkpoint": "test"})
    return out
