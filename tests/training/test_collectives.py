"""The project's collectives as NCCL will run them (docs/design.md §13).

On GPUs the process group is NCCL, which serves CUDA tensors only; every test here runs gloo,
which serves any tensor. So these tests fake the communication device (``meta``) and a
collective that refuses, as NCCL does, a tensor on any other device; and they check that no
module outside ``training/collectives.py`` calls torch.distributed's collectives, and that each
rank binds its GPU before the process group exists.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch

import megatron_branchnorm
from megatron_branchnorm.config import ConfigError
from megatron_branchnorm.parallel.pipeline import PipeLoss
from megatron_branchnorm.training import collectives, environment
from megatron_branchnorm.training.grad_norm import pipeline_grad_norm
from megatron_branchnorm.training.stopping import Stopper
from megatron_branchnorm.training.validation import reduce_loss_sums

PACKAGE = Path(megatron_branchnorm.__file__).parent
COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "irecv",
    "isend",
    "monitored_barrier",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
}


def _collective_calls(path: Path) -> list[str]:
    """``dist.X(...)``, ``torch.distributed.X(...)`` and ``deepspeed.comm.X(...)`` calls of a
    collective X in ``path``, as "line: name"."""
    tree = ast.parse(path.read_text(), str(path))
    aliases = {"torch.distributed", "deepspeed.comm"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name in aliases and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module in ("torch", "deepspeed"):
            for a in node.names:
                if f"{node.module}.{a.name}" in ("torch.distributed", "deepspeed.comm"):
                    aliases.add(a.asname or a.name)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = ast.unparse(node.func.value)
            if owner in aliases and node.func.attr in COLLECTIVES:
                found.append(f"{node.lineno}: {owner}.{node.func.attr}")
    return found


def test_no_module_but_collectives_calls_torch_distributed() -> None:
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "training" / "collectives.py":
            continue
        calls = _collective_calls(path)
        if calls:
            offenders[str(path.relative_to(PACKAGE))] = calls
    assert offenders == {}, "collectives outside training/collectives.py"


def test_the_scan_sees_each_way_of_calling(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        "import torch\nimport torch.distributed as dist\nfrom torch import distributed\n"
        "dist.all_reduce(t)\ntorch.distributed.barrier()\ndistributed.broadcast(t, 0)\n"
        "dist.get_rank()\n"
    )
    assert _collective_calls(src) == [
        "4: dist.all_reduce",
        "5: torch.distributed.barrier",
        "6: distributed.broadcast",
    ]


class FakeNccl:
    """torch.distributed's tensor collectives as NCCL behaves: a tensor not on the
    communication device is refused with NCCL's own message; calls are recorded."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.calls: list[tuple[str, str, tuple]] = []

    def _check(self, name: str, tensor: torch.Tensor) -> None:
        self.calls.append((name, tensor.device.type, tuple(tensor.shape)))
        if tensor.device != self.device:
            raise RuntimeError(f"No backend type associated with device type {tensor.device.type}")

    def all_reduce(self, tensor, op=None, group=None, async_op=False):  # noqa: ANN001
        self._check("all_reduce", tensor)


@pytest.fixture
def fake_nccl(monkeypatch: pytest.MonkeyPatch) -> FakeNccl:
    """The communication device faked as ``meta`` (no CUDA here): tensors that reach the
    collective on the CPU fail as they would on NCCL."""
    meta = torch.device("meta")
    fake = FakeNccl(meta)
    monkeypatch.setattr(collectives, "communication_device", lambda group=None: meta)
    monkeypatch.setattr(collectives.dist, "all_reduce", fake.all_reduce)
    monkeypatch.setattr(collectives, "to_host", lambda t: [0.0] * t.numel())
    return fake


def test_loss_sums_reach_the_collective_on_the_communication_device(fake_nccl) -> None:
    loss_fn = PipeLoss(0.1)
    logits = torch.randn(2, 3, 11)
    target = torch.tensor([[4, 5, 1], [6, 1, 1]])  # 1 is PAD
    loss_fn(logits, target)
    reduce_loss_sums(loss_fn)
    reduce_loss_sums(loss_fn)  # a stage without a loss: zeros, reduced all the same
    assert fake_nccl.calls == [("all_reduce", "meta", (3,))] * 2


