"""Helpers for the core tests: tiny fp32 CPU model configs and random token batches."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import pytest
import torch

from megatron_branchnorm.config import ModelConfig
from megatron_branchnorm.tokens import EOS_ID

VOCAB = 40
FIRST_WORD_ID = EOS_ID + 1  # ids below are pad/unk/bos/eos


def tiny_config(**overrides) -> ModelConfig:
    """A 2L-2L, d=32 model without dropout (deterministic forwards); fields overridable."""
    base = ModelConfig(
        encoder_layers=2,
        decoder_layers=2,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        vocab_size=VOCAB,
        residual="postln",
        dropout=0.0,
        max_positions=64,
        layernorm_impl="torch",
    )
    return dataclasses.replace(base, **overrides)


def random_tokens(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """(batch, length) word ids (never pad/bos/eos), reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_WORD_ID, VOCAB, (batch, length), generator=gen)


@contextlib.contextmanager
def one_rank_process_group(timeout_s: float = 120.0) -> Iterator[None]:
    """This process as a world of one rank (the trainer's own process group set-up, gloo on
    CPU) for tests that build a DeepSpeed engine in-process; torn down on exit."""
    from megatron_branchnorm.training import environment

    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_SIZE": "1",
           **environment.own_rendezvous()}  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        environment.init_process_group(timeout_s)
        try:
            yield
        finally:
            environment.destroy_process_group()
