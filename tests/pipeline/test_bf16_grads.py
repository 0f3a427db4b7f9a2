"""bf16 gradient accumulation in one kernel per parameter tensor per micro-batch
(megatron_branchnorm/training/bf16_grads.py).

Two runs of the same training, 3 updates of 2 micro-batches each (tiny model, synthetic data,
dropout 0, activation checkpointing on every layer, clipping that clips): DeepSpeed's default
bf16 path (``immediate_grad_update`` off, nothing installed) and ours (the flag on, as in
``zero1_bf16.json``, and ``install_bf16_grad_accumulation``). 1 stage runs in this process; 2
stages (the tied embedding's gradient all-reduced across them) on two gloo ranks started from
this file (``python -m tests.pipeline.test_bf16_grads OUT``).

Counts: a TorchDispatchMode counts, in every BackwardPass instruction (one micro-batch), the
aten ops of the gradient accumulation: those run by autograd's AccumulateGrad nodes (with the
hooks they call) and those outside autograd that read or write a bf16 grad or the fp32
gradient buffer (DeepSpeed's clear_lp_grads / update_hp_grads); views and allocations are not
kernels and are left out; a foreach op counts once per tensor. The rest of the backward is
counted too, and must be the same in both runs. On CUDA each counted op is one kernel launch
(a foreach op launches one per chunk of tensors: fewer than one per tensor); on CPU the mixed
bf16/fp32 add widens its bf16 operand in a copy inside the op, which the dispatcher does not
see, so the count is the GPU's, not the CPU's work.

Parity: exact (losses, gradient norms, fp32 master weights, bf16 weights). Our add is
DeepSpeed's: the bf16 gradient widened to fp32 (exact) and added to the same fp32 buffer in the
same order, once per micro-batch; only where the cast happens differs (inside the add).
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tests.core.helpers import one_rank_process_group

STEPS = 3
MICRO = 2
SAVE_AT = 2  # the fixed 1-stage run saves here; a fresh engine loads it and runs the rest
_ALLOC = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
_ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"


class GradAccumulationOps(TorchDispatchMode):
    """Counts kernel ops (module docstring): ``accum`` of the gradient accumulation, ``rest``
    the others, ``names`` the accumulation's ops by name."""

    def __init__(self, optimizer) -> None:
        super().__init__()
        self.params = [p for group in optimizer.bf16_groups for p in group]
        self.hp = {t.untyped_storage().data_ptr() for t in optimizer.fp32_groups_gradients_flat}
        self.accum = self.rest = 0
        self.names: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.is_view or func.overloadpacket.__name__ in _ALLOC:
            return func(*args, **kwargs)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        node = torch._C._current_autograd_node()
        if node is not None and node.name() == _ACCUMULATE_GRAD:
            n = 1  # AccumulateGrad's own add or copy, or the hook's add
        else:
            watched = self.hp | {
                p.grad.untyped_storage().data_ptr() for p in self.params if p.grad is not None
            }
            hits = sum(t.untyped_storage().data_ptr() in watched for t in tensors)
            n = (hits if func.name().startswith("aten::_foreach") else 1) if hits else 0
        if n:
            self.accum += n
            self.names[func.overloadpacket.__name__] += n
        else:
            self.rest += 1
        return func(*args, **kwargs)


def _count_backward_passes(engine, records: list) -> None:
    """Wrap this engine's BackwardPass instruction (an instance copy of the map, as
    pipeline.install_backward_once does) to count each micro-batch's ops into ``records``."""
    from deepspeed.runtime.pipe import schedule

    inner = engine._INSTRUCTION_MAP[schedule.BackwardPass]

    def counted(eng, buffer_id):
        with GradAccumulationOps(eng.optimizer) as ops:
            inner(eng, buffer_id)
        records.append({"accum": ops.accum, "rest": ops.rest, "names": dict(ops.names)})

    engine._INSTRUCTION_MAP = {**engine._INSTRUCTION_MAP, schedule.BackwardPass: counted}


