"""Kernel-launching ops per layer per micro-batch inside DeepSpeed's ``train_batch``.

    python -m megatron_branchnorm.experiments.launches                    # 12L, 200L, 1000L
    python -m megatron_branchnorm.experiments.launches --configs opus100_200L --json out.json
    python tools/benchmark.py --sections launches                          # the same, as a section

On a GPU every aten op that launches a kernel costs 5-10 us of launch overhead; at d=512 and
4,096 tokens per micro-batch a layer's kernels do only a few us of work each, so the number of
kernel-launching ops per layer per micro-batch is the proxy for speed (docs/performance.md,
"Kernel launches per layer"; ../shared/DESIGN.md §11).

How the count is made:

- :class:`LaunchCounter`, a ``TorchDispatchMode``, sees every op dispatched while it is active
  (forward, backward, recompute, optimizer) and counts the aten ops that launch a kernel: not
  views, allocations, metadata queries or ``_local_scalar_dense`` (:func:`op_kind`). It counts
  host syncs apart (``_local_scalar_dense``, which ``float(t)``, ``int(t)``, ``.item()`` and
  ``bool(t)`` reach, and the ops that sync on CUDA: :data:`HOST_SYNC_OPS`), and tracks the
  bytes of the storages allocated inside it while they live (weakref finalizers), with their
  peak. Two more ways to block the host are counted apart: device-to-host copies (a copy op
  from a tensor on the measured device into a CPU tensor, :func:`is_device_to_host_copy`:
  what ``.cpu()``, ``.tolist()``, ``.to("cpu")`` and ``cpu_tensor.copy_(t)`` dispatch) and
  synchronize calls (``torch.cuda.synchronize``, ``torch.cuda.Stream.synchronize``,
  ``torch.cuda.Event.synchronize``, ``torch.accelerator.synchronize`` and DeepSpeed's
  ``get_accelerator().synchronize``, wrapped while the counter is active:
  :func:`synchronize_targets`). Each of the three inside the pipeline instructions that run
  once per micro-batch is reported per micro-batch, the others (optimizer step, gradient
  reductions) per update.
- :func:`run_child` runs the real :class:`~megatron_branchnorm.training.trainer.Trainer` in one
  process (1 stage, world size 1) with the counter wrapped around the engine's ``train_batch``
  (the instance attribute): the first update is a warm-up (first-touch allocations, lazy
  state), the next ``updates`` are counted and averaged.
- Per-layer attribution by difference (:func:`measure_config`): the same settings with
  (E, D) = (2, 2), (4, 2) and (2, 4) encoder/decoder layers, each in its own process (one
  process group per process); ops per encoder layer per micro-batch =
  (count(4, 2) - count(2, 2)) / 2 / micro-batches, likewise the decoder. This includes the
  optimizer's per-parameter work of a layer, amortised over the update's micro-batches.
- Op counts do not depend on the width, so they run at a tiny width; the peak memory does, so
  it is measured apart at the config's width, a 64,000 vocabulary and its max_tokens, with
  1 + 1 layers and 1 micro-batch (the one stage holds the embedding, the output projection and
  the loss: it is the last stage).

What the CPU count cannot show: host-to-device copies of a micro-batch's token ids (on a CPU
``.to(device)`` dispatches nothing), device-to-host copies (on a CPU the measured device is the
host: the GPU check counts them), collectives (not aten ops: kept apart in ``other_ops``),
and kernel choices made inside one aten op (SDPA's backend, a fused optimizer); each is one
op either way. The model's own code path differs in one place: dropout takes ``F.dropout``
on CUDA (1 op forward, 1 backward) and model/dropout.py's mask on the CPU (5 forward, 2
backward), so a checkpointed layer counts 9 ops per dropout more here than on a GPU
(docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import weakref
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron_branchnorm.cli import run_main
from megatron_branchnorm.formats.outputs import check_output_file, read_report, write_text_output

DEFAULT_CONFIGS = ("opus100_12L", "opus100_200L", "opus100_1000L")
"""The configs the command measures by default."""

LAYOUTS = ((2, 2), (4, 2), (2, 4))
"""(encoder, decoder) layers of the three op-count runs: a base and one more pair of each."""

TINY_WIDTH = (
    "model.hidden_size=64",
    "model.ffn_hidden_size=256",
    "model.num_attention_heads=4",
    "model.vocab_size=128",
    "data.max_tokens=256",
    "data.max_length=32",
)
"""The width of the op-count runs (counts do not depend on it)."""

MEMORY_VOCAB = 64000
"""The vocabulary of the peak-memory run (OPUS-100's and MultiUN's joint SentencePiece)."""

METADATA_OPS = frozenset(
    {
        "size",
        "stride",
        "numel",
        "dim",
        "is_same_size",
        "is_contiguous",
        "set_",
        "resize_",
        "_has_compatible_shallow_copy_type",
    }
)
"""Ops that read or rewrite a tensor's metadata only (``sym_*`` too, by prefix)."""

