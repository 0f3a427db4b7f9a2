"""Host syncs and CUDA-graph capture safety, seen from the dispatcher on a CPU.

A CUDA graph replays the kernels it captured: inside the captured region nothing may wait for
the GPU (a host sync is illegal while capturing), copy between the host and the device (a
copy from pageable memory syncs; a device-to-host read returns what the capture saw, not the
replay's value), allocate by a size read from the data (the graph's memory is fixed), or
depend on a Python value that changes between replays (a Python float argument is baked into
the kernel: BranchNorm's alpha_t must be a device tensor). Each replay must also run the same
ops on the same shapes. ../shared/DESIGN.md §11-§12 say why the GPU needs this and why a CPU
test cannot see most of it unless it looks for it: this module looks, on any device.

- :class:`HostSyncCounter` (a ``TorchDispatchMode``) counts the host syncs of what runs
  inside it, each with the caller that caused it: the aten ops that make the host wait
  (``_local_scalar_dense``, which ``float(t)``, ``int(t)``, ``bool(t)`` and ``.item()``
  dispatch; ``nonzero``, ``equal`` and the other ops tagged ``data_dependent_output`` or
  ``dynamic_output_shape``) and the Tensor methods that read values on the host without any
  aten op on a CPU tensor (``tolist``, ``numpy``, ``cpu``, ``__array__``: on a GPU each is a
  device-to-host copy and a sync). ``trainer_syncs_per_update`` (tests/training/test_perf_paths.py)
  uses it around DeepSpeed's ``train_batch``.
- :class:`CaptureAudit` also records every aten op with its tensor shapes and dtypes and its
  non-tensor arguments, and collects what a capture forbids: host syncs, copies between
  devices (and tensors made from host data, ``torch.tensor``'s ``lift_fresh``, which on a GPU
  is a copy from pageable host memory), and ops whose output size depends on the data.
  :func:`replay_difference` compares two recordings of the same region (two batches of one
  bucket shape, two values of alpha_t) and names the first op that differs.

What the CPU still cannot show: which kernels an op launches, device-to-host copies spelt
``.to("cpu")`` (a no-op on a CPU tensor, no aten op), the RNG state a graph must register
(CUDA's dropout draws from a Philox offset that ``torch.cuda.graph`` tracks), and NCCL.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron_branchnorm.experiments.launches import call_site, copy_devices, is_host_sync

HOST_READ_METHODS = ("tolist", "numpy", "cpu", "__array__")
"""Tensor methods that read a tensor's values on the host. On a CPU tensor they dispatch no
aten op, so a dispatch mode alone misses them; on a GPU each waits for the device."""

HOST_DATA_OPS = frozenset({"lift_fresh", "lift_fresh_copy"})
"""What ``torch.tensor(data, device=...)`` dispatches: a tensor made from host data, on a GPU a
host-to-device copy from pageable memory (which syncs, and which a capture forbids)."""

_MISSING = object()


def _site(skip: str = __file__) -> str:
    """``file:line function`` of the innermost caller in megatron_branchnorm, deepspeed or the
    tests (not this module, not torch); ``?`` when there is none."""
    return call_site(skip, ("megatron_branchnorm", "deepspeed", "tests"))


def syncs_host(func: Any) -> bool:
    """True for an aten op that makes the host wait for the device: launches.py's list
    (``_local_scalar_dense``, ``nonzero``, ``equal``, ``unique*``...) and every op torch tags
    ``data_dependent_output`` or ``dynamic_output_shape``."""
    tags = getattr(func, "tags", ())
    return (
        is_host_sync(func)
        or torch.Tag.data_dependent_output in tags
        or torch.Tag.dynamic_output_shape in tags
    )


class HostSyncCounter(TorchDispatchMode):
    """While active, counts host syncs (module docstring) by kind and by caller.

    The Tensor methods of :data:`HOST_READ_METHODS` are wrapped on ``torch.Tensor`` while the
    counter is active (every thread sees the wrapper; only calls made while the counter is
    active count); an aten op dispatched inside such a method is not counted again."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: Counter[str] = Counter()
        """Host syncs by op or method name."""
        self.sites: Counter[str] = Counter()
        """Host syncs by the caller that caused them (``file:line function``)."""
        self._in_method = 0
        self._saved: dict[str, Any] = {}

    @property
    def host_syncs(self) -> int:
        """All host syncs counted so far."""
        return sum(self.syncs.values())

    def record_sync(self, name: str) -> None:
        """Count one host sync caused by ``name`` at the current caller."""
        self.syncs[name] += 1
        self.sites[_site()] += 1

    def __enter__(self) -> HostSyncCounter:
        for name in HOST_READ_METHODS:
            self._saved[name] = torch.Tensor.__dict__.get(name, _MISSING)
            setattr(torch.Tensor, name, self._wrapped(name, getattr(torch.Tensor, name)))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            for name, saved in self._saved.items():
                if saved is _MISSING:
                    delattr(torch.Tensor, name)
                else:
                    setattr(torch.Tensor, name, saved)
            self._saved.clear()

    def _wrapped(self, name: str, method: Callable) -> Callable:
        counter = self

        def read_on_host(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            counter.record_sync(f"Tensor.{name}")
            counter._in_method += 1
            try:
                return method(tensor, *args, **kwargs)
            finally:
                counter._in_method -= 1

        return read_on_host

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        """Run ``func``; count it when it syncs (the mode is off while it runs)."""
        out = func(*args, **(kwargs or {}))
        self.observe(func, args, kwargs or {}, out)
        return out

    def observe(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Account for one dispatched op (subclasses record more)."""
        if not self._in_method and syncs_host(func):
            self.record_sync(func._overloadpacket.__name__)


def _describe(value: Any) -> Any:
    """A hashable, comparable stand-in for one leaf of an op's arguments or outputs: a tensor
    by (shape, dtype, device type), a plain value as itself, anything else by its type."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), str(value.dtype).removeprefix("torch."), value.device.type)
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return value
    if isinstance(value, (torch.device, torch.memory_format, torch.layout)):
        return str(value)
    return type(value).__name__


@dataclasses.dataclass(frozen=True)
class OpCall:
    """One dispatched aten op: its name, its arguments' and outputs' descriptions
    (:func:`_describe`), and the caller that dispatched it."""

    op: str
    inputs: tuple
    outputs: tuple
    site: str

    def signature(self) -> tuple:
        """What must be the same on every replay of a captured region."""
        return (self.op, self.inputs, self.outputs)


@dataclasses.dataclass(frozen=True)
class Finding:
    """Something a CUDA graph cannot capture: ``kind`` (host sync, device-to-host copy,
    host-to-device copy, data-dependent size), the op or method, and its caller."""

    kind: str
    op: str
    site: str

    def line(self) -> str:
        return f"{self.kind}: {self.op} at {self.site}"


class CaptureAudit(HostSyncCounter):
    """:class:`HostSyncCounter` that also records every aten op (:attr:`calls`) and what a
    capture forbids (:attr:`findings`)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[OpCall] = []
        self.findings: list[Finding] = []

    def record_sync(self, name: str) -> None:
        super().record_sync(name)
        self.findings.append(Finding("host sync", name, _site()))

    def observe(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        name = func._overloadpacket.__name__
        site = _site()
        inputs = tuple(_describe(v) for v in tree_leaves((args, kwargs)))
        outputs = tuple(_describe(v) for v in tree_leaves(out))
        self.calls.append(OpCall(str(func), inputs, outputs, site))
        if torch.Tag.dynamic_output_shape in getattr(func, "tags", ()):
            self.findings.append(Finding("data-dependent size", str(func), site))
        devices = copy_devices(func, args, kwargs)
        if name in HOST_DATA_OPS:
            self.findings.append(Finding("host-to-device copy", str(func), site))
        elif devices is not None and devices[0] != devices[1]:
            kind = "device-to-host copy" if devices[1] == "cpu" else "host-to-device copy"
            self.findings.append(Finding(kind, str(func), site))
        super().observe(func, args, kwargs, out)

    def op_counts(self) -> Counter[str]:
        """The recorded ops by name."""
        return Counter(c.op for c in self.calls)


def replay_difference(first: CaptureAudit, second: CaptureAudit) -> str | None:
    """None when two recordings of a region ran the same ops on the same shapes with the same
    non-tensor arguments; else one line naming the first op that differs and its caller."""
    for i, (a, b) in enumerate(zip(first.calls, second.calls, strict=False)):
        if a.signature() != b.signature():
            return (
                f"op {i} differs between replays: {a.op}{a.inputs} -> {a.outputs} at {a.site}, "
                f"then {b.op}{b.inputs} -> {b.outputs} at {b.site}"
            )
    if len(first.calls) != len(second.calls):
        return f"the replays ran {len(first.calls)} and {len(second.calls)} ops"
    return None


@contextmanager
def audited() -> Iterator[CaptureAudit]:
    """``with audited() as audit:`` records the region inside it."""
    with CaptureAudit() as audit:
        yield audit