def _model_config(stages: int):
    from megatron_branchnorm.config import load_config

    return load_config(
        "tiny_cpu",
        [
            "model.dropout=0.0",
            "model.encoder_layers=2",
            "model.decoder_layers=2",
            f"pipeline.stages={stages}",
            f"train.micro_batches={MICRO}",
            "train.clip_grad=0.5",
            "train.deepspeed_config=ds_configs/zero1_bf16.json",
        ],
    )


def _engine(stages: int, fixed: bool):
    """A bf16 + ZeRO-1 pipeline engine of ``stages`` stages, ours or DeepSpeed's default."""
    import deepspeed

    from megatron_branchnorm.model.residual import set_branch_scale
    from megatron_branchnorm.parallel.partition import partition_plan
    from megatron_branchnorm.parallel.pipeline import (
        PipeLoss,
        build_pipeline_module,
        install_engine_fixes,
    )
    from megatron_branchnorm.training.bf16_grads import install_bf16_grad_accumulation
    from megatron_branchnorm.training.ds_config import load_ds_config
    from megatron_branchnorm.training.grad_norm import SkipNonfiniteAdamW

    cfg = _model_config(stages)
    ds = load_ds_config(cfg, 1)
    ds["bf16"]["immediate_grad_update"] = fixed
    loss_fn = PipeLoss(0.1)
    parts = partition_plan(cfg.model, stages, "balanced")
    module = build_pipeline_module(cfg.model, parts, cfg.train.seed, loss_fn, 1)
    set_branch_scale(module, cfg.model, 3)
    opt = SkipNonfiniteAdamW([p for p in module.parameters() if p.requires_grad], lr=3e-3)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=opt, config=ds)
    install_engine_fixes(engine)
    if fixed:
        assert install_bf16_grad_accumulation(engine) is True
    return engine, loss_fn


def _micro_batches(update: int, loss_fn) -> list:
    """Update ``update``'s 2 micro-batches of 4 sentences; the loss normalised over both."""
    from megatron_branchnorm.data.synthetic import SyntheticData, collate

    data = SyntheticData(64, _model_config(1).model.vocab_size, 20)
    batch = collate(data, list(range(8 * update, 8 * update + 8)))
    loss_fn.scale = MICRO / batch["ntokens"]
    return [
        (
            (batch["src_tokens"][i : i + 4], batch["prev_output_tokens"][i : i + 4]),
            batch["target"][i : i + 4],
        )
        for i in (0, 4)
    ]


def _train(engine, loss_fn, updates, counts: list | None = None) -> dict:
    """Run ``updates``; per update the loss and the gradient norm, then every parameter's
    fp32 master weight and bf16 weight."""
    from deepspeed.utils import safe_get_full_fp32_param

    if counts is not None:
        _count_backward_passes(engine, counts)
    out = {"loss": [], "grad_norm": []}
    for u in updates:
        out["loss"].append(float(engine.train_batch(data_iter=iter(_micro_batches(u, loss_fn)))))
        out["grad_norm"].append(float(engine.get_global_grad_norm()))
    named = list(engine.module.named_parameters())
    out["fp32"] = {n: safe_get_full_fp32_param(p).clone() for n, p in named}
    out["bf16"] = {n: p.detach().clone() for n, p in named}
    out["n_params"] = sum(len(g) for g in engine.optimizer.bf16_groups)
    return out


def _run_both(stages: int, save_dir: Path | None = None) -> dict:
    """DeepSpeed's default and ours; with ``save_dir``, ours also saves at SAVE_AT and a fresh
    engine of ours resumes from there."""
    runs = {}
    for name, fixed in (("default", False), ("ours", True)):
        counts: list = []
        engine, loss_fn = _engine(stages, fixed)
        if save_dir is not None and fixed:
            first = _train(engine, loss_fn, range(SAVE_AT), counts)
            engine.save_checkpoint(str(save_dir), tag="mid")
            rest = _train(engine, loss_fn, range(SAVE_AT, STEPS))
            run = {**rest, "loss": first["loss"] + rest["loss"]}
            run["grad_norm"] = first["grad_norm"] + rest["grad_norm"]
            resumed, loss_fn = _engine(stages, True)
            resumed.load_checkpoint(str(save_dir), tag="mid")
            runs["resumed"] = _train(resumed, loss_fn, range(SAVE_AT, STEPS))
        else:
            run = _train(engine, loss_fn, range(STEPS), counts)
        runs[name] = {**run, "counts": counts}
    return runs


