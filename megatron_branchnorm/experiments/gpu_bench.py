"""``make gpu-bench``: train.py's steady state beside torch.nn.Transformer (eager and compiled)
and torchscale, in one process on the device it finds (docs/performance.md, "make
gpu-bench").

    python tools/gpu_bench.py                    # CUDA: 12L-12L d=512, 4,096 and 16,384 tokens
    python tools/gpu_bench.py --device cpu       # the small mode (make test runs it)
    mbn-gpu-bench --updates 60 --override pipeline.activation_checkpoint_interval=1

One table, one row per system and batch size (tokens per side per update):

- **train.py**: the real training path, in this process: the :class:`Trainer` of train.py (one
  stage, world size 1, ``zero1_bf16.json``, synthetic data, one micro-batch per update),
  ``--updates`` updates (40 by default) and then a few under the profiler, its micro-batches
  padded to :data:`BUCKET_SHAPES` bucket shapes. Its figures are the steady state: the median
  over the updates of the last half (past the warm-up and the lazy optimizer state) whose every
  shape had run before, and with graphs had been captured before (:func:`steady_updates`:
  replays only; the table says over how many). tokens/s counts source + target tokens without
  padding, as train.py's metrics do; the FLOPs are the model FLOPs of those tokens
  (``planner.training_flops`` of each update's sentences, what train.py logs as
  ``tflops_per_gpu``), divided by the bf16 matmul peak measured at the start of the same run.
  Peak memory and the time per update are beside the planner's predictions for the same run
  (``planner.plan_run``: ``peak()``, ``seconds_per_update``, with the graphs of every bucket
  shape for train.py+graphs: what a GPU run calibrates its host and GPU rates by). Below the
  table: the host's time per update in the data stream (reading, collating and padding the
  update's batches: the GPU idles through it after each update's host sync).
- **train.py+graphs**: the same with ``model.cuda_graphs=on`` (training/cuda_graphs.py: the
  layer stack replayed from CUDA graphs per bucket shape), on CUDA only.
- **ours, flat model**; **torch.nn.Transformer**, eager and under ``torch.compile`` (default
  mode); **torchscale 0.3.0** (DeepNorm), each at the same shape: a plain loop of forward under
  ``torch.autocast`` (bf16), the same fp32 label-smoothed loss, backward and a fused AdamW step
  (``bench_models``' implementations; sentences of ``--length`` tokens, 32 by default, the
  length of train.py's synthetic sentences), timed per step the same way. torchscale is
  imported where installed (a stand-in ``timm`` is registered when timm is missing, as
  ``bench_anchors`` does); where it is not, its row says so in one line.
- **GPU busy**: the device's kernel time (the union of the kernels' intervals from
  ``torch.profiler``) over the wall time of a few profiled updates after the timed ones; on
  the CPU, the time inside aten ops over the wall time.

Per-step times come from CUDA events recorded on the stream (no host sync added) or, on the
CPU, the host clock. On the CPU (``--device cpu``) everything runs at a tiny size in seconds:
it checks the code path, not a speed; ``torch.compile`` is left out there (inductor's CPU
compile takes minutes), with a one-line reason.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import importlib.util
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from megatron_branchnorm.formats.outputs import (
    check_workdir_and_report,
    read_report,
    write_text_output,
)

SYSTEMS = ("train.py", "train.py+graphs", "ours", "torch", "torch-compiled", "torchscale")
"""What the table compares, in its row order (``--systems`` picks some)."""

RUN_ORDER = ("train.py", "train.py+graphs", "torchscale", "torch", "ours", "torch-compiled")
"""The order the systems run in, each at every size before the next: what the performance goals
compare first (train.py at 4,096 and at 16,384 tokens: the 20% and 35% goals), the compile
(minutes) last, so that a lent GPU's time limit cuts the least wanted rows."""
RESERVE_S = {"torch-compiled": 180.0}
"""Seconds a system needs to be started within ``--max-minutes`` (others: 30)."""

LABELS = {
    "train.py": "train.py (Trainer, 1 stage, zero1_bf16.json)",
    "train.py+graphs": "train.py, model.cuda_graphs=on",
    "ours": "ours, flat model, plain loop",
    "torch": "torch.nn.Transformer (post-LN)",
    "torch-compiled": "torch.nn.Transformer, torch.compile",
    "torchscale": "torchscale 0.3.0 DeepNorm",
}


