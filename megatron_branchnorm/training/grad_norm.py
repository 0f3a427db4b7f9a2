"""The gradient norm over all pipeline stages in fp32 mode, and the skip of an update whose
norm is not finite (DeepSpeed's bf16/fp16 optimizers compute their own norm and skip
themselves)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from megatron_branchnorm.parallel.partition import TIED_PREFIX, engine_param_to_flat_key
from megatron_branchnorm.training import collectives


class SkipNonfiniteAdamW(torch.optim.AdamW):
    """torch's AdamW that skips an update whose global gradient norm is not finite, and
    records that norm for logging (fp32 mode; DeepSpeed's bf16/fp16 optimizers compute their
    own norm and skip themselves).

    Until :meth:`use_global_norm` gives it the norm it is torch's AdamW. A skip leaves
    parameters and moments untouched and sets ``overflow``, which DeepSpeed's
    ``_take_model_step`` reads: the LR scheduler is not stepped and ``was_step_applied()`` is
    False, on every stage (the norm is reduced over all stages, so they agree); ``nonfinite_at``
    then names the first module with a non-finite gradient, as (stage, name), when known.
    """

    def __init__(self, params, **adamw_kwargs) -> None:
        super().__init__(params, **adamw_kwargs)
        self._norm_fn: Callable[[], float] | None = None
        self._locate_fn: Callable[[], tuple[int, str] | None] | None = None
        self._clipped_norm: float | None = None  # this update's norm, computed by the clipping
        self._global_grad_norm: float | None = None  # read by DeepSpeed's engine
        self.overflow = False  # read by DeepSpeed's engine
        self.nonfinite_at: tuple[int, str] | None = None

    def use_global_norm(
        self,
        norm_fn: Callable[[], float],
        locate_fn: Callable[[], tuple[int, str] | None] | None = None,
    ) -> None:
        """Skip on ``norm_fn()`` (the global gradient norm) when it is not finite;
        ``locate_fn`` names the first non-finite gradient as (stage, module)."""
        self._norm_fn, self._locate_fn = norm_fn, locate_fn

    def norm_computed(self, norm: float) -> None:
        """The clipping computed this update's norm: the step uses it instead of computing
        it again."""
        self._clipped_norm = norm

    def step(self, closure=None):
        self.overflow, self.nonfinite_at = False, None
        if self._norm_fn is not None:
            norm = self._clipped_norm if self._clipped_norm is not None else self._norm_fn()
            self._global_grad_norm, self._clipped_norm = norm, None
            if not math.isfinite(norm):
                self.overflow = True
                self.nonfinite_at = self._locate_fn() if self._locate_fn is not None else None
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
    engine, module: torch.nn.Module, optimizer: SkipNonfiniteAdamW, names: dict[int, str]
) -> None:
    """Give ``optimizer`` the all-stage norm and the locator of a non-finite gradient, and
    replace DeepSpeed's fp32 clipping (which counts only stage 0's gradients in a pipeline)."""
    group = engine.grid.get_model_parallel_group()  # all stages of one replica
    stage_id = engine.stage_id

    def norm_fn() -> float:
        return pipeline_grad_norm(module, group)

    def locate() -> tuple[int, str] | None:
        mine = first_nonfinite_grad(module, names)
        found = collectives.all_gather_object(mine and (mine[0], mine[1], stage_id), group)
        found = [f for f in found if f is not None]
        return (min(found)[2], min(found)[1]) if found else None

    optimizer.use_global_norm(norm_fn, locate)

    def clip() -> None:
        norm = norm_fn()
        optimizer.norm_computed(norm)
        coef = engine.gradient_clipping() / (norm + 1e-6)
        if coef < 1.0 and math.isfinite(norm):
            for p in module.parameters():
                if p.grad is not None:
                    p.grad.detach().mul_(coef)

    engine.clip_fp32_gradients = clip
