"""The optimised paths compute what the reference paths compute (no timing here)."""

from __future__ import annotations

import pytest
import torch

from megatron_branchnorm.model import build_model
from megatron_branchnorm.model.loss import (
    label_smoothed_nll_loss,
    reference_label_smoothed_nll_loss,
)
from megatron_branchnorm.model.residual import Residual, select_layernorm
from megatron_branchnorm.tokens import PAD_ID

from .helpers import random_tokens, tiny_config


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_fused_loss_matches_reference_values_and_gradients(eps: float) -> None:
    torch.manual_seed(0)
    logits = (torch.randn(3, 7, 50) * 4).requires_grad_()
    target = torch.randint(4, 50, (3, 7))
    target[0, 4:] = PAD_ID
    target[2, 6] = PAD_ID
    fused = label_smoothed_nll_loss(logits, target, eps)
    (fused[0] * 0.7 + fused[1] * 0.2).backward()
    g_fused, logits.grad = logits.grad.clone(), None
    ref = reference_label_smoothed_nll_loss(logits, target, eps)
    (ref[0] * 0.7 + ref[1] * 0.2).backward()
    torch.testing.assert_close(fused[0], ref[0], rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(fused[1], ref[1], rtol=1e-6, atol=1e-5)
    assert int(fused[2]) == int(ref[2]) == 17
    torch.testing.assert_close(g_fused, logits.grad, rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(g_fused[0, 4:]) == 0


def test_fused_loss_keeps_bf16_gradient_dtype() -> None:
    logits = torch.randn(2, 3, 20).bfloat16().requires_grad_()
    target = torch.randint(4, 20, (2, 3))
    loss, _, _ = label_smoothed_nll_loss(logits, target, 0.1)
    assert loss.dtype == torch.float32
    loss.backward()
    assert logits.grad.dtype == torch.bfloat16
    ref, _, _ = reference_label_smoothed_nll_loss(logits, target, 0.1)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("scheme", ["branchnorm", "deepnorm", "postln"])
def test_fused_residual_add_equals_the_written_equation(scheme: str) -> None:
    torch.manual_seed(1)
    block = Residual(scheme, 16, dropout=0.0, deepnorm_alpha=1.7, layernorm_impl="torch")
    block.branch_scale = 0.3
    x = torch.randn(2, 5, 16)

    def f(h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h) * 2.0

    expected_pre = {
        "branchnorm": x + 0.3 * f(x),
        "deepnorm": 1.7 * x + f(x),
        "postln": x + f(x),
    }[scheme]
    expected = torch.nn.functional.layer_norm(expected_pre, (16,))
    torch.testing.assert_close(block(x, f), expected, rtol=0, atol=1e-6)


def test_branchnorm_at_alpha_one_is_postln_bitwise() -> None:
    src, prev = random_tokens(2, 6, seed=1), random_tokens(2, 5, seed=2)
    a = build_model(tiny_config(residual="branchnorm", branchnorm_steps=10), 3).eval()
    b = build_model(tiny_config(residual="postln"), 3).eval()
    b.load_state_dict(a.state_dict())
    a.set_step(10)
    assert torch.equal(a(src, prev), b(src, prev))


def test_auto_layernorm_on_cpu_never_tries_apex(monkeypatch: pytest.MonkeyPatch) -> None:
    import megatron_branchnorm.model.residual as residual

    def boom() -> None:
        raise AssertionError("apex import attempted on CPU")

    monkeypatch.setattr(residual, "apex_layernorm_class", boom)
    assert select_layernorm("auto", "cpu") == "torch"


# ---------------------------------------------------------------------------------------------
# The update (issue 41, item 3): host syncs per update, multi-tensor bf16 accumulation
# ---------------------------------------------------------------------------------------------

UPDATE_OVERRIDES = [
    "pipeline.stages=1",
    "model.encoder_layers=1",
    "model.decoder_layers=1",
    "pipeline.activation_checkpoint_interval=1",
    "train.micro_batches=2",
    "train.clip_grad=0.5",  # clips: the gradient norm of tiny_cpu's first updates is above 1
    "train.max_steps=3",
    "train.save_interval=0",
    "train.eval_interval=0",
    "train.log_interval=100",
]


def _train_counted(save_dir, ds: str, multi_tensor: bool | None = None) -> dict:
    """The real trainer (tiny_cpu, 1 stage, in this process) for 3 updates; the host syncs of
    updates 2 and 3 inside ``train_batch`` (HostSyncCounter), and what the run ends with."""
    from megatron_branchnorm.config import load_config
    from megatron_branchnorm.experiments.capture_audit import HostSyncCounter
    from megatron_branchnorm.training.bf16_grads import install_bf16_grad_accumulation
    from megatron_branchnorm.training.trainer import Trainer

    cfg = load_config(
        "tiny_cpu",
        [*UPDATE_OVERRIDES, f"train.deepspeed_config=ds_configs/{ds}.json",
         f"train.save_dir={save_dir}"],
    )  # fmt: skip
    trainer = Trainer(cfg)
    if multi_tensor is not None:
        assert install_bf16_grad_accumulation(trainer.engine, multi_tensor=multi_tensor)
    counter, calls, original = HostSyncCounter(), [], trainer.engine.train_batch

    def train_batch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:  # the first update: lazy optimizer state
            return original(*args, **kwargs)
        with counter:
            return original(*args, **kwargs)

    trainer.engine.train_batch = train_batch
    trainer.checkpointer.save_if_missing = lambda *_a, **_k: None
    assert trainer.train() == 0
    opt = trainer.engine.optimizer
    return {
        "syncs_per_update": counter.host_syncs / (len(calls) - 1),
        "sites": dict(counter.sites),
        "weights": [p.detach().clone() for p in trainer.module.parameters()],
        "master": [t.detach().clone() for t in getattr(opt, "fp32_groups_flat_partition", [])],
        "grad_norm": float(trainer.engine.get_global_grad_norm()),
        "accumulation": getattr(opt, "accumulate_hp_grads_and_remove_lp", None),
        "param_tensors": sum(1 for p in trainer.module.parameters() if p.requires_grad),
    }


@pytest.fixture(scope="module")
def update_runs(tmp_path_factory):
    """fp32, bf16 (the CPU's per-parameter accumulation) and bf16 with the multi-tensor
    accumulation CUDA takes by default, on one world of one rank."""
    import signal

    from megatron_branchnorm.training.stop_signals import STOP_SIGNALS

    from .helpers import one_rank_process_group

    base = tmp_path_factory.mktemp("update")
    handlers = {sig: signal.getsignal(sig) for sig in (*STOP_SIGNALS, signal.SIGINT)}
    try:
        with one_rank_process_group():
            yield {
                "fp32": _train_counted(base / "fp32", "cpu_fp32"),
                "bf16": _train_counted(base / "bf16", "zero1_bf16"),
                "bf16_multi": _train_counted(base / "bf16m", "zero1_bf16", multi_tensor=True),
            }
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


@pytest.mark.parametrize("run", ["fp32", "bf16", "bf16_multi"])
def test_one_host_sync_per_update(update_runs, run: str) -> None:
    """At most one host sync per update inside train_batch (2 micro-batches, recompute,
    clipping that clips): fp32 reads the all-stage norm once (collectives.to_host); bf16 reads
    DeepSpeed's validity check once (before issue 41 its clipping read the norm a second time:
    ``if clip_coef < 1``)."""
    r = update_runs[run]
    assert r["syncs_per_update"] == 1, r["sites"]


def test_multi_tensor_bf16_accumulation_is_bit_identical(update_runs) -> None:
    """The multi-tensor accumulation (CUDA's default) gives the per-parameter add's results
    bit for bit (bf16 weights, fp32 master weights, the gradient norm), with a few adds per
    micro-batch instead of one per parameter tensor."""
    ref, multi = update_runs["bf16"], update_runs["bf16_multi"]
    assert all(torch.equal(a, b) for a, b in zip(ref["weights"], multi["weights"], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(ref["master"], multi["master"], strict=True))
    assert ref["grad_norm"] == multi["grad_norm"]
    acc = multi["accumulation"]
    backward_passes = 3 * 2  # 3 updates of 2 micro-batches
    # one run of adjacent parameters per backward (the stage's one parameter group)
    assert acc.adds == backward_passes, (acc.adds, multi["param_tensors"])
    assert multi["param_tensors"] > 20 and not acc.pending
    assert not hasattr(ref["accumulation"], "adds")  # the CPU keeps DeepSpeed's method