ALIAS_OPS = frozenset({"detach", "alias", "lift_fresh", "_unsafe_view", "_reshape_alias"})
"""Ops that return a tensor sharing its input's storage. ``_unsafe_view`` is a view that
autograd does not track as one (``matmul`` reshapes through it); the schema of the others
already says alias."""

HOST_SYNC_OPS = frozenset(
    {"_local_scalar_dense", "nonzero", "is_nonzero", "equal", "masked_select", "item"}
)
"""Ops that wait for the GPU (``unique*`` too, by prefix): ``_local_scalar_dense`` is what
``float(t)``, ``int(t)``, ``.item()`` and ``bool(t)`` dispatch; the others need a result's
size or value on the host."""

COPY_OPS = frozenset({"_to_copy", "copy_", "copy", "_copy_from", "_copy_from_and_resize"})
"""Ops that copy a tensor's values, possibly to another device: ``.to(device)``, ``.cpu()``
and ``.tolist()`` (of a tensor off the CPU) dispatch ``_to_copy``; ``dst.copy_(src)`` and
``dst[...] = src`` dispatch ``copy_``."""

PER_MICRO_BATCH_PHASES = frozenset(
    {
        "LoadMicroBatch",
        "ForwardPass",
        "BackwardPass",
        "SendActivation",
        "RecvActivation",
        "SendGrad",
        "RecvGrad",
    }
)
"""DeepSpeed's pipeline instructions that run once per micro-batch; the others
(``ReduceGrads``, ``ReduceTiedGrads``, ``OptimizerStep``) and ``train_batch``'s own code run
once per update."""

_KIND_CACHE: dict[Any, str] = {}


def op_kind(func: Any) -> str:
    """What an op does to the GPU: ``kernel`` (launches one), ``view`` (a view or alias of
    its input), ``alloc`` (``empty*``, ``new_empty*``: memory, no kernel), ``meta`` (metadata:
    sizes, strides, ``set_``, ``resize_``), ``scalar`` (``_local_scalar_dense``: a copy to the
    host, counted as a sync) or ``other`` (not an aten op: collectives, profiler markers)."""
    kind = _KIND_CACHE.get(func)
    if kind is None:
        kind = _classify(func)
        _KIND_CACHE[func] = kind
    return kind


def _classify(func: Any) -> str:
    """:func:`op_kind` without the cache."""
    if getattr(func, "namespace", "aten") != "aten":
        return "other"
    name = func._overloadpacket.__name__
    if name == "_local_scalar_dense":
        return "scalar"
    if name in METADATA_OPS or name.startswith("sym_"):
        return "meta"
    if name.startswith(("empty", "new_empty")):
        return "alloc"
    if getattr(func, "is_view", False) or name in ALIAS_OPS:
        return "view"
    if any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns):
        return "view"
    return "kernel"


def is_host_sync(func: Any) -> bool:
    """True for the ops in :data:`HOST_SYNC_OPS` and ``unique*``."""
    name = func._overloadpacket.__name__
    return name in HOST_SYNC_OPS or name.lstrip("_").startswith("unique")


def copy_devices(func: Any, args: tuple, kwargs: dict) -> tuple[str, str] | None:
    """The device types (source, destination) of a copy op (:data:`COPY_OPS`) called with
    ``args`` and ``kwargs``; None for any other op."""
    name = func._overloadpacket.__name__
    if name not in COPY_OPS:
        return None
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if name == "_to_copy" and tensors:
        device = kwargs.get("device")
        src = tensors[0].device.type
        return src, src if device is None else torch.device(device).type
    if len(tensors) < 2:
        return None
    if name in ("copy_", "copy"):  # copy_(self=destination, src)
        return tensors[1].device.type, tensors[0].device.type
    return tensors[0].device.type, tensors[1].device.type  # _copy_from(self=source, dst)


def is_device_to_host_copy(
    func: Any, args: tuple, kwargs: dict, device_type: str | None = None
) -> bool:
    """True for a copy op from a tensor on the measured device (of type ``device_type``:
    ``cuda``; None: any device but the CPU) into a CPU tensor: the host waits for the device.
    Never when the measured device is the CPU."""
    devices = copy_devices(func, args, kwargs)
    if devices is None or devices[1] != "cpu" or devices[0] == "cpu":
        return False
    return device_type is None or devices[0] == device_type


