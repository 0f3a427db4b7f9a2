"""A CPU stand-in for the part of ``torch.cuda`` a capture uses (``CUDAGraph``, ``graph``,
``Stream``, ``stream``, ``current_stream``, ``graph_pool_handle``, ``get_rng_state``,
``set_rng_state``), faithful in what a caller can see of a graph.

Capturing records every ATen operator the region runs (a ``TorchDispatchMode`` sees all of
them, the backward's included) with the very tensors it read and wrote; a replay runs the
recorded operators again in order, on the same tensors, and writes each result into the tensor
the capture produced. So, as on a GPU: a replay reads whatever its static inputs hold now and
overwrites its static outputs and everything in between (saved activations included); Python
in the region does not run again; random operators draw anew; the captured tensors' addresses
never change. What it does not model: memory pools (every captured tensor is its own memory
here) and streams (one order of execution).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class _Record(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple, dict, list[torch.Tensor]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self.ops.append((func, args, kwargs, outs))
        return out


class CUDAGraph:
    """A recorded region; :meth:`replay` runs it again on the same tensors."""

    def __init__(self) -> None:
        self.ops: list[tuple[Any, tuple, dict, list[torch.Tensor]]] | None = None
        self.replays = 0

    def replay(self) -> None:
        assert self.ops is not None, "replay before capture"
        for func, args, kwargs, outs in self.ops:
            fresh = [
                t for t in tree_flatten(func(*args, **kwargs))[0] if isinstance(t, torch.Tensor)
            ]
            for old, new in zip(outs, fresh, strict=True):
                if old is not new and old.data_ptr() != new.data_ptr():
                    old.copy_(new)
        self.replays += 1


@contextlib.contextmanager
def graph(
    cuda_graph: CUDAGraph, pool: Any = None, capture_error_mode: str = "global"
) -> Iterator[None]:
    """Capture into ``cuda_graph`` (``pool`` and ``capture_error_mode`` are checked as torch
    would and, here, have no effect)."""
    assert capture_error_mode in ("global", "thread_local", "relaxed"), capture_error_mode
    record = _Record()
    with record:
        yield
    cuda_graph.ops = record.ops


def graph_pool_handle() -> None:
    """A memory pool's token (pools have no effect here)."""
    return None


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
