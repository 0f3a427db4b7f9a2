"""The capture-safety audit (megatron_branchnorm/experiments/capture_audit.py).

(a) The audit sees what a CUDA graph cannot capture, on a CPU: host syncs (an aten op and the
Tensor methods that dispatch none), tensors made from host data, copies between the host and a
device (the meta device standing in for a GPU), ops whose output size depends on the data, and
a Python float that changes between replays. (b) The region a graph would
capture, a pipeline stage's layer stack forward and backward for one micro-batch (encoder and
decoder layers as train.py runs them, with the stage's padding bias and BranchNorm's alpha_t
tensor; not the embedding lookup, not DeepSpeed's send/recv), run twice on two batches of the
same bucket shape with different padding and a different alpha_t: no finding, the same ops on
the same shapes. The flat model's layers are checked the same way.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron_branchnorm.experiments.capture_audit import (
    CaptureAudit,
    HostSyncCounter,
    audited,
    replay_difference,
)
from megatron_branchnorm.model import build_model
from megatron_branchnorm.model.residual import set_branch_scale, stack_constants
from megatron_branchnorm.parallel.pipeline import DecoderLayerPipe, EncoderLayerPipe
from megatron_branchnorm.tokens import PAD_ID
from tests.core.helpers import random_tokens, tiny_config
from tests.experiments.test_launches import MetaReadsAsZeros

B, S, T = 3, 7, 6
"""The bucket shape of both replays: sentences x source length x target length."""


def test_the_audit_sees_syncs_host_data_and_data_sized_outputs() -> None:
    x = torch.randn(5)
    with audited() as audit:
        y = x * 2
        float(y.sum())  # _local_scalar_dense
        y.tolist()  # no aten op on a CPU tensor: the method is watched
        y.cpu()
        torch.tensor([1.0, 2.0])  # host data into a new tensor (a pageable copy on a GPU)
        y[y > 0]  # output size read from the data
    kinds = [f.kind for f in audit.findings]
    assert kinds.count("host sync") == 4, audit.findings  # float, tolist, cpu, the bool index
    assert "host-to-device copy" in kinds and "data-dependent size" in kinds
    sites = {f.site for f in audit.findings}
    assert all(s.startswith("tests/experiments/test_capture_audit.py:") for s in sites), sites
    assert torch.Tensor.tolist is torch._C.TensorBase.tolist  # unwrapped again
    with audited() as clean:
        (x * 2).add_(1.0).sum()
    assert clean.findings == [] and clean.host_syncs == 0


def test_a_python_float_that_changes_between_replays_is_a_difference() -> None:
    x = torch.randn(4, 3)
    runs = []
    for alpha in (0.25, 0.5):
        with audited() as audit:
            torch.add(x, x, alpha=alpha)  # a graph would bake the first alpha in
        runs.append(audit)
    diff = replay_difference(*runs)
    assert diff is not None and "aten.add.Tensor" in diff and "0.25" in diff and "0.5" in diff
    shared = torch.zeros(())
    runs = []
    for alpha in (0.25, 0.5):
        shared.fill_(alpha)  # outside the region, as set_branch_scale does once per update
        with audited() as audit:
            torch.addcmul(x, x, shared)
        runs.append(audit)
    assert replay_difference(*runs) is None
    with audited() as longer:
        torch.addcmul(x, x, shared).relu()
    assert "ran 1 and 2 ops" in replay_difference(runs[0], longer)


def test_host_sync_counter_counts_by_caller() -> None:
    x = torch.randn(3)
    with HostSyncCounter() as counter:
        bool(x.sum() > 0)
        x.tolist()
        x.tolist()
    assert counter.host_syncs == 3
    assert counter.syncs == {"_local_scalar_dense": 1, "Tensor.tolist": 2}
    assert sum(counter.sites.values()) == 3


def test_the_audit_sees_copies_between_host_and_device() -> None:
    """The meta device stands in for a GPU (its copies to the host give zeros)."""
    device, host = torch.randn(3, device="meta"), torch.zeros(3)
    with MetaReadsAsZeros(), audited() as audit:
        host.to("meta")
        torch.empty(3, device="meta").copy_(host)
        device.to("cpu", torch.float64)
        host.copy_(device)
        host.to(torch.float64)  # host to host: nothing to find
        device.to(torch.float64)  # on the device: nothing either
    kinds = [f.kind for f in audit.findings]
    assert kinds == ["host-to-device copy"] * 2 + ["device-to-host copy"] * 2, audit.findings


def _batch(seed: int, cfg) -> tuple:
    """One micro-batch of the bucket shape (B, S, T): the stage's inputs (the embeddings'
    outputs stand in as leaves made outside the region), padding that differs with the seed,
    and the gradient arriving at the stage's output."""
    gen = torch.Generator().manual_seed(seed)
    src, prev = random_tokens(B, S, seed), random_tokens(B, T, seed + 100)
    for row in range(B):
        cut = int(torch.randint(2, S + 1, (1,), generator=gen))
        src[row, cut:] = PAD_ID
    c = cfg.hidden_size
    x_enc = torch.randn(B, S, c, generator=gen).requires_grad_()
    x_dec = torch.randn(B, T, c, generator=gen).requires_grad_()
    grad_out = torch.randn(B, T, c, generator=gen)
    return x_enc, x_dec, src, prev, grad_out