def _per_param(run: dict) -> list[float]:
    return [c["accum"] / run["n_params"] for c in run["counts"]]


def _check_counts(default: dict, ours: dict) -> None:
    n = min(len(default["counts"]), len(ours["counts"]))
    assert n >= 2 * MICRO  # two updates at least: the first micro-batch of an update differs
    before, after = _per_param(default)[:n], _per_param(ours)[:n]
    assert after == [1.0] * len(after), (after, ours["counts"][:2])
    assert min(before) >= 2 and sum(before) / len(before) >= 3, before
    # the rest of each backward is the same: the drop is all in the accumulation
    for b, a in zip(default["counts"][:n], ours["counts"][:n], strict=True):
        assert b["rest"] == a["rest"], (b, a)


def _check_parity(default: dict, ours: dict, keys=("loss", "grad_norm")) -> None:
    for key in keys:
        assert ours[key] == default[key], key
    for kind in ("fp32", "bf16"):
        assert ours[kind].keys() == default[kind].keys()
        for name, value in default[kind].items():
            assert torch.equal(ours[kind][name], value), (kind, name)


@pytest.fixture(scope="module")
def one_stage(tmp_path_factory):
    with one_rank_process_group():
        yield _run_both(1, tmp_path_factory.mktemp("bf16_grads"))


def test_one_kernel_per_parameter_per_micro_batch(one_stage):
    default, ours = one_stage["default"], one_stage["ours"]
    _check_counts(default, ours)
    print("kernels per parameter tensor per micro-batch:", _per_param(default), _per_param(ours))
    print("default:", default["counts"][:MICRO], "ours:", ours["counts"][:MICRO])


def test_same_training_as_deepspeeds_bf16_path(one_stage):
    default, ours = one_stage["default"], one_stage["ours"]
    assert len(set(default["grad_norm"])) == STEPS and min(default["grad_norm"]) > 0.5  # clipped
    _check_parity(default, ours)


def test_resume_from_a_checkpoint_of_ours_is_exact(one_stage):
    ours, resumed = one_stage["ours"], one_stage["resumed"]
    assert resumed["loss"] == ours["loss"][SAVE_AT:]
    assert resumed["grad_norm"] == ours["grad_norm"][SAVE_AT:]
    _check_parity(ours, resumed, keys=())


def test_shipped_bf16_json_turns_immediate_grad_update_on():
    from megatron_branchnorm.resources import find_ds_config

    ds = json.loads(find_ds_config("ds_configs/zero1_bf16.json").read_text())
    assert ds["bf16"] == {"enabled": True, "immediate_grad_update": True}


def test_engines_without_the_bf16_optimizer_are_left_alone():
    from megatron_branchnorm.training.bf16_grads import install_bf16_grad_accumulation

    class FakeEngine:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)

    assert install_bf16_grad_accumulation(FakeEngine()) is False


def test_a_deepspeed_without_what_it_replaces_is_refused(monkeypatch):
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    from megatron_branchnorm.training.bf16_grads import install_bf16_grad_accumulation

    class FakeEngine:
        optimizer = object.__new__(BF16_Optimizer)

    monkeypatch.delattr(BF16_Optimizer, "accumulate_hp_grads_and_remove_lp")
    with pytest.raises(RuntimeError, match=r"DeepSpeed .*accumulate_hp_grads_and_remove_lp"):
        install_bf16_grad_accumulation(FakeEngine())


