"""Every collective the project issues itself, in one place (docs/design.md §13).

DeepSpeed's own collectives (gradient all-reduce, pipeline send/recv, the tied embedding) are
DeepSpeed's; everything the trainer adds (loss sums, the stop decision, the fp32 gradient norm,
one rank's error agreed by all, the resumed early-stopping state, barriers) goes through here.

On GPUs the process group is NCCL, and torch's NCCL backend serves CUDA tensors only
(``Backend.backend_capability["nccl"] == ["cuda"]``): a CPU tensor raises "No backend type
associated with device type cpu". gloo serves both, so a CPU test cannot see the mistake. So
every tensor handed to a collective here is first put on :func:`communication_device` of its
group, and the results stay there until the caller reads them once with :func:`to_host` (one
host sync per update, not per micro-batch). No other module of the package calls
torch.distributed's collectives (tests/training/test_collectives.py checks the source).

Collectives are issued at world size 1 too: a one-GPU run then passes through the same NCCL
calls as a 32-GPU run, so a one-GPU check exercises them.

Object collectives (``all_gather_object``, ``broadcast_object_list``) pickle into tensors that
torch places on ``torch.cuda.current_device()`` under NCCL: each rank must have bound its GPU
before the first one (:func:`megatron_branchnorm.training.environment.bind_device`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def communication_device(group=None) -> torch.device:
    """The device whose tensors ``group``'s backend serves: this rank's GPU under NCCL, the
    CPU under gloo."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _on_device(values: torch.Tensor | Sequence[float], group, dtype: torch.dtype) -> torch.Tensor:
    """A new tensor holding ``values`` on ``group``'s communication device (never the
    caller's own tensor: the collectives below work in place). A pinned host tensor is copied
    without blocking the host (the caller reuses it only after the collective's stream has
    passed it: training/stopping.py's event)."""
    device = communication_device(group)
    if isinstance(values, torch.Tensor):
        pinned = values.device.type == "cpu" and device.type == "cuda" and values.is_pinned()
        return values.detach().to(device=device, dtype=dtype, copy=True, non_blocking=pinned)
    return torch.tensor(list(values), dtype=dtype, device=device)


def all_reduce(
    values: torch.Tensor | Sequence[float],
    op: str = "sum",
    group=None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """``values`` reduced (``"sum"``, ``"max"`` or ``"min"``) over ``group``, as a tensor on its
    communication device (a copy: the input is untouched). Issued at any world size."""
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    tensor = _on_device(values, group, dtype)
    dist.all_reduce(tensor, op=ops[op], group=group)
    return tensor


def to_host(tensor: torch.Tensor) -> list[float]:
    """The values of a reduced tensor on the host: the one host sync of its caller."""
    return tensor.tolist()


def all_gather_object(obj: Any, group=None) -> list[Any]:
    """Every rank's ``obj`` of ``group``, in group-rank order."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=communication_device())
    return box[0]


def barrier() -> None:
    """Wait for every rank (on NCCL, on the device bound at start-up)."""
    dist.barrier()