def synchronize_targets() -> list[tuple[Any, str]]:
    """``(owner, name)`` of each ``synchronize`` that blocks the host until a device is done,
    where this torch has it: ``torch.cuda``'s, its ``Stream``'s and ``Event``'s,
    ``torch.accelerator``'s, and that of the accelerator object DeepSpeed's ``get_accelerator()``
    returns (the CPU accelerator's is a no-op)."""
    from deepspeed.accelerator import get_accelerator

    owners = [
        (torch.cuda, "torch.cuda.synchronize"),
        (getattr(torch.cuda, "Stream", None), "torch.cuda.Stream.synchronize"),
        (getattr(torch.cuda, "Event", None), "torch.cuda.Event.synchronize"),
        (getattr(torch, "accelerator", None), "torch.accelerator.synchronize"),
        (get_accelerator(), "deepspeed accelerator.synchronize"),
    ]
    return [
        (o, n) for o, n in owners if o is not None and callable(getattr(o, "synchronize", None))
    ]


_MISSING = object()


def call_site(
    skip: str = __file__, roots: tuple[str, ...] = ("megatron_branchnorm", "deepspeed")
) -> str:
    """``file:line function`` of the innermost caller under one of ``roots`` (the frames of
    torch and of the module ``skip`` are skipped); ``?`` when there is none."""
    here = os.path.abspath(skip)
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if os.path.abspath(path) != here:
            for root in roots:
                marker = f"{os.sep}{root}{os.sep}"
                if marker in path:
                    rel = root + os.sep + path.rsplit(marker, 1)[1]
                    return f"{rel}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


class LaunchCounter(TorchDispatchMode):
    """While active (``with counter:``), counts the kernel-launching aten ops dispatched, the
    host syncs, the device-to-host copies from a tensor on ``device_type`` (None: any device
    but the CPU), the synchronize calls (:func:`synchronize_targets`, wrapped while active; a
    synchronize called inside another counts once), and the live and peak bytes of the
    storages allocated inside it.

    The counts accumulate over every activation; ``phase`` (set by the caller, e.g. per
    pipeline instruction) labels the ops counted while it is set. Live bytes stay tracked
    between activations (a storage allocated inside is freed whenever its last tensor dies)."""

    def __init__(self, device_type: str | None = None) -> None:
        super().__init__()
        self.device_type = device_type
        """The measured device's type (``cuda``): copies from it to the CPU are counted."""
        self.ops: Counter[str] = Counter()
        """Kernel-launching ops by overload name (``aten.add.Tensor``)."""
        self.skipped: Counter[str] = Counter()
        """Ops not counted, by :func:`op_kind`."""
        self.other_ops: Counter[str] = Counter()
        """Dispatched ops outside the aten namespace, by name (not counted as kernels)."""
        self.syncs: Counter[str] = Counter()
        """Host syncs by op name."""
        self.sync_sites: Counter[str] = Counter()
        """Host syncs by the caller that caused them (``file:line function``)."""
        self.sync_phases: Counter[str] = Counter()
        """Host syncs by :attr:`phase`."""
        self.d2h_ops: Counter[str] = Counter()
        """Device-to-host copies by op name (``aten._to_copy.default``)."""
        self.d2h_sites: Counter[str] = Counter()
        """Device-to-host copies by caller."""
        self.d2h_phases: Counter[str] = Counter()
        """Device-to-host copies by :attr:`phase`."""
        self.sync_funcs: Counter[str] = Counter()
        """Synchronize calls by function (``torch.cuda.synchronize``)."""
        self.sync_func_sites: Counter[str] = Counter()
        """Synchronize calls by caller."""
        self.sync_func_phases: Counter[str] = Counter()
        """Synchronize calls by :attr:`phase`."""
        self.phase = "other"
        self.by_phase: Counter[str] = Counter()
        """Kernel ops by :attr:`phase`."""
        self.phase_ops: Counter[str] = Counter()
        """Kernel ops by ``phase|op name``."""
        self.live_bytes = 0
        self.peak_bytes = 0
        self.peak_by_op: dict[str, int] = {}
        """Bytes live at the peak by the op that allocated them (refreshed at each new peak
        0.1% above the last snapshot)."""
        self._live: dict[int, tuple[int, str]] = {}
        self._snapshot_bytes = 0
        self._active = 0
        self._in_sync = 0
        self._saved: list[tuple[Any, Any]] = []

    @property
    def kernel_ops(self) -> int:
        """All kernel-launching ops counted so far."""
        return sum(self.ops.values())

    @property
    def host_syncs(self) -> int:
        """All host syncs counted so far."""
        return sum(self.syncs.values())

    @property
    def d2h_copies(self) -> int:
        """All device-to-host copies counted so far."""
        return sum(self.d2h_ops.values())

    @property
    def sync_calls(self) -> int:
        """All synchronize calls counted so far."""
        return sum(self.sync_funcs.values())

    def __enter__(self) -> LaunchCounter:
        if self._active == 0:
            for owner, name in synchronize_targets():
                saved = vars(owner).get("synchronize", _MISSING)
                wrapper = self._counted_sync(name, owner.synchronize)
                owner.synchronize = wrapper
                self._saved.append((owner, saved))
        self._active += 1
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            self._active -= 1
            if self._active == 0:
                for owner, saved in reversed(self._saved):
                    if saved is _MISSING:
                        del owner.synchronize
                    else:
                        owner.synchronize = saved
                self._saved.clear()

    def _counted_sync(self, name: str, original: Callable) -> Callable:
        """``original`` (a synchronize), counted as ``name`` unless another one called it."""
        counter = self

        def synchronize(*args: Any, **kwargs: Any) -> Any:
            if not counter._in_sync:
                counter.sync_funcs[name] += 1
                counter.sync_func_sites[call_site()] += 1
                counter.sync_func_phases[counter.phase] += 1
            counter._in_sync += 1
            try:
                return original(*args, **kwargs)
            finally:
                counter._in_sync -= 1

        return synchronize

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        """Run ``func`` and count it (the mode is off while it runs: no op counts twice)."""
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind = op_kind(func)
        name = str(func)
        if kind == "kernel":
            self.ops[name] += 1
            self.by_phase[self.phase] += 1
            self.phase_ops[f"{self.phase}|{name}"] += 1
        elif kind == "other":
            self.other_ops[name] += 1
        else:
            self.skipped[kind] += 1
        if kind != "other" and is_host_sync(func):
            self.syncs[func._overloadpacket.__name__] += 1
            self.sync_sites[call_site()] += 1
            self.sync_phases[self.phase] += 1
        if kind != "other" and is_device_to_host_copy(func, args, kwargs, self.device_type):
            self.d2h_ops[name] += 1
            self.d2h_sites[call_site()] += 1
            self.d2h_phases[self.phase] += 1
        if kind in ("kernel", "alloc"):
            self._track(args, kwargs, out, name)
        return out

    def _track(self, args: Any, kwargs: dict, out: Any, name: str) -> None:
        """Register the storages of ``out`` that no input holds (new allocations)."""
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outs:
            return
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in outs:
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or ptr in inputs or ptr in self._live:
                continue
            self._live[ptr] = (nbytes, name)
            self.live_bytes += nbytes
            if self.live_bytes > self.peak_bytes:
                self.peak_bytes = self.live_bytes
                if self.live_bytes > self._snapshot_bytes * 1.001:
                    self._snapshot()
            weakref.finalize(storage, self._freed, ptr)

    def _snapshot(self) -> None:
        """Record :attr:`peak_by_op` from the storages live now."""
        by_op: Counter[str] = Counter()
        for nbytes, name in self._live.values():
            by_op[name] += nbytes
        self.peak_by_op = dict(by_op.most_common())
        self._snapshot_bytes = self.live_bytes

    def _freed(self, ptr: int) -> None:
        """A tracked storage died (its weakref finalizer)."""
        self.live_bytes -= self._live.pop(ptr, (0, ""))[0]

    def reset_peak(self) -> None:
        """Start a new peak from the bytes live now."""
        self.peak_bytes = self._snapshot_bytes = self.live_bytes
        self._snapshot()