@pytest.mark.distributed
def test_two_stages_with_the_tied_embedding_all_reduced(tmp_path):
    from tests.pipeline.conftest import launch_ranks

    procs = launch_ranks(["-m", "tests.pipeline.test_bf16_grads", str(tmp_path)], 2, tmp_path)
    codes = [p.wait(timeout=300) for p in procs]
    if codes != [0, 0]:
        logs = "".join((tmp_path / f"rank{r}.log").read_text()[-2500:] for r in (0, 1))
        pytest.fail(f"ranks exited {codes}:\n{logs}")
    ranks = [torch.load(tmp_path / f"result{r}.pt", weights_only=True) for r in (0, 1)]
    tied = "tied_modules.embed.embedding.weight"
    for rank, runs in enumerate(ranks):
        _check_counts(runs["default"], runs["ours"])
        _check_parity(runs["default"], runs["ours"])
        print(f"stage {rank}:", _per_param(runs["default"]), _per_param(runs["ours"]))
    for name in ("default", "ours"):
        # each stage holds a copy of the embedding: all-reduced gradients keep them equal
        assert torch.equal(ranks[0][name]["fp32"][tied], ranks[1][name]["fp32"][tied]), name
        assert ranks[0][name]["loss"] == ranks[1][name]["loss"]


def _worker(out: Path) -> None:
    """One rank of the 2-stage check: both runs, results to out/result{rank}.pt."""
    from megatron_branchnorm.training import environment

    environment.set_thread_count()
    rank, _ = environment.init_process_group(120)
    try:
        runs = _run_both(2)
        torch.save(runs, out / f"result{rank}.pt")
    finally:
        environment.destroy_process_group()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
    sys.stdout.flush()
    os._exit(0)


def test_multi_tensor_accumulation_adds_runs_as_each_gradient_alone():
    """bf16_grads._MultiTensorAccumulation over two parameter groups with a gap in one flat
    buffer, a bucket that cuts the backward, and micro-batches that reuse the kept plans:
    every fp32 slice ends bit-identical to adding each bf16 gradient alone, in one add per
    run of adjacent parameters per flush."""
    import types

    from megatron_branchnorm.training.bf16_grads import _MultiTensorAccumulation

    gen = torch.Generator().manual_seed(0)
    sizes = [[3, 5, 4, 2], [6, 1, 7]]
    params = [[torch.randn(n, generator=gen).bfloat16().requires_grad_() for n in g] for g in sizes]
    flats, slices = [], []
    for group, g_sizes in enumerate(sizes):
        gap = 2 if group == 0 else 0  # group 0's third slice starts 2 elements late: two runs
        flat = torch.zeros(sum(g_sizes) + gap)
        offsets = [sum(g_sizes[:i]) + (gap if i >= 2 else 0) for i in range(len(g_sizes))]
        flats.append(flat)
        slices.append([flat.narrow(0, o, n) for o, n in zip(offsets, g_sizes, strict=True)])
    opt = types.SimpleNamespace(
        autoep_folding_tp_group=None,
        bf16_groups=params,
        fp32_groups_gradients=slices,
        fp32_groups_gradients_flat=flats,
        fp32_groups_has_gradients=[[False] * len(g) for g in sizes],
    )
    acc = _MultiTensorAccumulation(opt, bucket=12)  # cut once the kept gradients pass 12
    for group, g_params in enumerate(params):
        for i, p in enumerate(g_params):
            p.register_post_accumulate_grad_hook(lambda p, g=group, i=i: acc(p, g, i))
    expected = [torch.zeros_like(f) for f in flats]
    adds_per_pass = []
    for _micro_batch in range(3):
        weights = [[torch.randn(p.shape, generator=gen) for p in g] for g in params]
        loss = sum(
            (p.float() * w).sum() for g, gw in zip(params, weights, strict=True)
            for p, w in zip(g, gw, strict=True)
        )  # fmt: skip
        before = acc.adds
        loss.backward()
        adds_per_pass.append(acc.adds - before)
        for group, g_params in enumerate(params):
            for i, p in enumerate(g_params):
                ref = expected[group].narrow(0, slices[group][i].storage_offset(), p.numel())
                ref.add_(weights[group][i].bfloat16())  # the bf16 gradient, widened
                assert p.grad is None and opt.fp32_groups_has_gradients[group][i]
                assert p._hp_grad is slices[group][i]
    assert all(torch.equal(f, e) for f, e in zip(flats, expected, strict=True))
    assert not acc.pending and not acc.keys
    # the same plans every micro-batch; more than one add per pass (the gap, the two
    # groups, the bucket cut) and fewer than one per tensor
    assert len(set(adds_per_pass)) == 1 and 3 <= adds_per_pass[0] < 7, adds_per_pass
    assert 1 < len(acc._plans) <= 3
