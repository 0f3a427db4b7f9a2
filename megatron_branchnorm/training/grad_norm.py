"""The gradient norm over all pipeline stages in fp32 mode, and the skip of an update whose
norm is not finite (DeepSpeed's bf16/fp16 optimizers compute their own norm and skip
themselves)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from megatron_branchnorm.partition import TIED_PREFIX, engine_param_to_flat_key
from megatron_branchnorm.training import collectives


class AdamW(torch.optim.AdamW):
    """AdamW that records the global gradient norm for logging in fp32 mode and skips an
    update whose norm is not finite.

    A skip leaves parameters and moments untouched and sets ``overflow``, which DeepSpeed's
    ``_take_model_step`` reads: the LR scheduler is not stepped and ``was_step_applied()`` is
    False, on every stage (the norm is reduced over all stages, so they agree).
    ``locate_fn`` names the first module with a non-finite gradient, as (stage, name).
    """

    norm_fn = None
    locate_fn = None
    pending_norm: float | None = None
    _global_grad_norm: float | None = None
    overflow = False
    nonfinite_at: tuple[int, str] | None = None

    def step(self, closure=None):
        self.overflow, self.nonfinite_at = False, None
        if self.norm_fn is not None:
            norm = self.pending_norm if self.pending_norm is not None else self.norm_fn()
            self._global_grad_norm, self.pending_norm = norm, None
            if not math.isfinite(norm):
                self.overflow = True
                self.nonfinite_at = self.locate_fn() if self.locate_fn is not None else None
                self.zero_grad(set_to_none=True)
                return None
        return super().step(closure)


def first_nonfinite_grad(module: torch.nn.Module, names: dict[int, str]) -> tuple[int, str] | None:
    """(layer-list index, flat module name) of this stage's first parameter whose gradient
    has a non-finite value, in layer order; None when all are finite."""
    found = []
    for key, p in module.named_parameters():
        if p.grad is None or bool(torch.isfinite(p.grad).all()):
            continue
        if key.startswith(TIED_PREFIX):
            found.append((0, "embedding"))
        else:
            module_name = engine_param_to_flat_key(key, names).rsplit(".", 1)[0]
            found.append((int(key.split(".", 1)[0]), module_name))
    return min(found) if found else None


def pipeline_grad_norm(module: torch.nn.Module, group) -> float:
    """L2 norm of all gradients over every pipeline stage, a tied weight counted once.

    The squares are summed on the gradients' device (one norm kernel per tensor group, no
    host sync per parameter), reduced over the stages on the communication device, and read
    once: the one host sync of the update's clipping."""
    grads = [
        p.grad.detach()
        for p in module.parameters()
        if p.grad is not None and not getattr(p, "ds_pipe_replicated", False)
    ]
    if grads:
        norms = torch.stack(torch._foreach_norm(grads)).double()  # (n,), per tensor
        sq = norms.square().sum().reshape(1)
    else:
        sq = torch.zeros(1, dtype=torch.float64)
    (total,) = collectives.to_host(collectives.all_reduce(sq, group=group))
    return math.sqrt(total)


def install_fp32_grad_norm(
    engine, module: torch.nn.Module, optimizer: AdamW, names: dict[int, str], before_norm: Callable
) -> None:
    """Give ``optimizer`` the all-stage norm and the locator of a non-finite gradient, and
    replace DeepSpeed's fp32 clipping (which counts only stage 0's gradients in a pipeline).
    ``before_norm`` runs before every norm (fault injection's hook)."""
    group = engine.grid.get_model_parallel_group()  # all stages of one replica
    stage_id = engine.stage_id

    def norm_fn() -> float:
        before_norm()
        return pipeline_grad_norm(module, group)

    def locate() -> tuple[int, str] | None:
        mine = first_nonfinite_grad(module, names)
        found = collectives.all_gather_object(mine and (mine[0], mine[1], stage_id), group)
        found = [f for f in found if f is not None]
        return (min(found)[2], min(found)[1]) if found else None

    optimizer.norm_fn, optimizer.locate_fn = norm_fn, locate

    def clip() -> None:
        norm = norm_fn()
        optimizer.pending_norm = norm
        coef = engine.gradient_clipping() / (norm + 1e-6)
        if coef < 1.0 and math.isfinite(norm):
            for p in module.parameters():
                if p.grad is not None:
                    p.grad.detach().mul_(coef)

    engine.clip_fp32_gradients = clip
