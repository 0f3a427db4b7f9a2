"""The flat encoder-decoder: forward, BranchNorm's step, incremental decoding, padding.

Post-LN models (or BranchNorm past T) are used where the branches must matter: at t=1 a
BranchNorm model's branches are scaled by 1/T and almost every output would look right.
Tolerance 1e-5 for cached vs full decoding: the same arithmetic on differently shaped
tensors (SDPA may pick other kernels / summation orders), far below a real mismatch (~1).
"""

from __future__ import annotations

import pytest
import torch

from megatron_branchnorm.model import EncoderDecoder, build_model
from megatron_branchnorm.tokens import BOS_ID, PAD_ID
from tests.core.helpers import VOCAB, random_tokens, tiny_config

ATOL = 1e-5


@pytest.fixture(scope="module")
def postln_model() -> EncoderDecoder:
    return build_model(
        tiny_config(residual="postln", encoder_layers=3, decoder_layers=3), 11
    ).eval()


def test_forward_shape_and_determinism(postln_model: EncoderDecoder) -> None:
    src, prev = random_tokens(3, 7, seed=1), random_tokens(3, 5, seed=2)
    logits = postln_model(src, prev)
    assert logits.shape == (3, 5, VOCAB)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert torch.equal(logits, postln_model(src, prev))


def test_decoder_is_causal(postln_model: EncoderDecoder) -> None:
    src, prev = random_tokens(2, 7, seed=1), random_tokens(2, 6, seed=2)
    changed = prev.clone()
    changed[:, 4:] = (changed[:, 4:] + 1 - 4) % (VOCAB - 4) + 4  # other words at positions 4, 5
    a, b = postln_model(src, prev), postln_model(src, changed)
    torch.testing.assert_close(a[:, :4], b[:, :4], rtol=0, atol=ATOL)
    assert (a[:, 4:] - b[:, 4:]).abs().max() > 1e-2


def test_set_step_sets_alpha_on_every_block() -> None:
    model = build_model(tiny_config(residual="branchnorm", branchnorm_steps=100), 1)
    blocks = model.residual_blocks()
    assert len(blocks) == 2 * 2 + 3 * 2  # 2 per encoder layer, 3 per decoder layer
    assert all(b.branch_scale == pytest.approx(0.01) for b in blocks)  # fresh model: step 1
    assert model.set_step(25) == 0.25
    assert all(b.branch_scale == 0.25 for b in blocks)
    assert model.set_step(1000) == 1.0
    assert all(b.branch_scale == 1.0 for b in blocks)
    assert not any("alpha" in n or "scale" in n for n, _ in model.named_parameters())
    postln = build_model(tiny_config(residual="postln"), 1)
    assert postln.set_step(1) == 1.0


def test_set_step_restores_a_block_set_by_hand_at_the_same_alpha() -> None:
    """set_branch_scale leaves a block alone when it already holds alpha_t and the shared
    tensor (host time per update): one changed by hand since is still set again."""
    model = build_model(tiny_config(residual="branchnorm", branchnorm_steps=100), 1)
    blocks = model.residual_blocks()
    model.set_step(1000)
    shared = blocks[0].scale_tensor
    assert shared is not None and all(b.scale_tensor is shared for b in blocks)
    blocks[3].branch_scale = 1.0  # the same value, but a constant: its shared tensor is gone
    blocks[4].branch_scale = 0.5
    assert model.set_step(2000) == 1.0
    assert all(b.branch_scale == 1.0 and b.scale_tensor is shared for b in blocks)
    assert float(shared) == 1.0


def test_set_step_changes_the_output_of_branchnorm() -> None:
    model = build_model(tiny_config(residual="branchnorm", branchnorm_steps=100), 1).eval()
    src, prev = random_tokens(2, 6, seed=1), random_tokens(2, 5, seed=2)
    model.set_step(1)
    early = model(src, prev)
    model.set_step(100)
    late = model(src, prev)
    assert (early - late).abs().max() > 1e-2


def _incremental_logits(
    model: EncoderDecoder, src: torch.Tensor, prev: torch.Tensor
) -> torch.Tensor:
    memory, pad_mask = model.encode(src)
    caches = model.new_caches()
    steps = [
        model.decode_step(prev[:, i], memory, pad_mask, caches, i) for i in range(prev.shape[1])
    ]  # each (B, V)
    return torch.stack(steps, dim=1)  # (B, T, V)


@pytest.mark.parametrize("residual", ["postln", "preln", "deepnorm", "branchnorm"])
def test_incremental_decoding_equals_full_forward(residual: str) -> None:
    model = build_model(tiny_config(residual=residual, branchnorm_steps=10), 4).eval()
    model.set_step(7)  # BranchNorm at alpha 0.7: branches matter
    src, prev = random_tokens(3, 8, seed=5), random_tokens(3, 6, seed=6)
    prev[:, 0] = BOS_ID
    with torch.no_grad():
        full = model(src, prev)
        incremental = _incremental_logits(model, src, prev)
    torch.testing.assert_close(incremental, full, rtol=0, atol=ATOL)