@dataclasses.dataclass(frozen=True)
class Shape:
    """The model every system builds: L encoder and L decoder layers, width, FFN, heads,
    vocabulary."""

    layers: int
    dim: int
    ffn: int
    heads: int
    vocab: int

    def describe(self) -> str:
        return (
            f"{self.layers}L-{self.layers}L, d={self.dim}, FFN {self.ffn}, {self.heads} heads, "
            f"vocabulary {self.vocab:,}"
        )


GPU_SHAPE = Shape(layers=12, dim=512, ffn=2048, heads=8, vocab=32000)
GPU_TOKENS = (4096, 16384)
CPU_SHAPE = Shape(layers=1, dim=32, ffn=64, heads=4, vocab=128)
CPU_TOKENS = (64, 128)
LENGTH = 32
"""Sentence length of the plain loops: train.py's synthetic sentences are 4-32 tokens."""
PROFILED_UPDATES = 3
"""Updates (or steps) run under the profiler after the timed ones, for the GPU-busy figure."""
BUCKET_SHAPES = 4
"""``data.bucket_shapes`` of both train.py rows unless ``--override`` sets it: on the bench's
synthetic sentences ``auto`` picks 20 shapes at 4,096 tokens and 28 at 16,384, and a graphed
shape replays only from its call ``WARMUP + 1`` on (training/cuda_graphs.py), so most timed
updates would run eagerly or capture. Eager runs the same shapes: the rows compare like with
like."""
CPU_MATMUL_N = 512
"""The bf16 matmul of the small mode's peak (8192^3 on a GPU): a small matmul's speed, not
the CPU's peak, so the small mode's "of bf16 peak" can pass 100%."""


@dataclasses.dataclass
class Result:
    """One row: a system at one batch size; figures are None where not measured (``note``
    says why)."""

    system: str
    tokens: int
    ms_per_update: float | None = None
    tokens_per_s: float | None = None
    flops_per_s: float | None = None
    busy: float | None = None
    peak_memory: float | None = None  # bytes
    peak_reserved: float | None = None  # bytes the caching allocator held (CUDA only)
    planned_memory: float | None = None  # bytes, train.py only
    planned_ms: float | None = None  # train.py only: the planner's time per update
    planned_flops: float | None = None  # train.py only: the planner's GPU FLOPs per update
    layers: int | None = None  # train.py only: encoder (= decoder) layers
    data_ms: float | None = None  # train.py only: the host's ms per update in the data stream
    timed_updates: int | None = None  # train.py only: the updates the medians are taken over
    settled: bool | None = None  # train.py only: those updates ran shapes seen (captured) before
    note: str = ""

    def brief(self) -> str:
        """The row in a few words, for the progress line printed as it ends."""
        if self.ms_per_update is None:
            return self.note
        return f"{self.ms_per_update:.1f} ms per update, {self.tokens_per_s:,.0f} tokens/s"