# ---------------------------------------------------------------------------------------------
# One process: the real trainer with the counter around train_batch
# ---------------------------------------------------------------------------------------------


class CompiledLaunchCounter(LaunchCounter):
    """:class:`LaunchCounter` for ``model.compile=true``: a Dynamo "infra" mode, so compiled
    code runs under it (a plain dispatch mode makes Dynamo run the frame eagerly), counting
    the aten ops compiled code still dispatches (matmuls, attention) plus one op per kernel
    that inductor generated, from profiler events (``cpp_fused_*`` on CPU, ``triton_*`` on
    CUDA; the CPU ones need ``torch._inductor.config.cpp.enable_kernel_profile``)."""

    @classmethod
    def is_infra_mode(cls) -> bool:
        return True

    def __enter__(self) -> CompiledLaunchCounter:
        self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self._profiler.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        out = super().__exit__(*exc)
        self._profiler.__exit__(None, None, None)
        names = (e.name for e in self._profiler.events())
        n = sum(1 for name in names if "cpp_fused" in name or name.startswith("triton_"))
        self.ops["inductor.generated_kernel"] += n
        self.by_phase["inductor kernels"] += n  # the profiler sees a whole activation
        self.phase_ops["inductor kernels|inductor.generated_kernel"] += n
        return out


