"""One command for whoever has a CUDA machine: does this project compute right there, and how
fast? (``tools/gpu_check.py``, ``mbn-gpu-check``, ``make gpu-check``; docs/performance.md has
the results.)

    python tools/gpu_check.py                  # every GPU this machine has
    python tools/gpu_check.py --device cpu     # the same checks on the CPU, in small sizes

Offline (a GPU machine without a network): install torch, then this project from a wheelhouse
built on a networked machine with ``tools/build_wheelhouse.sh`` (README: GPU check).
Exit 0: every check passed; 1: one failed (the table says which); 2: bad input.

It prints one table. On the device (``cuda`` when available):

1. **precision**: one batch through the flat model and through the 1-stage pipeline (DeepSpeed
   engine, the shipped ``zero1_bf16.json`` / ``zero1_fp16.json``, with the trainer's bf16
   accumulation and step from ``training/bf16_grads.py``: multi-tensor on CUDA) in bf16 and
   fp16, against the flat model in fp32 on the CPU (same weights, same batch): the loss, and
   the gradient (the whole gradient vector for the flat model, the global norm for the engine);
2. **activation checkpointing**: the pipeline's loss and gradient norm with checkpointing on
   equal those with it off;
3. **Apex**: FusedLayerNorm against torch's LayerNorm when Apex is importable, else the table
   says that torch's LayerNorm runs;
4. **CUDA graphs**: on a GPU, a recomputing range captured whole and in links of a layer,
   with dropout, against the eager layers from the same random state (the gradients); then
   short train.py runs with ``model.cuda_graphs=on`` against the same runs eager: losses
   within the bf16 loss tolerance, and the layers really captured;
5. **launches**: kernel-launching ops per layer per micro-batch inside ``train_batch`` and what
   blocks the host per micro-batch there: syncing ops (``.item()``, ``nonzero``...),
   device-to-host copies (``.cpu()``, ``.tolist()``, ``copy_`` into a CPU tensor) and
   synchronize calls (torch's and DeepSpeed's accelerator's), 0 of each asked
   (``experiments/launches.py``, opus100_200L's settings);
6. **throughput**: train.py end to end on one rank (its collectives included: they run at
   world size 1 too) for ``--steps`` updates (40) of a 12L-12L d=512 model with 16k tokens per
   micro-batch (bf16 + ZeRO-1, 1 stage): the steady-state tokens/s (the median of the last half
   of the updates, as ``make gpu-bench`` takes it), the fraction of the device's measured bf16
   matmul peak, peak memory beside the planner's prediction; on a GPU also with
   ``model.compile=true`` and, where Apex is importable, with Apex off;
7. **2 stages end to end**: with 2 or more devices, train.py as 2 stages in bf16 + ZeRO-1;
8. **pipeline parity**: with 2 or more devices (``--ranks``), 2 and 4 stages against 1 stage
   over 8 updates (fp32, NCCL on GPUs), as the CPU tests do over gloo.

The 1-stage pipeline and the flat model in the same precision differ by the order of a few
sums (two micro-batches against one batch): within bf16's or fp16's unit roundoff, 2^-8 is
asked of both. Tolerances against CPU fp32 (relative): the loss 1e-2 in bf16 and 2e-3 in fp16, the gradient
5e-2 in bf16 and 1e-2 in fp16. bf16 keeps 8 significant bits (unit roundoff 2^-8 = 3.9e-3),
fp16 11 (4.9e-4); a few roundings per layer compound over the layers of this small model to a
few units, and the gradient, summed over the batch, to about ten. On the CPU (``--device
cpu``, what the test suite runs, in small sizes) the same code checks itself; fp16 runs there
only where the CPU has fp16 kernels.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_branchnorm.experiments.check_table import ROW_KEYS, TABLE_HEADER, Row, format_rows
from megatron_branchnorm.formats.outputs import (
    check_workdir_and_report,
    read_report,
    write_text_output,
)
from megatron_branchnorm.formats.records import read_metrics
from megatron_branchnorm.resources import DS_CONFIG_DIR
from megatron_branchnorm.workflows.rehearse_checks import rel_diff

TRAIN = Path(__file__).resolve().parents[1] / "train.py"
TOL = {"bf16": {"loss": 1e-2, "grad": 5e-2}, "fp16": {"loss": 2e-3, "grad": 1e-2}}
PARITY_TOL = 1e-4
"""S stages vs 1 stage, fp32, per step (docs/design.md §5)."""
SMALL = [
    "model.encoder_layers=3",
    "model.decoder_layers=3",
    "model.dropout=0.0",
    "model.branchnorm_steps=8",
]
"""The model of the precision checks (tiny_cpu's width)."""
THROUGHPUT_GPU = [
    "model.encoder_layers=12",
    "model.decoder_layers=12",
    "model.hidden_size=512",
    "model.ffn_hidden_size=2048",
    "model.num_attention_heads=8",
    "model.vocab_size=32000",
    "model.max_positions=256",
    "data.max_tokens=16384",
    "data.max_length=128",
]
THROUGHPUT_CPU = ["model.encoder_layers=2", "model.decoder_layers=2", "data.max_tokens=512"]


def environment(device: str) -> list[Row]:
    import deepspeed
    import torch

    from megatron_branchnorm.runner.hardware import cpu_info

    name = torch.cuda.get_device_name() if device == "cuda" else cpu_info().describe()
    rows = [
        Row("device", name),
        Row(
            "torch / CUDA / DeepSpeed",
            f"{torch.__version__} / {torch.version.cuda} / {deepspeed.__version__}",
        ),  # fmt: skip
    ]
    if device == "cuda":
        total = torch.cuda.mem_get_info()[1]
        rows.append(
            Row("devices / memory", f"{torch.cuda.device_count()} / {total / 2**30:.1f} GiB")
        )
    return rows


def _batch(cfg):
    from megatron_branchnorm.data.synthetic import SyntheticData, collate

    return collate(SyntheticData(64, cfg.model.vocab_size, 20), list(range(8)))


def _flat(cfg, batch, device: str, dtype, step: int = 3):
    """(loss per token, gradient vector on the CPU in fp32) of the flat model."""
    import torch

    from megatron_branchnorm.model import build_model, label_smoothed_nll_loss

    model = build_model(cfg.model, cfg.train.seed).to(device=device, dtype=dtype)
    model.set_step(step)
    logits = model(batch["src_tokens"].to(device), batch["prev_output_tokens"].to(device))
    loss, _, _ = label_smoothed_nll_loss(logits.float(), batch["target"].to(device), 0.1)
    loss = loss / batch["ntokens"]
    loss.backward()
    grads = torch.cat([p.grad.detach().float().reshape(-1) for p in model.parameters()])
    return float(loss.detach()), grads.cpu()  # one copy to the host, not one per parameter


def _pipeline(cfg, batch, device: str, precision: str, ckpt_interval: int, step: int = 3):
    """(loss per token, global gradient norm) of one update of the 1-stage pipeline engine
    with the shipped DeepSpeed JSON of ``precision`` (learning rate 0: weights unchanged)."""
    import dataclasses

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

    json_name = {"bf16": "zero1_bf16.json", "fp16": "zero1_fp16.json"}
    train = dataclasses.replace(
        cfg.train,
        deepspeed_config=str(DS_CONFIG_DIR / json_name[precision]),
        micro_batches=2,
        clip_grad=0.0,
    )
    ds = load_ds_config(dataclasses.replace(cfg, train=train), 1)
    if precision == "fp16":
        ds["fp16"]["initial_scale_power"] = 8  # no overflow to skip in a one-update check
    loss_fn = PipeLoss(0.1)
    loss_fn.scale = 2 / batch["ntokens"]  # the engine averages the 2 micro-batches
    module = build_pipeline_module(
        cfg.model, partition_plan(cfg.model, 1, "balanced"), cfg.train.seed, loss_fn, ckpt_interval
    )
    set_branch_scale(module, cfg.model, step)
    opt = SkipNonfiniteAdamW([p for p in module.parameters() if p.requires_grad], lr=0.0)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=opt, config=ds)
    install_engine_fixes(engine)
    install_bf16_grad_accumulation(engine)  # as the trainer does: on CUDA the multi-tensor path
    items = [
        (
            (batch["src_tokens"][i : i + 4].to(device), batch["prev_output_tokens"][i : i + 4].to(device)),
            batch["target"][i : i + 4].to(device),
        )
        for i in (0, 4)
    ]  # fmt: skip
    loss = float(engine.train_batch(data_iter=iter(items)))
    if not engine.was_step_applied():
        raise RuntimeError(f"{precision}: the check's update overflowed")
    return loss, float(engine.get_global_grad_norm())