def test_cache_holds_keys_and_values_per_layer(postln_model: EncoderDecoder) -> None:
    src, prev = random_tokens(2, 7, seed=1), random_tokens(2, 4, seed=2)
    memory, pad_mask = postln_model.encode(src)
    caches = postln_model.new_caches()
    assert len(caches) == len(postln_model.decoder_layers)
    with torch.no_grad():
        for i in range(4):
            postln_model.decode_step(prev[:, i], memory, pad_mask, caches, i)
    heads, head_dim = 4, 32 // 4
    for cache in caches:
        assert cache["self_k"].shape == (2, heads, 4, head_dim)
        assert cache["cross_k"].shape == (2, heads, 7, head_dim)


def test_chunked_decoding_with_cache_stays_causal(postln_model: EncoderDecoder) -> None:
    # decode() with caches takes T new positions at once (e.g. a forced prefix, then steps).
    src, prev = random_tokens(2, 7, seed=1), random_tokens(2, 7, seed=2)
    with torch.no_grad():
        full = postln_model(src, prev)
        memory, pad_mask = postln_model.encode(src)
        caches = postln_model.new_caches()
        first = postln_model.decode(prev[:, :3], memory, pad_mask, caches, start=0)
        middle = postln_model.decode(prev[:, 3:5], memory, pad_mask, caches, start=3)
        last = [postln_model.decode_step(prev[:, i], memory, pad_mask, caches, i) for i in (5, 6)]
    torch.testing.assert_close(first, full[:, :3], rtol=0, atol=ATOL)
    torch.testing.assert_close(middle, full[:, 3:5], rtol=0, atol=ATOL)
    torch.testing.assert_close(torch.stack(last, 1), full[:, 5:], rtol=0, atol=ATOL)


def test_reorder_caches_follows_the_new_batch_order(postln_model: EncoderDecoder) -> None:
    src, prev = random_tokens(3, 7, seed=3), random_tokens(3, 6, seed=4)
    order = torch.tensor([2, 0, 0])
    with torch.no_grad():
        memory, pad_mask = postln_model.encode(src)
        caches = postln_model.new_caches()
        for i in range(3):
            postln_model.decode_step(prev[:, i], memory, pad_mask, caches, i)
        postln_model.reorder_caches(caches, order)
        memory, pad_mask = memory.index_select(0, order), pad_mask.index_select(0, order)
        # after the reorder, rows continue with new (diverging) continuations
        cont = random_tokens(3, 3, seed=9)
        steps = [
            postln_model.decode_step(cont[:, j], memory, pad_mask, caches, 3 + j) for j in range(3)
        ]
        expected = postln_model(src[order], torch.cat([prev[order, :3], cont], dim=1))[:, 3:]
    torch.testing.assert_close(torch.stack(steps, 1), expected, rtol=0, atol=ATOL)
    for cache in caches:
        assert cache["self_k"].shape[0] == 3


def test_source_padding_does_not_change_non_pad_outputs() -> None:
    model = build_model(tiny_config(residual="postln", encoder_layers=3, decoder_layers=2), 8)
    model.eval()
    short, long = random_tokens(1, 4, seed=1), random_tokens(1, 9, seed=2)
    prev = random_tokens(2, 5, seed=3)
    batch = torch.full((2, 9), PAD_ID)
    batch[0, :4], batch[1] = short[0], long[0]
    with torch.no_grad():
        memory, pad_mask = model.encode(batch)
        alone_memory, _ = model.encode(short)
        logits = model(batch, prev)
        alone = model(short, prev[:1])
        long_alone = model(long, prev[1:])
        # padding actually changes something when it is not masked (the test can fail)
        unmasked = model.decode(prev[:1], memory[:1], torch.zeros_like(pad_mask[:1]))
    assert pad_mask[0].tolist() == [False] * 4 + [True] * 5
    torch.testing.assert_close(memory[0, :4], alone_memory[0], rtol=0, atol=ATOL)
    torch.testing.assert_close(logits[0], alone[0], rtol=0, atol=ATOL)
    torch.testing.assert_close(logits[1], long_alone[0], rtol=0, atol=ATOL)
    assert (unmasked[0] - alone[0]).abs().max() > 1e-2


def test_padded_incremental_decoding_matches_unpadded() -> None:
    model = build_model(tiny_config(residual="deepnorm"), 2).eval()
    short = random_tokens(1, 3, seed=1)
    batch = torch.cat([short, torch.full((1, 4), PAD_ID)], dim=1)
    batch = torch.cat([batch, random_tokens(1, 7, seed=2)], dim=0)
    prev = random_tokens(2, 4, seed=3)
    with torch.no_grad():
        padded = _incremental_logits(model, batch, prev)
        alone = model(short, prev[:1])
    torch.testing.assert_close(padded[0], alone[0], rtol=0, atol=ATOL)