def instrument_engine(engine: Any, counter: LaunchCounter, warmup: int) -> None:
    """Wrap ``engine.train_batch`` (the instance attribute): calls after the first ``warmup``
    run inside ``counter``, with ``counter.phase`` naming the pipeline instruction running
    (through the instance's ``_INSTRUCTION_MAP``, which ``pipeline.install_engine_fixes``
    already copied; left alone where it is missing)."""
    original = engine.train_batch
    calls = 0

    def train_batch(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls <= warmup:
            return original(*args, **kwargs)
        counter.phase = "train_batch"
        try:
            with counter:
                return original(*args, **kwargs)
        finally:
            counter.phase = "other"

    engine.train_batch = train_batch
    imap = getattr(engine, "_INSTRUCTION_MAP", None)
    if isinstance(imap, dict):
        engine._INSTRUCTION_MAP = {
            cls: _phased(counter, cls.__name__, fn) for cls, fn in imap.items()
        }


def _phased(counter: LaunchCounter, name: str, fn: Callable) -> Callable:
    """``fn`` (an unbound engine method) with ``counter.phase`` set to ``name`` around it."""

    def run(self: Any, **kwargs: Any) -> Any:
        before = counter.phase
        counter.phase = name
        try:
            return fn(self, **kwargs)
        finally:
            counter.phase = before

    return run


def use_cuda_dropout() -> None:
    """Make this process's dropout the op CUDA runs (``native_dropout``: one op forward, one
    backward) instead of model/dropout.py's CPU mask (5 forward, 2 backward), so the count is
    the one a GPU launches. ``native_dropout`` has a CPU kernel; the mask it draws differs,
    which a count does not see."""
    from megatron_branchnorm.model import dropout as dropout_module

    def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
        if not training or p == 0.0:
            return x
        return torch.native_dropout(x, p, True)[0]

    dropout_module.dropout = dropout


def run_child(spec: dict) -> dict:
    """Train ``spec["updates"] + spec["warmup"]`` updates of ``spec["config"]`` with
    ``spec["overrides"]`` in this process (1 stage, world size 1) and count the measured
    ``train_batch`` calls. Returns the counters (summed over the measured updates)."""
    import megatron_branchnorm
    from megatron_branchnorm.config import load_config
    from megatron_branchnorm.training import environment as env
    from megatron_branchnorm.training.trainer import Trainer

    warmup, updates = int(spec["warmup"]), int(spec["updates"])
    if spec.get("dropout_as_cuda"):
        use_cuda_dropout()
    with tempfile.TemporaryDirectory(prefix="mbn_launches_") as save_dir:
        cfg = load_config(
            spec["config"],
            [
                *spec["overrides"],
                f"train.save_dir={save_dir}",
                f"train.max_steps={warmup + updates}",
                "train.save_interval=0",
                "train.eval_interval=0",
                f"train.log_interval={warmup + updates + 1}",
            ],
        )
        trainer = Trainer(cfg)
        device_type = torch.device(trainer.engine.device).type
        if cfg.model.compile:
            import torch._inductor.config as inductor_config

            inductor_config.cpp.enable_kernel_profile = True
            counter: LaunchCounter = CompiledLaunchCounter(device_type)
        else:
            counter = LaunchCounter(device_type)
        instrument_engine(trainer.engine, counter, warmup)
        # the run's end would save a checkpoint: the measurement needs none
        trainer.checkpointer.save_if_missing = lambda *_args, **_kwargs: None
        t0 = time.perf_counter()
        code = trainer.train()
        wall = time.perf_counter() - t0
        env.destroy_process_group()
    if code != 0:
        raise RuntimeError(f"the trainer exited {code}")
    return {
        "config": spec["config"],
        "package": str(Path(megatron_branchnorm.__file__).parent),
        "overrides": list(spec["overrides"]),
        "micro_batches": cfg.train.micro_batches,
        "updates": updates,
        "warmup": warmup,
        "encoder_layers": cfg.model.encoder_layers,
        "decoder_layers": cfg.model.decoder_layers,
        "kernel_ops": counter.kernel_ops,
        "ops": dict(counter.ops),
        "by_phase": dict(counter.by_phase),
        "phase_ops": dict(counter.phase_ops),
        "skipped": dict(counter.skipped),
        "other_ops": dict(counter.other_ops),
        "host_syncs": counter.host_syncs,
        "syncs": dict(counter.syncs),
        "sync_sites": dict(counter.sync_sites),
        "sync_phases": dict(counter.sync_phases),
        "device_type": device_type,
        "d2h_copies": counter.d2h_copies,
        "d2h_ops": dict(counter.d2h_ops),
        "d2h_sites": dict(counter.d2h_sites),
        "d2h_phases": dict(counter.d2h_phases),
        "sync_calls": counter.sync_calls,
        "sync_funcs": dict(counter.sync_funcs),
        "sync_func_sites": dict(counter.sync_func_sites),
        "sync_func_phases": dict(counter.sync_func_phases),
        "peak_bytes": counter.peak_bytes,
        "peak_by_op": counter.peak_by_op,
        "wall_s": wall,
    }


def _child_env(threads: int | None) -> dict[str, str]:
    """This environment without a launcher's rank variables (the child is a world of one).

    Not :func:`megatron_branchnorm.runner.ranks.start_ranks`: a world of one without
    ``MASTER_PORT`` hosts its own rendezvous store on a port the system gives it and holds
    (``environment.setup_process_env``), so no port sits unbound between being picked and used
    while the children started beside it take ephemeral ports."""
    env = dict(os.environ)
    for key in (
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT",
        "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "MBN_FAULT_INJECT",
    ):  # fmt: skip
        env.pop(key, None)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    # the child imports this package from where the parent did
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def spawn_child(spec: dict, timeout: float = 1800.0, threads: int | None = None) -> dict:
    """:func:`run_child` in a new process (its own process group); its result."""
    with tempfile.TemporaryDirectory(prefix="mbn_launches_") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            sys.executable, "-m", "megatron_branchnorm.experiments.launches",
            "--child", json.dumps(spec), "--out", str(out),
        ]  # fmt: skip
        proc = subprocess.run(
            cmd, env=_child_env(threads), capture_output=True, text=True, timeout=timeout
        )
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            raise RuntimeError(
                f"launch count of {spec['config']} failed ({proc.returncode}):\n{tail}"
            )
        return json.loads(out.read_text())