def precision_rows(device: str, precisions: list[str]) -> list[Row]:
    import torch

    from megatron_branchnorm.config import load_config

    cfg = load_config("tiny_cpu", SMALL)
    batch = _batch(cfg)
    ref_loss, ref_grad = _flat(cfg, batch, "cpu", torch.float32)
    ref_norm = float(ref_grad.norm())
    rows = [
        Row(
            "reference: flat model, fp32, CPU", f"loss {ref_loss:.6f}, gradient norm {ref_norm:.5f}"
        )
    ]
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    for p in precisions:
        tol = TOL[p]
        flat_loss, grad = _flat(cfg, batch, device, dtypes[p])
        err = float((grad - ref_grad).norm()) / ref_norm
        rows.append(Row(f"flat {p}: loss", f"{rel_diff(flat_loss, ref_loss):.1e}", f"{tol['loss']:g}",
                        rel_diff(flat_loss, ref_loss) <= tol["loss"]))  # fmt: skip
        rows.append(Row(f"flat {p}: gradient, norm of (g - g_fp32) / norm of g_fp32", f"{err:.1e}", f"{tol['grad']:g}",
                        err <= tol["grad"]))  # fmt: skip
        losses = {}
        for ck in (0, 1):
            losses[ck] = _pipeline(cfg, batch, device, p, ck)
        loss, norm = losses[1]
        rows.append(Row(f"1-stage pipeline {p} vs flat {p}: loss", f"{rel_diff(loss, flat_loss):.1e}",
                        f"{2**-8:.1e}", rel_diff(loss, flat_loss) <= 2**-8))  # fmt: skip
        rows.append(Row(f"1-stage pipeline {p} (checkpointing on): loss", f"{rel_diff(loss, ref_loss):.1e}",
                        f"{tol['loss']:g}", rel_diff(loss, ref_loss) <= tol["loss"]))  # fmt: skip
        rows.append(Row(f"1-stage pipeline {p}: gradient norm", f"{rel_diff(norm, ref_norm):.1e}",
                        f"{tol['grad']:g}", rel_diff(norm, ref_norm) <= tol["grad"]))  # fmt: skip
        same = losses[0] == losses[1]
        rows.append(Row(f"activation checkpointing on = off ({p}): loss, gradient norm",
                        "equal" if same else f"{losses[0]} vs {losses[1]}", "exact", same))  # fmt: skip
    return rows


