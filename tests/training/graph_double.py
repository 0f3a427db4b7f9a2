"""A CPU stand-in for the part of ``torch.cuda`` a capture uses (``CUDAGraph``, ``graph``,
``Stream``, ``stream``, ``current_stream``, ``graph_pool_handle``, ``get_rng_state``,
``set_rng_state``), faithful in what a caller can see of a graph.

Capturing records every ATen operator the region runs (a ``TorchDispatchMode`` sees all of
them, the backward's included) with the very tensors it read and wrote; a replay runs the
recorded operators again in order, on the same tensors, and writes each result into the tensor
the capture produced. So, as on a GPU: a replay reads whatever its static inputs hold now and
overwrites its static outputs and everything in between (saved activations included); Python
in the region does not run again; random operators draw anew; the captured tensors' addresses
never change (a replay refuses to run where one has: a GPU would read the old memory).

Memory pools, as the worst case a GPU allows. Captures into one pool (``graph(pool=)`` with a
``graph_pool_handle()``) may place what they allocate in memory an earlier capture of that pool
freed, so replaying a graph may overwrite anything a later capture of its pool allocated (torch
promises sharing a pool is safe only where graphs replay in the order they were captured). Here
every tensor a capture allocated has its own memory, and a replay instead fills with NaN every
floating tensor that a later capture of its pool allocated, before it runs: a caller that reads
a later graph's output after an earlier graph of its pool replayed reads NaN, where a GPU may
give it another graph's numbers. A capture without a pool has a pool of its own. What it does
not model: streams (one order of execution).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class _Record(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple, dict, list[torch.Tensor]]] = []
        self.addresses: dict[int, tuple[torch.Tensor, int]] = {}  # every tensor an op read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.addresses.update((id(t), (t, t.data_ptr())) for t in _tensors((args, kwargs)))
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, _tensors(out)))
        return out


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _allocated(ops: list[tuple[Any, tuple, dict, list[torch.Tensor]]]) -> list[torch.Tensor]:
    """The floating tensors ``ops`` made in memory of their own (not an operator's in-place
    result or a view of its arguments), one per storage."""
    made: dict[int, torch.Tensor] = {}
    for _func, args, kwargs, outs in ops:
        read = {_storage(t) for t in _tensors((args, kwargs))}
        for t in outs:
            if t.is_floating_point() and _storage(t) not in read:
                made.setdefault(_storage(t), t)
    return list(made.values())


def _poison(t: torch.Tensor) -> None:
    """Fill the whole storage of ``t`` with NaN."""
    whole = torch.empty(0, dtype=t.dtype)
    whole.set_(t.untyped_storage(), 0, (t.untyped_storage().nbytes() // t.element_size(),))
    whole.fill_(float("nan"))


class Pool:
    """A memory pool's token: the tensors each capture into it allocated, in capture order."""

    def __init__(self) -> None:
        self.captures: list[list[torch.Tensor]] = []


class CUDAGraph:
    """A recorded region; :meth:`replay` runs it again on the same tensors."""

    def __init__(self) -> None:
        self.ops: list[tuple[Any, tuple, dict, list[torch.Tensor]]] | None = None
        self.replays = 0
        self.pool: Pool | None = None
        self.index = 0  # its place among its pool's captures
        self.addresses: list[tuple[torch.Tensor, int]] = []  # what it read, where

    def replay(self) -> None:
        assert self.ops is not None and self.pool is not None, "replay before capture"
        for t, address in self.addresses:
            # a GPU's kernels read the captured address: a tensor since given other memory
            # (``p.data = ...``, ``set_``, a resize) would be read stale there
            assert t.data_ptr() == address, (
                f"a tensor the graph reads ({tuple(t.shape)}, {t.dtype}) moved since the capture"
            )
        for later in self.pool.captures[self.index + 1 :]:
            for t in later:
                _poison(t)
        for func, args, kwargs, outs in self.ops:
            fresh = _tensors(func(*args, **kwargs))
            for old, new in zip(outs, fresh, strict=True):
                if old is not new and old.data_ptr() != new.data_ptr():
                    old.copy_(new)
        self.replays += 1


@contextlib.contextmanager
def graph(
    cuda_graph: CUDAGraph, pool: Any = None, capture_error_mode: str = "global"
) -> Iterator[None]:
    """Capture into ``cuda_graph``, its allocations into ``pool`` (module docstring; None: a
    pool of its own); ``capture_error_mode`` is checked as torch would and has no effect."""
    assert capture_error_mode in ("global", "thread_local", "relaxed"), capture_error_mode
    assert pool is None or isinstance(pool, Pool), pool
    record = _Record()
    with record:
        yield
    cuda_graph.ops = record.ops
    cuda_graph.addresses = list(record.addresses.values())
    cuda_graph.pool = pool if pool is not None else Pool()
    cuda_graph.index = len(cuda_graph.pool.captures)
    cuda_graph.pool.captures.append(_allocated(record.ops))


def graph_pool_handle() -> Pool:
    """A new memory pool's token."""
    return Pool()


class Stream:
    def wait_stream(self, other: Stream) -> None:
        pass


_CURRENT = Stream()


def current_stream() -> Stream:
    return _CURRENT


@contextlib.contextmanager
def stream(s: Stream) -> Iterator[None]:
    yield


def get_rng_state() -> torch.Tensor:
    """The generator a replay's random operators draw from (here the CPU's)."""
    return torch.get_rng_state()


def set_rng_state(state: torch.Tensor) -> None:
    torch.set_rng_state(state)