# ---------------------------------------------------------------------------------------------
# Per layer, by difference
# ---------------------------------------------------------------------------------------------


def count_specs(
    config: str,
    micro_batches: int | None = None,
    updates: int = 2,
    warmup: int = 1,
    extra: tuple[str, ...] = (),
) -> list[dict]:
    """The three op-count runs of ``config`` (:data:`LAYOUTS`, :data:`TINY_WIDTH`, 1 stage,
    synthetic data), with the config's DeepSpeed JSON, activation checkpointing and
    micro-batches (or ``micro_batches``)."""
    base = [
        "pipeline.stages=1",
        "pipeline.data_parallel=0",  # the config's micro-batches on the one replica
        "data.dataset=synthetic",
        "data.synthetic_size=2000",
        *TINY_WIDTH,
    ]
    if micro_batches:
        base.append(f"train.micro_batches={micro_batches}")
    return [
        {
            "config": config,
            "overrides": [
                *base,
                f"model.encoder_layers={e}",
                f"model.decoder_layers={d}",
                *extra,
            ],
            "updates": updates,
            "warmup": warmup,
        }
        for e, d in LAYOUTS
    ]


def memory_spec(config: str, vocab: int = MEMORY_VOCAB, extra: tuple[str, ...] = ()) -> dict:
    """The peak-memory run of ``config``: its width and max_tokens, ``vocab``, 1 + 1 layers,
    1 micro-batch, 1 warm-up and 1 measured update."""
    return {
        "config": config,
        "overrides": [
            "pipeline.stages=1",
            "pipeline.data_parallel=0",  # one micro-batch on the one replica
            "data.dataset=synthetic",
            "data.synthetic_size=4000",
            f"model.vocab_size={vocab}",
            "model.encoder_layers=1",
            "model.decoder_layers=1",
            "train.micro_batches=1",
            *extra,
        ],
        "updates": 1,
        "warmup": 1,
    }


def per_layer(runs: list[dict]) -> dict:
    """Ops per encoder and decoder layer per micro-batch from the three runs of
    :func:`count_specs` (in :data:`LAYOUTS` order), the kernel ops by phase and by op name per
    layer, and the host syncs, device-to-host copies and synchronize calls of the (2, 2) run:
    those inside the instructions that run once per micro-batch
    (:data:`PER_MICRO_BATCH_PHASES`) per micro-batch, the others per update."""
    base, enc, dec = runs
    mb = base["micro_batches"]
    norm = mb * base["updates"]

    def layer(run: dict, key: str, extra_layers: int) -> dict[str, float]:
        diff = Counter(run[key])
        diff.subtract(base[key])
        return {k: v / extra_layers / norm for k, v in diff.items() if v}

    def split(total: str, phases: str) -> tuple[float, float]:
        per_mb = sum(n for phase, n in base[phases].items() if phase in PER_MICRO_BATCH_PHASES)
        return per_mb / norm, (base[total] - per_mb) / base["updates"]

    def per_update(sites: str) -> dict[str, float]:
        return {k: v / base["updates"] for k, v in sorted(base[sites].items())}

    syncs_mb, syncs_update = split("host_syncs", "sync_phases")
    d2h_mb, d2h_update = split("d2h_copies", "d2h_phases")
    calls_mb, calls_update = split("sync_calls", "sync_func_phases")
    de = enc["encoder_layers"] - base["encoder_layers"]
    dd = dec["decoder_layers"] - base["decoder_layers"]
    enc_ops = (enc["kernel_ops"] - base["kernel_ops"]) / de / norm
    dec_ops = (dec["kernel_ops"] - base["kernel_ops"]) / dd / norm
    return {
        "micro_batches": mb,
        "updates": base["updates"],
        "enc_ops_per_layer_mb": enc_ops,
        "dec_ops_per_layer_mb": dec_ops,
        "avg_ops_per_layer_mb": (enc_ops + dec_ops) / 2,
        "host_syncs_per_mb": syncs_mb,
        "host_syncs_per_update": syncs_update,
        "sync_sites_per_update": per_update("sync_sites"),
        "d2h_copies_per_mb": d2h_mb,
        "d2h_copies_per_update": d2h_update,
        "d2h_sites_per_update": per_update("d2h_sites"),
        "sync_calls_per_mb": calls_mb,
        "sync_calls_per_update": calls_update,
        "sync_call_sites_per_update": per_update("sync_func_sites"),
        "kernel_ops_per_mb_2x2": base["kernel_ops"] / norm,
        "enc_by_phase": layer(enc, "by_phase", de),
        "dec_by_phase": layer(dec, "by_phase", dd),
        "enc_ops": layer(enc, "ops", de),
        "dec_ops": layer(dec, "ops", dd),
        "enc_phase_ops": layer(enc, "phase_ops", de),
        "dec_phase_ops": layer(dec, "phase_ops", dd),
        "other_ops_per_update_2x2": {
            k: v / base["updates"] for k, v in sorted(base["other_ops"].items())
        },
    }