def apex_rows(device: str) -> list[Row]:
    import torch

    from megatron_branchnorm.model.residual import apex_layernorm_class

    cls = apex_layernorm_class()
    if cls is None:
        return [Row("Apex FusedLayerNorm", "not importable: torch.nn.LayerNorm runs")]
    x = torch.randn(64, 37, 512, device=device)
    ours, ref = cls(512).to(device), torch.nn.LayerNorm(512).to(device)
    err = float((ours(x) - ref(x)).abs().max())
    return [Row("Apex FusedLayerNorm vs torch LayerNorm, fp32: max abs difference", f"{err:.1e}", "1e-5",
                err <= 1e-5)]  # fmt: skip


def _launch(world: int, overrides: list[str], save_dir: Path, timeout: float) -> float:
    """Run train.py on ``world`` ranks (one process each, as srun starts them:
    :func:`megatron_branchnorm.runner.ranks.start_ranks`), rank R's output in
    ``<save_dir>.rank<R>.log`` beside it; seconds. A run past ``timeout`` is killed
    (subprocess.TimeoutExpired)."""
    from megatron_branchnorm.runner.ranks import start_ranks

    start = time.time()
    args = [str(TRAIN), "--config", "tiny_cpu", *overrides, f"train.save_dir={save_dir}"]
    save_dir.mkdir(parents=True)
    env = {"PYTHONWARNINGS": "ignore"}
    log_dir, prefix = save_dir.parent, f"{save_dir.name}."
    with start_ranks(world, args, log_dir, module=None, env=env, log_prefix=prefix) as ranks:
        codes = [p.wait(timeout=timeout) for p in ranks]
    if any(codes):
        log = ranks.logs[0].read_text()[-1500:]
        raise RuntimeError(f"train.py on {world} rank(s) exited {codes}: {log}")
    return time.time() - start