def _stage(cfg) -> nn.ModuleList:
    """A pipeline stage's encoder and decoder layers (pipeline.EncoderLayerPipe /
    DecoderLayerPipe, as layer_specs builds them; the last decoder layer returns x alone)."""
    (a_enc, b_enc), (a_dec, b_dec) = stack_constants(cfg)
    layers = [EncoderLayerPipe(cfg, a_enc, b_enc, 1, i) for i in range(cfg.encoder_layers)]
    layers += [DecoderLayerPipe(cfg, a_dec, b_dec, 1, i) for i in range(cfg.decoder_layers)]
    return nn.ModuleList(layers)


def _run_stage(stage: nn.ModuleList, cfg, batch: tuple, recompute: bool) -> None:
    """Forward through the layer stack (each layer recomputed in the backward with
    ``recompute``, as DeepSpeed's activation checkpointing wraps them), then the backward."""
    x_enc, x_dec, src, prev, grad_out = batch

    def call(layer: nn.Module, inputs):
        return checkpoint(layer, inputs, use_reentrant=False) if recompute else layer(inputs)

    h = (x_enc, src, prev)
    for layer in stage[: cfg.encoder_layers]:
        h = call(layer, h)
    h = (x_dec, h[0], src)
    for layer in stage[cfg.encoder_layers :]:
        h = call(layer, h)
    h.backward(grad_out)


def _audit_twice(region, cfg, module: nn.Module) -> list[CaptureAudit]:
    """``region(batch)`` recorded for two batches and two values of alpha_t (steps 3 and 7 of
    branchnorm_steps = 10); the batch and alpha_t are made outside the region, as the trainer
    makes them."""
    audits = []
    for seed, step in ((1, 3), (2, 7)):
        batch = _batch(seed, cfg)
        set_branch_scale(module, cfg, step)
        # Parameter gradients start empty, as the bf16 optimizer's hooks leave them after each
        # micro-batch: backward then hands each gradient over (no kernel). Added into an
        # existing .grad (fp32 accumulation over micro-batches) the ops differ from the first
        # micro-batch's, so a graph must leave the accumulation outside (training/graph_capture
        # returns parameter gradients as graph outputs).
        module.zero_grad(set_to_none=True)
        with audited() as audit:
            region(batch)
        audits.append(audit)
    return audits


def _assert_capturable(audits: list[CaptureAudit]) -> None:
    for audit in audits:
        assert audit.findings == [], "\n".join(f.line() for f in audit.findings)
        assert audit.host_syncs == 0
    assert replay_difference(*audits) is None, replay_difference(*audits)
    assert len(audits[0].calls) > 50  # the layers really ran inside the region


@pytest.mark.parametrize(
    ("residual", "recompute"),
    [("branchnorm", False), ("branchnorm", True), ("deepnorm", False)],
    ids=["branchnorm", "branchnorm-recompute", "deepnorm"],
)
def test_a_pipeline_stage_layer_stack_is_capture_safe(residual: str, recompute: bool) -> None:
    cfg = tiny_config(residual=residual, branchnorm_steps=10, dropout=0.1, attention_dropout=0.1)
    torch.manual_seed(0)
    stage = _stage(cfg).train()
    audits = _audit_twice(lambda batch: _run_stage(stage, cfg, batch, recompute), cfg, stage)
    _assert_capturable(audits)
    ops = audits[0].op_counts()
    # 10 residual blocks (2 encoder layers x 2, 2 decoder layers x 3), each one LayerNorm: all
    # forward and backward, and forward again in the recompute
    assert ops["aten.native_layer_norm.default"] == (20 if recompute else 10), ops
    assert ops["aten.native_layer_norm_backward.default"] == 10, ops


def test_the_flat_model_layer_stack_is_capture_safe() -> None:
    cfg = tiny_config(residual="branchnorm", branchnorm_steps=10, dropout=0.1)
    torch.manual_seed(0)
    model = build_model(cfg, 1).train()

    def region(batch: tuple) -> None:
        x_enc, x_dec, src, _, grad_out = batch
        pad_mask = src.eq(PAD_ID)
        x = x_enc
        for layer in model.encoder_layers:
            x = layer(x, pad_mask)
        y = x_dec
        for layer in model.decoder_layers:
            y = layer(y, x, pad_mask)
        y.backward(grad_out)

    _assert_capturable(_audit_twice(region, cfg, model))