def _map(fn: Callable, items: list, jobs: int) -> list:
    """``[fn(x) for x in items]``, ``jobs`` at a time (threads; each call waits on a process)."""
    if jobs <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(fn, items))


def measure_config(
    config: str,
    micro_batches: int | None = None,
    updates: int = 2,
    memory: bool = True,
    vocab: int = MEMORY_VOCAB,
    jobs: int = 2,
    timeout: float = 1800.0,
    extra: tuple[str, ...] = (),
    dropout_as_cuda: bool = False,
) -> dict:
    """Op counts per layer per micro-batch (three runs, ``jobs`` at a time, one thread each
    when several run) and, with ``memory``, the last stage's peak memory of ``config``. With
    ``dropout_as_cuda`` the layers' dropout is CUDA's one op (:func:`use_cuda_dropout`)."""
    specs = count_specs(config, micro_batches, updates, extra=extra)
    for spec in specs:
        spec["dropout_as_cuda"] = dropout_as_cuda
    threads = 1 if jobs > 1 else None
    runs = _map(lambda s: spawn_child(s, timeout, threads), specs, jobs)
    res = {"config": config, **per_layer(runs), "runs": runs, "dropout_as_cuda": dropout_as_cuda}
    if memory:
        mem = spawn_child(memory_spec(config, vocab, extra), timeout)
        res["peak_mb_last_stage"] = mem["peak_bytes"] / 2**20
        res["memory_run"] = {k: v for k, v in mem.items() if k not in ("ops", "phase_ops")}
    return res