def _updates(save_dir: Path) -> list[dict]:
    return [r for r in read_metrics(save_dir, strict=True) if "loss" in r]


def _variants(device: str) -> list[tuple[str, list[str]]]:
    """(name, overrides) of the throughput runs: as shipped, then (on a GPU) with the layers
    compiled, and with torch's LayerNorm where Apex is importable (Apex on and off)."""
    from megatron_branchnorm.model.residual import apex_layernorm_class

    variants = [("as shipped", [])]
    if device != "cuda":
        return variants  # the CPU run checks the path; compile and Apex are GPU questions
    variants.append(("model.compile=true", ["model.compile=true"]))
    if apex_layernorm_class() is not None:
        variants.append(("Apex off", ["model.layernorm_impl=torch"]))
    return variants


def throughput_rows(device: str, work: Path, steps: int) -> list[Row]:
    """train.py end to end on one rank (its collectives included: they run at world size 1
    too), bf16 + ZeRO-1: tokens/s, the fraction of the device's measured bf16 matmul peak,
    peak memory, for each of :func:`_variants`."""
    import torch

    from megatron_branchnorm.config import load_config
    from megatron_branchnorm.experiments.bench_step import matmul_peak
    from megatron_branchnorm.experiments.gpu_bench import steady_state
    from megatron_branchnorm.parallel.planner import plan_run

    size = THROUGHPUT_GPU if device == "cuda" else THROUGHPUT_CPU
    ds = "zero1_bf16.json"
    overrides = [*size, "data.dataset=synthetic", "pipeline.stages=1", "train.micro_batches=1",
                 f"train.max_steps={steps}", "train.log_interval=1", "train.eval_interval=0",
                 "train.save_interval=0", f"train.deepspeed_config={DS_CONFIG_DIR / ds}"]  # fmt: skip
    cfg = load_config("tiny_cpu", overrides)
    memory = torch.cuda.mem_get_info()[1] if device == "cuda" else 24 * 2**30
    plan = plan_run(cfg, 1, float(memory), stages=1)
    predicted = 2 * plan.tokens_per_update / plan.seconds_per_update  # source + target tokens
    peak = matmul_peak(torch.get_num_threads(), device=device, dtypes=("bf16",))["bf16"]
    what = "12L-12L d=512, 16k tokens/micro-batch" if device == "cuda" else "2L-2L tiny (CPU)"
    rows = [Row(f"bf16 matmul peak ({'8192' if device == 'cuda' else '2048'}^3)",
                f"{peak / 1e3:,.1f} TFLOP/s")]  # fmt: skip
    for i, (name, extra) in enumerate(_variants(device)):
        run_dir = work / f"throughput{i}"
        _launch(1, [*overrides, *extra], run_dir, timeout=1800)
        updates = _updates(run_dir)
        # the steady state, as make gpu-bench takes it: past warm-up, lazy state and compiling
        tps = steady_state([r["tokens_per_sec"] for r in updates])
        mem = max(r["memory_mb"] for r in updates) / 1024
        held = [r["memory_reserved_mb"] for r in updates if r.get("memory_reserved_mb")]
        reserved = f", {max(held) / 1024:.2f} GiB reserved" if held else ""  # CUDA only
        # model FLOPs of the real tokens (planner.training_flops), as the rows log them
        achieved = steady_state([r["tflops_per_gpu"] for r in updates]) * 1e12  # FLOP/s
        first = len(updates) // 2 + 1
        rows += [
            Row(f"train.py {what}, bf16, {name}: tokens/s (median of updates {first}-{len(updates)})",
                f"{tps:,.0f} (planner: {predicted:,.0f}); "
                f"{achieved / 1e12:.2f} TFLOP/s = {achieved / (peak * 1e9):.1%} of the bf16 "
                "matmul peak"),
            Row(f"train.py peak memory, {name}",
                f"{mem:.2f} GiB{reserved} (planner: {plan.peak() / 2**30:.2f} GiB)"),
        ]  # fmt: skip
    return rows


