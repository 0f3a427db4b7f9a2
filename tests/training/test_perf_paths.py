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
from tests.core.helpers import random_tokens, tiny_config


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
# The update: host syncs per update, multi-tensor bf16 accumulation
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


def _train_counted(
    save_dir, ds: str, multi_tensor: bool | None = None, signal_in: int | None = None
) -> dict:
    """The real trainer (tiny_cpu, 1 stage, in this process) for 3 updates, its stop check
    deferred as on NCCL (training/stopping.py); the host syncs of updates 2 and 3 inside
    ``train_batch``, those of the whole of update 2 (from its start to the start of update 3:
    alpha, train_batch, the loss sums, the stop check, the bookkeeping; not the collation of
    its batches on the host; update 3 logs its row), and what the run ends with. ``signal_in``: SIGUSR1 during that update."""
    import signal

    from megatron_branchnorm.config import load_config
    from megatron_branchnorm.experiments.capture_audit import HostSyncCounter
    from megatron_branchnorm.formats import checkpoint as ckpt
    from megatron_branchnorm.training.bf16_grads import install_bf16_grad_accumulation
    from megatron_branchnorm.training.trainer import Trainer

    cfg = load_config(
        "tiny_cpu",
        [*UPDATE_OVERRIDES, f"train.deepspeed_config=ds_configs/{ds}.json",
         f"train.save_dir={save_dir}"],
    )  # fmt: skip
    trainer = Trainer(cfg)
    trainer.stopper.deferred = True  # CUDA's path (gloo reads the flags at once)
    if multi_tensor is not None:
        assert install_bf16_grad_accumulation(trainer.engine, multi_tensor=multi_tensor)
    counter, calls, original = HostSyncCounter(), [], trainer.engine.train_batch
    whole, updates, update = HostSyncCounter(), [], trainer._update

    def train_batch(*args, **kwargs):
        calls.append(1)
        if len(calls) == signal_in:
            signal.raise_signal(signal.SIGUSR1)
        if len(calls) == 1:  # the first update: lazy optimizer state
            return original(*args, **kwargs)
        with counter:
            return original(*args, **kwargs)

    def counted_update(t: int):
        updates.append(t)
        if len(updates) == 2:
            whole.__enter__()
        elif len(updates) == 3:
            whole.__exit__(None, None, None)
        return update(t)

    next_update = trainer.stream.next_update

    def host_batches():
        """The update's batches, left out of the count: collated on the host (CPU tensors
        that to_device copies to the GPU later), their reads wait for no device."""
        if len(updates) != 2:
            return next_update()
        whole.__exit__(None, None, None)
        try:
            return next_update()
        finally:
            whole.__enter__()

    trainer.engine.train_batch = train_batch
    trainer.stream.next_update = host_batches
    trainer._update = counted_update
    trainer.checkpointer.save_if_missing = lambda *_a, **_k: None
    try:
        code = trainer.train()
    finally:
        if len(updates) == 2:  # stopped after update 2: the count ends with the run
            whole.__exit__(None, None, None)
    opt = trainer.engine.optimizer
    return {
        "exit_code": code,
        "step": trainer.state.step,
        "updates": len(updates),
        "latest": ckpt.read_latest(save_dir),
        "syncs_per_update": counter.host_syncs / (len(calls) - 1),
        "sites": dict(counter.sites),
        "whole_update_syncs": whole.host_syncs,
        "whole_update_sites": dict(whole.sites),
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
    from tests.core.helpers import one_rank_process_group

    base = tmp_path_factory.mktemp("update")
    handlers = {sig: signal.getsignal(sig) for sig in (*STOP_SIGNALS, signal.SIGINT)}
    try:
        with one_rank_process_group():
            yield {
                "fp32": _train_counted(base / "fp32", "cpu_fp32", signal_in=2),
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
    DeepSpeed's validity check once (before the change its clipping read the norm a second time:
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


@pytest.mark.parametrize("run", ["fp32", "bf16", "bf16_multi"])
def test_one_host_sync_per_whole_update(update_runs, run: str) -> None:
    """At most one host sync in the whole of an unlogged update on the trainer's path (alpha_t,
    the batches' copies, train_batch, the loss sums, the stop check, the skip and step
    bookkeeping; the collation on the host of CPU tensors is left out as it waits for no GPU):
    the one inside train_batch. The stop check's flags are read one check later from host
    memory (on CUDA pinned, copied without blocking): before, ``Stopper.check`` read this
    update's all-reduced flags with ``tolist`` (a second wait for the GPU, and on CUDA a
    third in the pageable ``torch.tensor(flags, device=...)``)."""
    r = update_runs[run]
    assert r["whole_update_syncs"] == 1, r["whole_update_sites"]


def test_deferred_stop_is_taken_one_update_later_and_saved(update_runs) -> None:
    """SIGUSR1 during update 2 of 3, the stop check deferred: the run stops after update 3 on
    the flags sent after update 2, saves update 3 (the last applied) and exits REQUEUE."""
    from megatron_branchnorm.formats import checkpoint as ckpt
    from megatron_branchnorm.training import stop_signals
    from megatron_branchnorm.training.exit_codes import REQUEUE_EXIT_CODE

    r = update_runs["fp32"]
    assert (r["exit_code"], r["step"], r["updates"]) == (REQUEUE_EXIT_CODE, 3, 3)
    assert r["latest"] == ckpt.tag_for(3)
    assert stop_signals.received() == 0  # the stop consumed it
    assert update_runs["bf16"]["exit_code"] == 0


class _ThreadWorld:
    """Ranks as threads of this process: the all-reduce (max) and the object all-gather the
    Stopper issues, and a stop signal, a clock and an error of each rank's own."""

    def __init__(self, ranks: int) -> None:
        import threading

        self.ranks = ranks
        self.barrier = threading.Barrier(ranks, timeout=60)
        self.slots: list = [None] * ranks
        self.local = threading.local()
        self.signals = [0] * ranks

    def _exchange(self, value):
        self.slots[self.local.rank] = value
        self.barrier.wait()
        values = list(self.slots)
        self.barrier.wait()  # every rank has read the slots before they are written again
        return values

    def all_reduce(self, values, op="sum", group=None, dtype=torch.float64):  # noqa: ARG002
        assert op == "max"
        mine = torch.as_tensor(values, dtype=dtype).clone()
        return torch.stack(self._exchange(mine)).amax(0)

    def all_gather_object(self, obj, group=None):  # noqa: ARG002
        return self._exchange(obj)

    def received(self) -> int:
        return self.signals[self.local.rank]

    def clear(self) -> None:
        self.signals[self.local.rank] = 0


def _checks_on_every_rank(
    monkeypatch, deferred: bool, events: dict, checks: int = 5, settle: bool = False
) -> list:
    """Each of 2 thread ranks runs ``checks`` stop checks (or until one stops it), then with
    ``settle`` the end-of-loop :meth:`Stopper.settle` (its result: ``"settled"`` or the error);
    ``events[(rank, check)]`` is what happens to that rank just before that check (1-based):
    ``"signal"``, ``"time"`` (its clock passes the 1-minute budget) or ``"error"``. Returns
    each rank's list of check results (a TrainError as its message)."""
    import concurrent.futures

    from megatron_branchnorm.training import stopping

    world = _ThreadWorld(2)
    monkeypatch.setattr(stopping.collectives, "all_reduce", world.all_reduce)
    monkeypatch.setattr(stopping.collectives, "all_gather_object", world.all_gather_object)
    monkeypatch.setattr(
        stopping.collectives, "communication_device", lambda g=None: torch.device("cpu")
    )
    monkeypatch.setattr(stopping, "stop_signals", world)

    def rank_main(rank: int) -> list:
        world.local.rank = rank
        state = {"elapsed": 0.0, "error": None}
        stopper = stopping.Stopper(
            2, 1.0, lambda: state["error"], lambda: state["elapsed"], deferred=deferred
        )
        results: list = []
        for check in range(1, checks + 1):
            event = events.get((rank, check))
            if event == "signal":
                world.signals[rank] = 10
            elif event == "time":
                state["elapsed"] = 61.0
            elif event == "error":
                state["error"] = "disk full"
            try:
                results.append(stopper.check())
            except stopping.TrainError as exc:
                results.append(str(exc))
            if results[-1] is not None:
                break
        if settle and results[-1] is None:
            try:
                stopper.settle()
                results.append("settled")
            except stopping.TrainError as exc:
                results.append(str(exc))
        return results

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return list(pool.map(rank_main, range(2)))


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize(
    ("event", "stop"),
    [("signal", "signal"), ("time", "time"), ("error", "disk full (rank 1)")],
)
def test_every_rank_takes_the_same_stop_at_the_same_check(
    monkeypatch, deferred: bool, event: str, stop: str
) -> None:
    """A signal, the time budget or an error on rank 1 alone, just before check 2: every rank
    stops at check 2 (gloo's synchronous check) or at check 3 (deferred, CUDA's), alike."""
    results = _checks_on_every_rank(monkeypatch, deferred, {(1, 2): event})
    expected = [None, stop] if not deferred else [None, None, stop]
    assert results == [expected, expected]


def test_deferred_check_sends_no_flags_once_it_stops(monkeypatch) -> None:
    """Rank 0 signalled before check 1 and rank 1 before check 2: both stop at check 2 on
    check 1's flags (rank 1's signal, not yet agreed, does not delay or repeat the stop)."""
    results = _checks_on_every_rank(monkeypatch, True, {(0, 1): "signal", (1, 2): "signal"})
    assert results == [[None, "signal"], [None, "signal"]]


@pytest.mark.parametrize("deferred", [False, True])
def test_an_error_of_the_last_update_is_raised_at_the_end_on_every_rank(
    monkeypatch, deferred: bool
) -> None:
    """An error on rank 1 alone just before the last check: the synchronous check raises it
    there; the deferred one has not read it yet, and the end of the loop (``settle``) raises
    it on every rank instead of letting the run end with exit 0."""
    results = _checks_on_every_rank(monkeypatch, deferred, {(1, 3): "error"}, 3, settle=True)
    last = "disk full (rank 1)"
    expected = [None, None, None, last] if deferred else [None, None, last]
    assert results == [expected, expected]