def steady_state(values: list[float]) -> float:
    """The median of the last half of ``values`` (at least the last one): the steady state of
    a run whose first updates include warm-up and capture."""
    if not values:
        raise ValueError("no values")
    return statistics.median(values[len(values) // 2 :])


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals (overlaps counted once)."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def busy_fraction(events: list, device: str, wall_s: float) -> float:
    """Kernel time over ``wall_s``: the union of the intervals of ``events`` (a profiler's
    ``events()``) that ran on ``device``: CUDA kernels and copies, or on the CPU the aten ops."""
    import torch

    cuda = torch.autograd.DeviceType.CUDA
    spans = []
    for e in events:
        on_gpu = e.device_type == cuda
        if (device == "cuda" and on_gpu) or (
            device != "cuda" and not on_gpu and e.name.startswith("aten::")
        ):
            spans.append((e.time_range.start / 1e6, e.time_range.end / 1e6))
    return union_seconds(spans) / wall_s


class Clock:
    """Time stamps on the device's stream (CUDA events: no host sync) or the host clock."""

    def __init__(self, device: str) -> None:
        import torch

        self.cuda = device == "cuda"
        self._torch = torch
        self.stamps: list[Any] = []

    def stamp(self) -> None:
        if self.cuda:
            event = self._torch.cuda.Event(enable_timing=True)
            event.record()
            self.stamps.append(event)
        else:
            self.stamps.append(time.perf_counter())

    def intervals(self) -> list[float]:
        """Seconds between consecutive stamps (waits for the device once)."""
        if self.cuda:
            self._torch.cuda.synchronize()
            return [
                a.elapsed_time(b) / 1e3 for a, b in zip(self.stamps, self.stamps[1:], strict=False)
            ]
        return [b - a for a, b in zip(self.stamps, self.stamps[1:], strict=False)]


@contextlib.contextmanager
def profiled(device: str) -> Iterator[dict]:
    """Profile the block; yields a dict that holds ``busy`` (:func:`busy_fraction`) after."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    out: dict = {}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        yield out
        sync()
        wall = time.perf_counter() - t0
    out["busy"] = busy_fraction(list(prof.events()), device, wall)


def _model_flops(shape: Shape, batch: int, src: int, tgt: int) -> float:
    from megatron_branchnorm.experiments.bench_models import model_flops

    return float(model_flops(shape.layers, shape.dim, shape.ffn, shape.vocab, batch, src, tgt))


def _peak_reserved(device: str) -> float | None:
    """The caching allocator's peak of reserved bytes since :func:`_reset_memory` (allocated
    plus the blocks it keeps around them: what the planner's margin is for); None on the CPU."""
    import torch

    return float(torch.cuda.max_memory_reserved()) if device == "cuda" else None


def _reset_memory(device: str) -> None:
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_memory(device: str) -> float:
    """Peak bytes since :func:`_reset_memory`: the GPU's allocations, or on the CPU the
    process's resident set (its peak since start: the CPU cannot reset it)."""
    import torch

    if device == "cuda":
        return float(torch.cuda.max_memory_allocated())
    from megatron_branchnorm.training.environment import peak_memory_mb

    return peak_memory_mb() * 2**20


# ---------------------------------------------------------------------------------------------
# train.py
# ---------------------------------------------------------------------------------------------


def train_overrides(
    shape: Shape, tokens: int, updates: int, save_dir: Path, extra: list[str]
) -> list[str]:
    """The config overrides (on tiny_cpu) of the train.py run: ``shape``, ``tokens`` per
    micro-batch and side, one stage and one micro-batch, bf16 + ZeRO-1, synthetic data, no
    validation, checkpoint or metrics rows in the timed updates; then ``extra``."""
    from megatron_branchnorm.resources import DS_CONFIG_DIR

    return [
        f"model.encoder_layers={shape.layers}",
        f"model.decoder_layers={shape.layers}",
        f"model.hidden_size={shape.dim}",
        f"model.ffn_hidden_size={shape.ffn}",
        f"model.num_attention_heads={shape.heads}",
        f"model.vocab_size={shape.vocab}",
        f"model.max_positions={2 * LENGTH}",
        f"data.max_tokens={tokens}",
        f"data.max_length={LENGTH}",
        "data.dataset=synthetic",
        f"data.synthetic_size={max(4000, 20 * tokens // LENGTH)}",
        "pipeline.stages=1",
        "train.micro_batches=1",
        f"train.max_steps={updates + PROFILED_UPDATES}",
        f"train.log_interval={updates + PROFILED_UPDATES + 1}",
        "train.eval_interval=0",
        "train.save_interval=0",
        f"train.deepspeed_config={DS_CONFIG_DIR / 'zero1_bf16.json'}",
        f"train.save_dir={save_dir}",
        f"data.bucket_shapes={BUCKET_SHAPES}",
        *extra,
    ]


def steady_updates(shapes: list[tuple], updates: int, warmup: int) -> list[int]:
    """The timed updates (indices) that count: those of the last half whose every bucket shape
    had been called more than ``warmup`` times before, so that with graphs each is a replay of
    a graph captured earlier (training/cuda_graphs.py runs a shape's first ``warmup`` calls
    eagerly and captures at the next). An update without shapes (``data.bucket_shapes=0``)
    always counts."""
    calls: dict = {}
    kept = []
    for i, update_shapes in enumerate(shapes[:updates]):
        if i >= updates // 2 and all(calls.get(k, 0) > warmup for k in update_shapes):
            kept.append(i)
        for k in update_shapes:
            calls[k] = calls.get(k, 0) + 1
    return kept


@contextlib.contextmanager
def _one_rank() -> Iterator[None]:
    """This process as a world of one rank for one Trainer (srun's variables for rank 0 of 1,
    :func:`megatron_branchnorm.runner.launch.rank_env`, joining the rendezvous store this
    process hosts, ``environment.own_rendezvous``); the environment is restored after."""
    from megatron_branchnorm.runner.launch import rank_env
    from megatron_branchnorm.training import environment

    world_of_one = {**rank_env(0, 1, None), **environment.own_rendezvous()}
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", *environment.own_rendezvous())
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update({k: world_of_one[k] for k in keys})
    try:
        yield
    finally:
        environment.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_train_py(
    shape: Shape,
    tokens: int,
    updates: int,
    device: str,
    work: Path,
    extra: list[str],
    system: str = "train.py",
) -> Result:
    """train.py's Trainer in this process (module docstring); its steady state, as the row of
    ``system`` (train.py+graphs: with ``model.cuda_graphs=on``)."""
    import torch

    from megatron_branchnorm.config import load_config
    from megatron_branchnorm.data.buckets import max_shapes_of
    from megatron_branchnorm.parallel.planner import plan_run, training_flops
    from megatron_branchnorm.training.cuda_graphs import WARMUP

    if system == "train.py+graphs":
        extra = [*extra, "model.cuda_graphs=on"]
    save_dir = work / f"{system.replace('.', '_').replace('+', '_')}_{tokens}"
    cfg = load_config("tiny_cpu", train_overrides(shape, tokens, updates, save_dir, extra))
    memory = torch.cuda.mem_get_info()[1] if device == "cuda" else 24 * 2**30
    plan = plan_run(cfg, 1, float(memory), stages=1)
    planned = plan.peak()
    # the planner's time, with the graphs of every shape for train.py+graphs
    plan = plan.with_shapes(max_shapes_of(cfg.data.bucket_shapes), cfg.model.cuda_graphs != "off")
    _reset_memory(device)
    clock, flops, tokens_done, prof, data_s = Clock(device), [], [], {}, []
    shapes: list[tuple] = []  # each update's bucket shapes, in order
    with _one_rank():
        from megatron_branchnorm.training.trainer import Trainer

        trainer = Trainer(cfg)
        next_update, update = trainer.stream.next_update, trainer._update

        def record_flops():
            started = time.perf_counter()
            u = next_update()
            data_s.append(time.perf_counter() - started)
            src = u.all_tokens - u.target_tokens  # what the trainer counts (metrics.Progress)
            flops.append(training_flops(cfg.model, src, u.target_tokens, u.samples))
            shapes.append(tuple(u.shapes or ()))
            return u

        def timed(t: int):
            i = len(tokens_done)
            if i == updates:  # the timed updates are done: a few under the profiler
                clock.stamp()
                prof["ctx"] = profiled(device)
                prof["out"] = prof["ctx"].__enter__()
            elif i < updates:
                clock.stamp()
            result = update(t)
            tokens_done.append(result.tokens)
            if i == updates + PROFILED_UPDATES - 1:
                prof["ctx"].__exit__(None, None, None)
            return result

        trainer.stream.next_update = record_flops
        trainer._update = timed
        trainer.checkpointer.save_if_missing = lambda *_a, **_k: None  # nothing to keep
        code = trainer.train()
        if "out" in prof and "busy" not in prof["out"]:  # the run ended early
            prof["ctx"].__exit__(None, None, None)
        if code != 0 or len(tokens_done) < updates + PROFILED_UPDATES:
            raise RuntimeError(f"train.py's Trainer exited {code} after {len(tokens_done)} updates")
        peak, reserved = _peak_memory(device), _peak_reserved(device)
        del trainer
    dts = clock.intervals()
    # graphed: past each shape's capture; eager: past each shape's first call
    kept = steady_updates(shapes, len(dts), WARMUP if system == "train.py+graphs" else 0)
    settled = bool(kept)
    if not settled:  # too few updates for that (the CPU's small mode): the last half, said
        kept = list(range(len(dts) // 2, len(dts)))

    def median(values: list[float]) -> float:
        return statistics.median(values[i] for i in kept)

    return Result(
        system,
        tokens,
        ms_per_update=median(dts) * 1e3,
        tokens_per_s=median([n / dt for n, dt in zip(tokens_done, dts, strict=False)]),
        flops_per_s=median([f / dt for f, dt in zip(flops, dts, strict=False)]),
        timed_updates=len(kept),
        settled=settled,
        busy=prof["out"]["busy"],
        peak_memory=peak,
        peak_reserved=reserved,
        planned_memory=planned,
        planned_ms=plan.seconds_per_update * 1e3,
        planned_flops=plan.stage_flops(plan.stage_plans[0]),
        layers=shape.layers,
        data_ms=steady_state(data_s[:updates]) * 1e3,
    )


# ---------------------------------------------------------------------------------------------
# The plain loops: ours (flat), torch.nn.Transformer (eager, compiled), torchscale
# ---------------------------------------------------------------------------------------------


def _register_timm_stand_in() -> None:
    """A ``timm`` with only ``timm.models.layers.drop_path`` (what torchscale 0.3.0 imports;
    real timm needs torchvision), from bench_anchors' stub, when timm is not installed."""
    from megatron_branchnorm.experiments import bench_anchors

    if "timm" in sys.modules or importlib.util.find_spec("timm") is not None:
        return  # installed, or the stand-in of an earlier call
    timm = types.ModuleType("timm")
    models = types.ModuleType("timm.models")
    layers = types.ModuleType("timm.models.layers")
    exec(compile(bench_anchors.TIMM_LAYERS_STUB, "timm/models/layers.py", "exec"), layers.__dict__)
    timm.models, models.layers = models, layers
    sys.modules.update({"timm": timm, "timm.models": models, "timm.models.layers": layers})


def torchscale_missing() -> str | None:
    """None when torchscale's encoder-decoder imports here, else why not (one line)."""
    if importlib.util.find_spec("torchscale") is None:
        return (
            "not installed (pip install --no-deps torchscale==0.3.0 fairscale==0.4.0; "
            "docs/performance.md, make gpu-bench)"
        )
    _register_timm_stand_in()
    try:
        importlib.import_module("torchscale.architecture.encoder_decoder")
    except ImportError as exc:
        return f"not importable: {exc}"
    return None


def loop_skip_reason(system: str, device: str) -> str | None:
    """Why ``system`` does not run here (one line), or None."""
    if system == "torchscale":
        return torchscale_missing()
    if system == "train.py+graphs" and device != "cuda":
        return "not run on the CPU (CUDA graphs need a CUDA device)"
    if system == "torch-compiled":
        if device != "cuda":
            return "not run on the CPU (inductor's CPU compile takes minutes; a GPU question)"
        from megatron_branchnorm.model.compile import compiler_available

        if not compiler_available():
            return "not run: inductor finds no C/C++ compiler (set CXX, or install g++)"
    return None


def run_loop(
    system: str, shape: Shape, tokens: int, updates: int, device: str, length: int = LENGTH
) -> Result:
    """``system``'s plain training loop (module docstring) at ``tokens`` per side: warm-up
    steps (compiling, for the compiled model), ``updates`` timed steps, a few profiled."""
    import torch

    from megatron_branchnorm.experiments import bench_models as bm

    batch = max(1, tokens // length)
    a = argparse.Namespace(
        layers=shape.layers, dim=shape.dim, ffn=shape.ffn, heads=shape.heads, vocab=shape.vocab,
        batch=batch, src=length, tgt=length, dropout=0.1, residual="branchnorm", root=None,
    )  # fmt: skip
    _reset_memory(device)
    torch.manual_seed(0)
    builder = bm.BUILDERS["torch" if system == "torch-compiled" else system]
    model = builder(a).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.98), fused=True)
    if system == "torch-compiled":
        model = torch.compile(model)
    src, prev, target = (x.to(device) for x in bm.make_batch(batch, length, length, shape.vocab))

    def step() -> None:
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = model(src, prev)
        bm.reference_loss(logits, target).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3 if device == "cuda" else 1):  # warm-up (compiling included)
        step()
    clock = Clock(device)
    for _ in range(updates):
        clock.stamp()
        step()
    clock.stamp()
    with profiled(device) as prof:
        for _ in range(PROFILED_UPDATES):
            step()
    dts = clock.intervals()
    ms = steady_state(dts)
    flops = _model_flops(shape, batch, length, length)
    peak = _peak_memory(device)
    return Result(
        system,
        tokens,
        ms_per_update=ms * 1e3,
        tokens_per_s=2 * batch * length / ms,
        flops_per_s=flops / ms,
        busy=prof["busy"],
        peak_memory=peak,
    )


# ---------------------------------------------------------------------------------------------
# The run and its table
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Bench:
    """What one run measured: header lines, the bf16 matmul peak (FLOP/s) and the rows."""

    header: list[str]
    peak_flops: float
    rows: list[Result]


def _bucket_shapes(extra: list[str]) -> str:
    """The train.py rows' ``data.bucket_shapes``: the last ``--override`` of it, else ours."""
    given = [o.split("=", 1)[1] for o in extra if o.split("=", 1)[0] == "data.bucket_shapes"]
    return given[-1] if given else str(BUCKET_SHAPES)


def run_bench(
    device: str,
    tokens: tuple[int, ...],
    updates: int,
    systems: tuple[str, ...],
    work: Path,
    extra: list[str],
    shape: Shape | None = None,
    log: Callable[[str], None] = lambda _line: None,
    max_minutes: float = math.inf,
) -> Bench:
    """Every system of ``systems`` at every size of ``tokens``, in this process, in
    :data:`RUN_ORDER` (a system at every size before the next); a row that would start too close to ``max_minutes`` (its
    :data:`RESERVE_S`) is left out with a note."""
    import deepspeed
    import torch
    import torch._dynamo

    from megatron_branchnorm.experiments.bench_step import matmul_peak
    from megatron_branchnorm.formats.files import one_line
    from megatron_branchnorm.runner.hardware import cpu_info

    shape = shape or (GPU_SHAPE if device == "cuda" else CPU_SHAPE)
    if device == "cuda":
        torch.cuda.set_device(0)
        name = torch.cuda.get_device_name()
    else:
        name = cpu_info().describe()
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    peak = matmul_peak(threads, n=CPU_MATMUL_N, reps=3, device=device, dtypes=("bf16",))["bf16"]
    peak *= 1e9
    header = [
        f"device: {name}",
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), DeepSpeed {deepspeed.__version__}",
        f"bf16 matmul peak ({8192 if device == 'cuda' else CPU_MATMUL_N}^3, this run): "
        f"{peak / 1e12:,.3g} TFLOP/s",
        f"model: {shape.describe()}; plain loops: sentences of {LENGTH} tokens, autocast bf16, "
        "fused AdamW; train.py: synthetic sentences of 4-32 tokens, bf16 + ZeRO-1",
        f"steady state: median of updates {updates // 2 + 1}-{updates} of {updates}; GPU busy: "
        f"{PROFILED_UPDATES} more updates under torch.profiler",
        f"train.py rows: data.bucket_shapes={_bucket_shapes(extra)}; of updates "
        f"{updates // 2 + 1}-{updates}, those whose every shape had run more than the graphs' "
        "eager warm-up calls before (with graphs: replays of graphs captured earlier)",
    ]
    if device != "cuda":
        header.append(
            "CPU small mode: it checks the code path, not a speed; peak memory is the process's "
            "peak resident set so far, and 'in aten ops' stands for GPU busy"
        )
    deadline = t0 + max_minutes * 60
    rows = []
    for system in sorted(systems, key=RUN_ORDER.index):
        for n in tokens:
            started = time.perf_counter()
            if deadline - started < RESERVE_S.get(system, 30.0):
                row = Result(
                    system, n, note=f"not run: the --max-minutes {max_minutes:g} are spent"
                )
            elif (reason := loop_skip_reason(system, device)) is not None:
                row = Result(system, n, note=reason)
            elif system in ("train.py", "train.py+graphs"):
                try:  # a failure (a capture the GPU refuses, out of memory) is this row's note
                    row = run_train_py(shape, n, updates, device, work, extra, system)
                except Exception as exc:
                    _reset_memory(device)
                    what = f"{type(exc).__name__}: {exc}"
                    row = Result(system, n, note=f"failed: {one_line(what, 200)} (see the log)")
                    traceback.print_exc()  # the whole story, into the log
            else:
                try:
                    row = run_loop(system, shape, n, updates, device)
                except torch.OutOfMemoryError:
                    _reset_memory(device)
                    row = Result(system, n, note="out of GPU memory")
                except torch._dynamo.exc.BackendCompilerFailed as exc:
                    row = Result(system, n, note=f"compile failed: {one_line(str(exc), 160)}")
            rows.append(row)
            log(f"{system} at {n} tokens: {time.perf_counter() - started:.1f} s: {row.brief()}")
    rows.sort(key=lambda r: (tokens.index(r.tokens), SYSTEMS.index(r.system)))
    header.append(f"total time: {time.perf_counter() - t0:.0f} s")
    return Bench(header, peak, rows)


def _gib(x: float | None) -> str:
    return "" if x is None else f"{x / 2**30:.2f} GiB"


def format_table(bench: Bench, device: str) -> str:
    """The header lines, the table, and train.py's ratios to the others at each size."""
    busy = "GPU busy" if device == "cuda" else "in aten ops"
    lines = [*bench.header, ""]
    lines.append(
        f"| system | tokens per side | ms per update | tokens/s | of bf16 peak | {busy} "
        "| peak memory |"
    )
    lines.append("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in bench.rows:
        label = LABELS[r.system]
        if r.tokens_per_s is None:
            lines.append(f"| {label} | {r.tokens:,} | {r.note} | | | | |")
            continue
        memory = _gib(r.peak_memory)
        if r.peak_reserved is not None:
            memory += f", {_gib(r.peak_reserved)} reserved"
        if r.planned_memory is not None:
            memory += f" (planner: {_gib(r.planned_memory)})"
        ms = f"{r.ms_per_update:.1f}"
        if r.timed_updates is not None:
            ms += f" over {r.timed_updates}" + ("" if r.settled else " (shapes not yet settled)")
        if r.planned_ms is not None:
            ms += f" (planner: {r.planned_ms:.1f})"
        lines.append(
            f"| {label} | {r.tokens:,} | {ms} | {r.tokens_per_s:,.0f} | "
            f"{r.flops_per_s / bench.peak_flops:.1%} | {r.busy:.0%} | {memory} |"
        )
    ours = {r.tokens: r for r in bench.rows if r.system == "train.py" and r.tokens_per_s}
    ratios = []
    for r in bench.rows:
        base = ours.get(r.tokens)
        if r.system != "train.py" and r.tokens_per_s and base is not None:
            ratios.append(f"{base.tokens_per_s / r.tokens_per_s:.2f}x {r.system} at {r.tokens:,}")
    if ratios:
        lines += ["", "train.py's tokens/s over: " + ", ".join(ratios)]
    data = [f"{r.data_ms:.2f} ms at {r.tokens:,}" for r in ours.values() if r.data_ms is not None]
    if data:
        lines += [
            "",
            "train.py's host time per update in its data stream (batches read, collated and "
            "padded to their bucket; the median of the timed updates): " + ", ".join(data),
        ]
    implied = [_implied(r) for r in bench.rows if r.planned_ms is not None and r.tokens_per_s]
    if implied:
        lines += [
            "",
            "what these runs make of the planner's rates (planner.RunPlan.stage_time; a GPU run "
            "calibrates it by them): " + "; ".join(implied),
        ]
    return "\n".join(lines)


def _implied(r: Result) -> str:
    """The planner's rate a train.py row implies: eagerly the host's time per layer pair (if
    the host set the pace), with graphs the GPU's sustained TFLOP/s (if the GPU did)."""
    from megatron_branchnorm.parallel.planner import DEFAULT_TFLOPS, EAGER_HOST_S

    if r.system == "train.py":
        pair = sum(EAGER_HOST_S.values()) * 1e3
        return (
            f"train.py at {r.tokens:,}: {r.ms_per_update / r.layers:.2f} ms of host time per "
            f"encoder + decoder layer pair if the host set the pace (planner: {pair:.2f} ms)"
        )
    rate = r.planned_flops / (r.ms_per_update * 1e-3) / 1e12
    return (
        f"{r.system} at {r.tokens:,}: {rate:.1f} TFLOP/s of matmuls (padding counted) if the GPU "
        f"set the pace (planner: {DEFAULT_TFLOPS:g})"
    )


@contextlib.contextmanager
def _output_to(log) -> Iterator[None]:
    """Send this process's stdout and stderr (file descriptors 1 and 2: DeepSpeed's and the
    trainer's lines, the profiler's C++ messages) to ``log`` while the block runs."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved, strict=True):
            os.dup2(copy, fd)
            os.close(copy)


def main(argv: list[str] | None = None) -> int:
    """Parse, run, print the table (module docstring); bad input is one line and exit 2, a
    train.py row that failed (its note says why) exit 1."""
    from megatron_branchnorm.cli import run_main

    return run_main(_main, argv)


REPORT_KEYS = frozenset({"header", "peak_flops", "rows"})
"""The keys of a --json report: how one of ours is recognised."""


def is_our_report(path: Path) -> bool:
    """Whether ``path`` holds a --json report of ours (exactly :data:`REPORT_KEYS`)."""
    data = read_report(path)
    return isinstance(data, dict) and set(data) == REPORT_KEYS


def check_outputs(workdir: str | None, json_path: str | None) -> None:
    """Before anything runs: --workdir new or empty (its runs are created there), never inside
    a directory of a known kind; --json not inside one either, and an existing file replaced
    only when it is a report of ours (outputs.check_output_file)."""
    check_workdir_and_report("gpu_bench", workdir, json_path, is_our_report)


def _main(argv: list[str] | None) -> int:
    from megatron_branchnorm.cli import ArgumentParser, float_flag, int_flag

    p = ArgumentParser(prog="gpu_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--updates", type=int_flag(2, 10**5), default=None,
                   help="timed updates per system and size (default: 40 on a GPU, 6 on the CPU)")  # fmt: skip
    p.add_argument("--tokens", default=None,
                   help="tokens per side per update, comma-separated (default: 4096,16384 on a "
                   "GPU, 64,128 on the CPU)")  # fmt: skip
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated, of {', '.join(SYSTEMS)}")  # fmt: skip
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for the train.py runs (repeatable)")  # fmt: skip
    p.add_argument("--max-minutes", type=float_flag(0.5), default=None,
                   help="start no system after this (default: 7 on a GPU, none on the CPU)")  # fmt: skip
    p.add_argument(
        "--workdir", default=None, help="logs and the runs' save_dirs (default: a temp dir)"
    )
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--layers", type=int_flag(1, 1000), default=None,
                   help="encoder and decoder layers of every system (default: 12 on a GPU, "
                        "1 on the CPU)")  # fmt: skip
    a = p.parse_args(argv)
    check_outputs(a.workdir, a.json)
    systems = tuple(s for s in a.systems.split(",") if s)
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        p.error(
            f"--systems: unknown {', '.join(unknown) or '(none given)'}; of {', '.join(SYSTEMS)}"
        )
    for item in a.override:
        if "=" not in item:
            p.error(f"--override: expected KEY=VALUE, got {item!r}")
    import torch

    device = a.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")
    default_tokens = GPU_TOKENS if device == "cuda" else CPU_TOKENS
    try:
        tokens = tuple(int(t) for t in a.tokens.split(",")) if a.tokens else default_tokens
    except ValueError:
        p.error(f"--tokens: expected integers separated by commas, got {a.tokens!r}")
    if not tokens or min(tokens) < LENGTH:
        p.error(f"--tokens: each must be at least {LENGTH} (one sentence), got {a.tokens!r}")
    updates = a.updates or (40 if device == "cuda" else 6)
    shape = GPU_SHAPE if device == "cuda" else CPU_SHAPE
    if a.layers:
        shape = dataclasses.replace(shape, layers=a.layers)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="mbn_gpu_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    from megatron_branchnorm.training.environment import setup_process_env

    setup_process_env()
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    from deepspeed.utils import logger

    logger.setLevel(logging.ERROR)  # its memory reports would bury the table
    log_path = work / "gpu_bench.log"
    # each row's progress line also goes to this process's own output, past the redirection
    # below: a run cut off by a time limit (a lent GPU's minutes) still shows the rows it ran
    with open(os.dup(1), "w", encoding="utf-8") as terminal:

        def progress(line: str) -> None:
            print(line, flush=True)  # the log
            print(line, file=terminal, flush=True)

        with open(log_path, "w", encoding="utf-8") as log, _output_to(log):
            bench = run_bench(
                device, tokens, updates, systems, work, list(a.override), log=progress,
                max_minutes=a.max_minutes or (7.0 if device == "cuda" else math.inf), shape=shape,
            )  # fmt: skip
    print(format_table(bench, device))
    print(f"\nlogs: {log_path}")
    if a.json:
        rows = [dataclasses.asdict(r) for r in bench.rows]
        write_text_output(
            a.json,
            json.dumps(
                {"header": bench.header, "peak_flops": bench.peak_flops, "rows": rows}, indent=1
            ),
        )
    return 1 if any(r.note.startswith("failed:") for r in bench.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