GRAPHS_RUN = ["model.dropout=0.0", "data.bucket_shapes=2", "train.micro_batches=2",
              "train.max_steps=8", "train.log_interval=1", "train.eval_interval=0", "train.save_interval=0",
              "pipeline.stages=1", f"train.deepspeed_config={DS_CONFIG_DIR / 'zero1_bf16.json'}"]  # fmt: skip
"""The short run graphed and eager (bf16 + ZeRO-1, tiny_cpu's model, no dropout; 2 bucket
shapes, so most of the 16 micro-batches replay a graph past the 2 eager calls per shape)."""


RECOMPUTING = ("pipeline.activation_checkpoint_interval=1", "train.max_steps=6")

GRAPH_VARIANTS = {
    "in-flight graphs": ((), ()),
    "recomputing stage": (RECOMPUTING, ()),
    "recomputing stage in links": (RECOMPUTING, ("model.cuda_graph_link_layers=2",)),
}
"""The graphed path's modes (training/cuda_graphs.py), each as (overrides of both runs, of the
graphed run alone): graphs per micro-batch in flight, a stage that checkpoints, whose graphs
recompute in the backward, and the same stage's ranges cut into links of 2 layers
(docs/design.md §19, "Links"; an eager run has no graphs to cut, so the recomputing stage's
eager run serves both)."""


def cuda_graph_rows(device: str, work: Path) -> list[Row]:
    """train.py with ``model.cuda_graphs=on`` against ``off`` (training/cuda_graphs.py) in
    bf16 + ZeRO-1, without and with activation checkpointing: the losses within bf16's loss
    tolerance (docs/design.md §5, as the precision rows), and the graphed run's log saying its
    layers were captured."""
    rows = []
    eager_runs: dict[tuple, Path] = {}  # one eager run per set of shared overrides
    for variant, (shared, graphed) in GRAPH_VARIANTS.items():
        name = f"CUDA graphs ({variant}): graphed run vs eager, bf16: loss"
        if device != "cuda":
            rows.append(Row(name, "not run: no CUDA device"))
            continue
        tag = variant.replace(" ", "_").replace("-", "_")
        if shared not in eager_runs:
            eager_runs[shared] = work / f"{tag}_off"
            _launch(1, [*GRAPHS_RUN, *shared, "model.cuda_graphs=off"], eager_runs[shared], 900)
        extra = [*shared, *graphed, "model.cuda_graphs=on"]
        try:
            _launch(1, [*GRAPHS_RUN, *extra], work / f"{tag}_on", 900)
        except RuntimeError as exc:  # the graphed run failed: this row fails, the table goes on
            rows.append(Row(name, f"the graphed run failed: {str(exc)[-300:]}", "", False))
            continue
        ref = {r["step"]: r["loss"] for r in _updates(eager_runs[shared])}
        got = {r["step"]: r["loss"] for r in _updates(work / f"{tag}_on")}
        same = ref and set(got) == set(ref)
        worst = max(rel_diff(got[s], ref[s]) for s in ref) if same else math.inf
        captured = "first graph captured" in (work / f"{tag}_on.rank0.log").read_text()
        tol = TOL["bf16"]["loss"]
        rows.append(Row(name, f"{worst:.1e}" + ("" if captured else " (the layers ran eagerly: see the log)"),
                        f"{tol:g}", worst <= tol and captured))  # fmt: skip
    return rows


RECOMPUTE_DROPOUT_TOL = 1e-5
"""Relative gradient difference allowed between a graphed recompute and the eager layers from
the same random state (fp32: the same kernels, in a graph or not)."""