def measure(configs: list[str], compile_layers: bool = False, **options: Any) -> dict:
    """:func:`measure_config` of every config with ``options`` (its keyword arguments), with
    the machine's CPU line; with ``compile_layers``, under ``model.compile=true``."""
    from megatron_branchnorm.runner.hardware import cpu_info

    out = {
        "cpu": cpu_info().describe(),
        "torch": torch.__version__,
        "micro_batches_override": options.get("micro_batches"),
        "configs": {},
    }
    extra = ("model.compile=true",) if compile_layers else ()
    for name in configs:
        out["configs"][name] = measure_config(name, extra=extra, **options)
    return out


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def format_table(res: dict, top: int = 12) -> str:
    """The results of :func:`measure` as text: the table, then per config where a layer's
    ops, the host syncs, the device-to-host copies and the synchronize calls come from."""
    lines = [res["cpu"], ""]
    head = (
        f"{'config':<16}{'mb':>4}{'enc ops/L/mb':>14}{'dec ops/L/mb':>14}{'avg':>8}"
        f"{'syncs/mb':>10}{'syncs/update':>14}{'d2h/mb':>8}{'sync()/mb':>11}"
        f"{'peak MB (last stage)':>22}"
    )
    lines += [head, "-" * len(head)]
    for name, r in res["configs"].items():
        peak = r.get("peak_mb_last_stage")
        lines.append(
            f"{name:<16}{r['micro_batches']:>4}{r['enc_ops_per_layer_mb']:>14.1f}"
            f"{r['dec_ops_per_layer_mb']:>14.1f}{r['avg_ops_per_layer_mb']:>8.1f}"
            f"{r['host_syncs_per_mb']:>10.2f}{r['host_syncs_per_update']:>14.1f}"
            f"{r['d2h_copies_per_mb']:>8.2f}{r['sync_calls_per_mb']:>11.2f}"
            f"{'-' if peak is None else f'{peak:.0f}':>22}"
        )
    for name, r in res["configs"].items():
        lines += ["", f"## {name}: per layer per micro-batch, by pipeline instruction"]
        for side in ("enc", "dec"):
            phases = ", ".join(
                f"{k} {v:.1f}"
                for k, v in sorted(r[f"{side}_by_phase"].items(), key=lambda kv: -kv[1])
            )
            lines.append(f"{side}: {phases}")
        lines.append(f"top ops per layer per micro-batch (of {top}):")
        enc = sorted(r["enc_ops"].items(), key=lambda kv: -kv[1])[:top]
        dec = sorted(r["dec_ops"].items(), key=lambda kv: -kv[1])[:top]
        for i in range(max(len(enc), len(dec))):
            left = f"{enc[i][1]:>6.2f}  {enc[i][0]}" if i < len(enc) else ""
            right = f"{dec[i][1]:>6.2f}  {dec[i][0]}" if i < len(dec) else ""
            lines.append(f"  {left:<46}{right}")
        for what, key in (
            ("host syncs", "sync_sites_per_update"),
            ("device-to-host copies", "d2h_sites_per_update"),
            ("synchronize calls", "sync_call_sites_per_update"),
        ):
            if what == "host syncs" or r[key]:
                lines.append(f"{what} per update (2+2 layers), by caller:")
            for site, n in r[key].items():
                lines.append(f"  {n:>5.1f}  {site}")
        if "memory_run" in r:
            mem = r["memory_run"]
            lines.append(
                f"peak of the memory run (the config's width, {', '.join(mem['overrides'][3:])}): "
                f"{r['peak_mb_last_stage']:.0f} MB, live at the peak by allocating op:"
            )
            for op, nbytes in list(mem["peak_by_op"].items())[:6]:
                lines.append(f"  {nbytes / 2**20:>8.1f} MB  {op}")
    return "\n".join(lines)


COMMAND = "python -m megatron_branchnorm.experiments.launches"
"""The ``command`` of every --json report: how one of ours is recognised."""


def is_our_report(path: Path) -> bool:
    """Whether ``path`` holds a --json report of ours (its ``command`` is :data:`COMMAND`...)."""
    data = read_report(path)
    return isinstance(data, dict) and str(data.get("command", "")).startswith(COMMAND)


def main(argv: list[str] | None = None) -> int:
    """Count the ops of each config and print the table. A refused --json is one line
    ``error: ...`` and exit 2."""
    return run_main(_main, argv)


def _main(argv: list[str] | None) -> int:
    """The command line (module docstring); ``--child`` is one measured run, for
    :func:`spawn_child`."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help="shipped config names")
    p.add_argument(
        "--micro-batches",
        type=int,
        default=0,
        help="micro-batches per update of the op-count runs (0: each config's)",
    )
    p.add_argument("--updates", type=int, default=2, help="measured updates after 1 warm-up")
    p.add_argument("--vocab", type=int, default=MEMORY_VOCAB, help="vocabulary of the memory run")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory run")
    p.add_argument("--jobs", type=int, default=2, help="op-count runs at a time")
    p.add_argument(
        "--compile",
        action="store_true",
        help="count with model.compile=true (inductor's generated kernels counted as ops)",
    )
    p.add_argument(
        "--dropout-as-cuda",
        action="store_true",
        help="count CUDA's dropout (native_dropout, one op) instead of the CPU's mask",
    )
    p.add_argument("--top", type=int, default=12, help="ops shown in the per-layer breakdown")
    p.add_argument("--timeout", type=float, default=1800.0, help="per run (s)")
    p.add_argument("--json", default=None, help="also write the results here")
    # a child's spec and where it leaves its result: spawn_child's own temporary directory
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if (a.child is None) != (a.out is None):
        p.error("--child and --out go together (spawn_child's, not a user's options)")
    if a.json is not None:
        check_output_file(a.json, "--json", [], is_our_report, "a report of launches --json")
    if a.child is not None:
        res = run_child(json.loads(a.child))
        Path(a.out).write_text(json.dumps(res))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # no teardown of gloo's threads after Python (docs/design.md §3)
    configs = [c for c in a.configs.split(",") if c]
    res = measure(
        configs,
        compile_layers=a.compile,
        micro_batches=a.micro_batches or None,
        updates=a.updates,
        memory=not a.no_memory,
        vocab=a.vocab,
        jobs=a.jobs,
        timeout=a.timeout,
        dropout_as_cuda=a.dropout_as_cuda,
    )
    res["command"] = " ".join([COMMAND, *(sys.argv[1:] if argv is None else argv)])
    if a.json:
        write_text_output(a.json, json.dumps(res, indent=1))
    print(format_table(res, a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