def test_stop_flags_reach_the_collective_on_the_communication_device(fake_nccl) -> None:
    stopper = Stopper(world=1, max_time_minutes=0, local_error=lambda: None, elapsed=lambda: 0)
    assert stopper.check() is None
    assert fake_nccl.calls == [("all_reduce", "meta", (3,))]  # at world size 1 too


def test_grad_norm_reaches_the_collective_on_the_communication_device(fake_nccl) -> None:
    module = torch.nn.Linear(3, 2)
    module(torch.randn(4, 3)).sum().backward()
    pipeline_grad_norm(module, group=None)
    assert fake_nccl.calls == [("all_reduce", "meta", (1,))]


def test_grad_norm_is_the_norm_of_all_gradients() -> None:
    module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    module(torch.randn(4, 3)).sum().backward()
    grads = torch.cat([p.grad.reshape(-1) for p in module.parameters()]).double()
    store = torch.distributed.HashStore()
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        norm = pipeline_grad_norm(module, group=None)
    finally:
        torch.distributed.destroy_process_group()
    assert norm == pytest.approx(float(grads.norm()), rel=1e-6)


def test_all_reduce_leaves_its_input_alone() -> None:
    store = torch.distributed.HashStore()
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mine = torch.tensor([1.0, 2.0], dtype=torch.float64)
        out = collectives.all_reduce(mine)
        out.add_(1)
        assert mine.tolist() == [1.0, 2.0]
        assert collectives.to_host(collectives.all_reduce([3.0, 1.0], op="max")) == [3.0, 1.0]
        assert collectives.communication_device() == torch.device("cpu")
    finally:
        torch.distributed.destroy_process_group()


def test_communication_device_of_nccl_is_the_bound_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(collectives.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    assert collectives.communication_device() == torch.device("cuda", 5)
    monkeypatch.setattr(collectives.dist, "get_backend", lambda group=None: "gloo")
    assert collectives.communication_device() == torch.device("cpu")


@pytest.fixture
def fake_gpus(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """A node of 8 fake GPUs; records set_device and the process group's start, in order."""
    import deepspeed

    events: list[tuple] = []
    current = {"device": 0}

    def set_device(index: int) -> None:
        current["device"] = index
        events.append(("set_device", index))

    def init_distributed(dist_backend, timeout=None, **_):  # noqa: ANN001
        events.append(("init_distributed", dist_backend, current["device"]))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(deepspeed, "init_distributed", init_distributed)
    monkeypatch.setattr(environment.dist, "get_rank", lambda: 3)
    monkeypatch.setattr(environment.dist, "get_world_size", lambda: 8)
    return events


def test_each_rank_binds_its_gpu_before_the_process_group(fake_gpus, monkeypatch) -> None:
    monkeypatch.setitem(os.environ, "LOCAL_RANK", "3")
    assert environment.init_process_group(60.0) == (3, 8)
    assert fake_gpus == [("set_device", 3), ("init_distributed", "nccl", 3)]


def test_a_local_rank_without_its_gpu_is_refused(fake_gpus, monkeypatch) -> None:
    monkeypatch.setitem(os.environ, "LOCAL_RANK", "8")
    with pytest.raises(ConfigError, match="LOCAL_RANK: 8, but this process sees 8 GPU"):
        environment.init_process_group(60.0)
    assert fake_gpus == []


def test_batches_go_to_the_gpu_through_pinned_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Micro-batches reach a CUDA device by a non-blocking copy from pinned memory (a copy
    from pageable memory blocks the host); on the CPU they are left as they are."""
    from megatron_branchnorm.training.data import as_engine_items

    calls: list[tuple] = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: calls.append(("pin",)) or t)
    real_to = torch.Tensor.to

    def to(t, *args, **kwargs):  # noqa: ANN001
        calls.append(("to", str(args[0]), kwargs.get("non_blocking", False)))
        return t if str(args[0]).startswith("cuda") else real_to(t, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    batch = {k: torch.ones(2, 3, dtype=torch.long) for k in ("src_tokens", "prev_output_tokens")}
    batch["target"] = torch.ones(2, 3, dtype=torch.long)
    list(as_engine_items([batch], torch.device("cuda", 2)))
    assert calls == [("pin",), ("to", "cuda:2", True)] * 3
    calls.clear()
    list(as_engine_items([batch], torch.device("cpu")))
    assert calls == [("to", "cpu", False)] * 3