def recompute_dropout_difference(
    cuda: Any = None, device: str = "cuda", links: bool = False
) -> float:
    """A recomputing range of 2 encoder layers with dropout 0.1, captured through ``cuda``
    (``torch.cuda``, or the CPU tests' graph double; training/graph_capture.py), with
    ``links`` as a chain of a layer a link (graph_capture.CapturedChain): the worst
    relative difference over 3 micro-batches between the gradients by ``recompute`` (whose
    backward replays the forward graph, each link's, from the forward's saved generator
    state) and the eager layers' run from that same state. 0 means the recompute drew the
    forward's dropout masks."""
    import torch

    from megatron_branchnorm.config import load_config
    from megatron_branchnorm.model.residual import stack_constants
    from megatron_branchnorm.parallel.pipeline import EncoderLayerPipe
    from megatron_branchnorm.tokens import EOS_ID
    from megatron_branchnorm.training.cuda_graphs import LayerRun, link_parts
    from megatron_branchnorm.training.graph_capture import CapturedChain, CapturedRange, Links

    cuda = cuda or torch.cuda
    cfg = load_config("tiny_cpu", ["model.dropout=0.1"]).model
    torch.manual_seed(0)
    (a, b), _ = stack_constants(cfg)
    layers = [EncoderLayerPipe(cfg, a, b, 1, i).to(device) for i in range(2)]
    run = LayerRun(layers, as_tuple=True)
    params = list(run.parameters())
    rows, length = 4, 16

    def batch() -> tuple:
        x = torch.randn(rows, length, cfg.hidden_size, device=device, requires_grad=True)
        ids = torch.randint(EOS_ID + 1, cfg.vocab_size, (rows, length), device=device)
        return x, ids, ids.clone()

    def grads(forward, args: tuple, state, grad: torch.Tensor) -> list:
        cuda.set_rng_state(state)
        for p in params:
            p.grad = None
        forward(*args).backward(grad)
        return [args[0].grad, *(p.grad.clone() for p in params)]

    first = batch()
    sample = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in first)
    pool = cuda.graph_pool_handle()
    if links:  # no side-stream warm-up in a chain: the trainer's eager calls come first
        run(*first).float().sum().backward()
        chain = Links([LayerRun(part, as_tuple=True) for part in link_parts(layers, 1)])
        captured: Any = CapturedChain(chain, sample, pool, {}, cuda=cuda)
    else:
        captured = CapturedRange(run, sample, pool, {}, warmup_iters=1, cuda=cuda)
    worst = 0.0
    for _ in range(3):
        args, grad = batch(), torch.randn(rows, length, cfg.hidden_size, device=device)
        state = cuda.get_rng_state()
        eager_args = (args[0].detach().clone().requires_grad_(), *args[1:])
        got = grads(captured.recompute, args, state, grad)
        want = grads(run, eager_args, state, grad)
        diffs = [(g - w).norm() / w.norm().clamp_min(1e-12) for g, w in zip(got, want, strict=True)]
        diff = float(torch.stack(diffs).max())  # one host sync per micro-batch
        worst = max(worst, diff if math.isfinite(diff) else math.inf)  # max() skips a NaN
    return worst


def recompute_dropout_rows(device: str) -> list[Row]:
    """:func:`recompute_dropout_difference` captured for real: the train.py rows run with
    dropout 0 and cannot show that a recompute draws the forward's masks."""
    rows = []
    for links, what in ((False, "one range"), (True, "in links of a layer")):
        name = (
            f"CUDA graphs: recompute ({what}) with dropout 0.1 vs eager from the same RNG "
            "state: grad"
        )
        if device != "cuda":
            rows.append(Row(name, "not run: no CUDA device"))
            continue
        try:
            worst = recompute_dropout_difference(links=links)
        except Exception as exc:  # the capture failed: this row fails, the table goes on
            rows.append(Row(name, f"failed: {type(exc).__name__}: {str(exc)[-300:]}", "", False))
            continue
        tol = RECOMPUTE_DROPOUT_TOL
        rows.append(Row(name, f"{worst:.1e}", f"{tol:g}", worst <= tol))
    return rows


def launch_rows(device: str) -> list[Row]:
    """Kernel-launching ops per layer per micro-batch inside train_batch and the host syncs
    per micro-batch: syncing ops, device-to-host copies and synchronize calls, each 0 to pass
    (experiments/launches.py) with opus100_200L's settings on a GPU (the CUDA kernels: its
    dropout is one fused kernel), tiny_cpu's on the CPU."""
    from megatron_branchnorm.experiments.launches import measure_config

    config = "opus100_200L" if device == "cuda" else "tiny_cpu"
    res = measure_config(config, micro_batches=2, memory=False, jobs=1)
    syncs, copies = res["host_syncs_per_mb"], res["d2h_copies_per_mb"]
    calls = res["sync_calls_per_mb"]
    return [
        Row(f"kernel ops per layer per micro-batch ({config}, encoder / decoder / mean)",
            f"{res['enc_ops_per_layer_mb']:.1f} / {res['dec_ops_per_layer_mb']:.1f} / "
            f"{res['avg_ops_per_layer_mb']:.1f}"),
        Row("host syncs per micro-batch inside train_batch",
            f"{syncs:g} syncing ops / {copies:g} device-to-host copies / {calls:g} synchronize "
            "calls", "0 each", syncs == copies == calls == 0),
    ]  # fmt: skip


def two_stage_rows(ranks: int, work: Path) -> list[Row]:
    """train.py on 2 ranks as 2 stages, bf16 + ZeRO-1 (NCCL on GPUs): every collective of the
    update (pipeline send/recv, tied embedding, loss sums, stop flags) on real devices."""
    if ranks < 2:
        return [Row("2 stages bf16 + ZeRO-1 end to end", f"not run: {ranks} rank(s)")]
    overrides = ["pipeline.stages=2", "train.max_steps=4", "train.log_interval=1",
                 "train.eval_interval=2", "train.save_interval=0", "train.micro_batches=2",
                 f"train.deepspeed_config={DS_CONFIG_DIR / 'zero1_bf16.json'}"]  # fmt: skip
    _launch(2, overrides, work / "two_stage_bf16", timeout=900)
    rows = _updates(work / "two_stage_bf16")
    ok = len(rows) == 4 and all(math.isfinite(r["loss"]) for r in rows)
    return [Row("2 stages bf16 + ZeRO-1 end to end: updates, finite losses",
                f"{len(rows)}, last loss {rows[-1]['loss']:.4f}" if rows else "none", "4", ok)]  # fmt: skip


def parity_rows(ranks: int, work: Path) -> list[Row]:
    base = ["model.dropout=0.0", "train.micro_batches=4", "train.max_steps=8",
            "train.log_interval=1", "train.eval_interval=0", "train.save_interval=0",
            "pipeline.activation_checkpoint_interval=1"]  # fmt: skip
    _launch(1, [*base, "pipeline.stages=1"], work / "parity1", timeout=900)
    ref = {r["step"]: r["loss"] for r in _updates(work / "parity1")}
    rows = []
    for stages in (2, 4):
        if stages > ranks:
            rows.append(Row(f"{stages} stages vs 1 stage", f"not run: {ranks} rank(s)"))
            continue
        _launch(stages, [*base, f"pipeline.stages={stages}"], work / f"parity{stages}", 900)
        got = {r["step"]: r["loss"] for r in _updates(work / f"parity{stages}")}
        worst = max(rel_diff(got[s], ref[s]) for s in ref) if set(got) == set(ref) else math.inf
        rows.append(Row(f"{stages} stages vs 1 stage, 8 updates, fp32: loss", f"{worst:.1e}",
                        f"{PARITY_TOL:g}", worst <= PARITY_TOL))  # fmt: skip
    return rows


SECTIONS = ("precision", "apex", "graphs", "launches", "throughput", "two-stage", "parity")
"""The sections ``--sections`` picks from (the environment's rows always come first): items 1
and 2 of the module docstring are ``precision``, 3 ``apex``, 4 ``graphs``, 5 ``launches``, 6
``throughput``, 7 ``two-stage``, 8 ``parity``."""


def run_checks(
    device: str,
    ranks: int,
    steps: int,
    work: Path,
    emit: Callable[[list[Row]], None] | None = None,
    sections: tuple[str, ...] = SECTIONS,
) -> list[Row]:
    """The checks of the module docstring in ``sections``, as table rows; runs and logs go to
    ``work``. ``emit`` gets each section's rows as the section ends, so that a run cut off by
    a time limit (a lent GPU's minutes) still shows the sections it finished."""
    import torch

    from megatron_branchnorm.training.environment import setup_process_env

    setup_process_env()
    import deepspeed
    from deepspeed.utils import logger

    logger.setLevel(logging.ERROR)  # its memory reports would bury the table

    deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        torch.cuda.set_device(0)
    from deepspeed.accelerator import get_accelerator

    precisions = ["bf16"] + (["fp16"] if get_accelerator().is_fp16_supported() else [])
    rows: list[Row] = []

    def add(section: list[Row]) -> None:
        rows.extend(section)
        if emit is not None:
            emit(section)

    first = environment(device)
    if "fp16" not in precisions:
        first.append(Row("fp16", "not run: this device cannot run fp16 (DeepSpeed's accelerator)"))
    add(first)
    # correctness before speed: a lent GPU's time limit cuts the slowest sections last, and
    # gpu-bench measures the speed again (docs/performance.md)
    checks: dict[str, Callable[[], list[Row]]] = {
        "precision": lambda: precision_rows(device, precisions),
        "apex": lambda: apex_rows(device),
        "graphs": lambda: recompute_dropout_rows(device) + cuda_graph_rows(device, work),
        "launches": lambda: launch_rows(device),
        "throughput": lambda: throughput_rows(device, work, steps),
        "two-stage": lambda: two_stage_rows(ranks, work),
        "parity": lambda: parity_rows(ranks, work),
    }
    for name in SECTIONS:
        if name in sections:
            add(checks[name]())
    return rows


def is_our_report(path: Path) -> bool:
    """Whether ``path`` holds a --json report of ours: a JSON list of rows (:data:`ROW_KEYS`)."""
    data = read_report(path)
    return isinstance(data, list) and all(isinstance(r, dict) and set(r) == ROW_KEYS for r in data)


def check_outputs(workdir: str | None, json_path: str | None) -> None:
    """Before any check runs: --workdir new or empty (its runs are created there, never over
    anything), never inside a directory of a known kind; --json not inside one either, and an
    existing file replaced only when it is a report of ours (outputs.check_output_file)."""
    check_workdir_and_report("gpu_check", workdir, json_path, is_our_report)


def main(argv: list[str] | None = None) -> int:
    """Parse, run every check, print the table; exit 1 when a check failed."""
    from megatron_branchnorm.cli import run_main

    return run_main(_main, argv)


def _main(argv: list[str] | None) -> int:
    from megatron_branchnorm.cli import ArgumentParser, int_flag

    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--ranks", type=int_flag(1), default=None,
                        help="devices for the pipeline parity (default: the GPUs, or 1)")  # fmt: skip
    parser.add_argument("--steps", type=int_flag(2), default=40,
                        help="updates of the throughput run (its figure: the median of the "
                        "last half)")  # fmt: skip
    parser.add_argument(
        "--workdir", default=None, help="runs and logs, new or empty (default: a temp dir)"
    )
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated, of {', '.join(SECTIONS)} (default: all, in "
                        "that order; the environment's rows always run)")  # fmt: skip
    args = parser.parse_args(argv)
    sections = tuple(s for s in args.sections.split(",") if s)
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown or not sections:
        parser.error(
            f"--sections: unknown {', '.join(unknown) or '(none given)'}; of {', '.join(SECTIONS)}"
        )
    check_outputs(args.workdir, args.json)
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    ranks = args.ranks or (torch.cuda.device_count() if device == "cuda" else 1)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="mbn_gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    out, shown = sys.stdout, []
    print(TABLE_HEADER, flush=True)

    def emit(section: list[Row]) -> None:  # each section's rows as it ends (and the JSON)
        shown.extend(section)
        if section:
            print(format_rows(section), file=out, flush=True)
        if args.json:
            write_text_output(args.json, json.dumps([r.__dict__ for r in shown], indent=1))

    with open(work / "checks.log", "w", encoding="utf-8") as log, contextlib.redirect_stdout(log):
        rows = run_checks(device, ranks, args.steps, work, emit, sections)  # prints: the log
    if rows[len(shown) :]:
        emit(rows[len(shown) :])
    print(f"\nlogs: {work}")
    return 0 if all(r.ok is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
