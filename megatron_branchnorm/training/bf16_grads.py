"""One kernel per parameter tensor per micro-batch for the bf16 gradient accumulation.

DeepSpeed's bf16 optimizer (``deepspeed/runtime/bf16_optimizer.py``, ``BF16_Optimizer``; the
shipped ``ds_configs/zero1_bf16.json``: bf16 + ZeRO-1 + ``grad_accum_dtype`` fp32) keeps each
parameter's gradient twice: the bf16 ``param.grad`` that backward writes and a view of an fp32
flat buffer (``fp32_groups_gradients``) that the gradient norm, the clipping, the ZeRO-1
reduction (``get_grads_for_reduction``), the tied-embedding all-reduce (``param._hp_grad``, in
``PipelineEngine._exec_reduce_tied_grads``) and the step read. By default the pipeline engine
(``deepspeed/runtime/pipe/engine.py``: ``_exec_backward_pass``, and our
``pipeline._backward_once``; on the last stage ``DeepSpeedEngine.backward`` through
``BF16_Optimizer.backward_prologue`` / ``backward_epilogue``) moves it per micro-batch as:

1. ``clear_lp_grads``: ``torch._foreach_zero_`` of every bf16 grad left by the previous
   micro-batch (none in an update's first micro-batch: ``zero_grad`` sets them to None);
2. backward's ``AccumulateGrad`` adds the new gradient into the zeroed bf16 grad;
3. ``update_hp_grads`` -> ``_update_hp_grad``: ``hp_grad.add_(lp.grad.to(fp32))``, a cast kernel
   and an add kernel.

That is 4 kernels per parameter tensor in micro-batches 2.. of an update (2 in the first), at
5-10 us each on a GPU, where our layers are launch-bound; 5 on a stage that is not the last,
where step 1 runs twice (the engine's backward method calls ``clear_lp_grads`` itself, and so
does ``DeepSpeedEngine._backward_prologue``, hooked on the stage's outputs by ``forward``).

What replaces it, on one engine instance (DeepSpeed's classes are untouched):

- **DeepSpeed's own ``bf16.immediate_grad_update``**, set in the DeepSpeed JSON (which owns
  DeepSpeed's settings; ``zero1_bf16.json`` sets it). ``BF16_Optimizer.__init__`` then
  registers ``create_grad_acc_hooks``: a post-accumulate-grad hook per parameter that calls
  ``accumulate_hp_grads_and_remove_lp`` -> ``_update_hp_grad`` as soon as backward has written
  the parameter's gradient, then sets ``lp.grad = None``. The next micro-batch's backward
  therefore *writes* a fresh gradient (``AccumulateGrad`` takes the incoming tensor, no
  kernel) instead of adding into a zeroed one, ``clear_lp_grads`` finds nothing to zero, and
  ``update_hp_grads`` returns at once (both engine paths skip it under the flag). Switching
  it on after ``deepspeed.initialize`` would mean redoing part of DeepSpeed's constructor
  (``create_grad_acc_hooks``) and editing ``engine._config``, which both backward paths read,
  and the engine would then disagree with the JSON saved beside its checkpoints; so it stays
  the JSON's setting, and this module only reads it.
- **``_update_hp_grad`` replaced on the optimizer instance** by :func:`_update_hp_grad`, whose
  add is ``hp_grad.add_(lp.grad.view(hp_grad.shape))``: an in-place add with a bf16 operand
  and an fp32 result casts inside its one kernel (on CUDA, TensorIterator's dynamic cast), so
  the separate ``.to(fp32)`` kernel goes. bf16 -> fp32 is exact and the sum is the same fp32
  add, so the result is bit-identical to DeepSpeed's. Every side effect of DeepSpeed's method
  is kept: ``lp._hp_grad`` (the tied all-reduce reads it), ``fp32_groups_has_gradients`` (the
  norm reads it), the ``clear_lp_grads`` argument; with AutoEP folding configured
  (``autoep_folding_tp_group``, never by us) the call goes to DeepSpeed's own method, which
  corrects the gradient first. The hooks look the method up on the optimizer at each call, so
  the instance attribute serves them, and ``update_hp_grads`` too when the JSON leaves
  ``immediate_grad_update`` off (then steps 1-2 remain: 3 kernels instead of 4).

Result, measured by ``tests/pipeline/test_bf16_grads.py`` (aten ops at the dispatcher, per
parameter tensor per micro-batch): 1 in every micro-batch, against 2 and 4 (5) before; losses,
gradient norms and fp32 master weights are bit-identical, at 1 and 2 stages, with gradient
accumulation, activation checkpointing (non-reentrant: the recomputed forward's graph is never
walked back, so each parameter's hook fires once per backward), clipping, the tied embedding
and a checkpoint resume. Unchanged: ``zero_grad`` after each step zeroes the fp32 flat buffer
(one kernel per parameter group per update) and sets the bf16 grads to None.

Because a GPU otherwise waits on the host (docs/design.md §14), this module adds two things:

- **Multi-tensor accumulation on CUDA** (:class:`_MultiTensorAccumulation`, the default where
  the gradient buffers are on a GPU). The hook keeps the bf16 gradient instead of adding it
  (no kernel); at the end of the backward (an autograd-engine callback), or once the kept
  gradients pass :data:`BUCKET_ELEMENTS`, the gradients of consecutive parameters are
  concatenated (``torch.cat``: one kernel per up to ~128 tensors on CUDA) and added into the
  matching slice of the fp32 flat buffer (one kernel). Each element is still the one fp32 add
  of the widened bf16 value, so the result is bit-identical to the per-parameter add; launches
  per micro-batch fall from one per parameter tensor to a few per stage. The price: the bf16
  gradients of a bucket live until it is added, plus the bf16 concatenation (each at most
  :data:`BUCKET_ELEMENTS` x 2 bytes). On the CPU the per-parameter add stays (a kernel launch
  costs nothing there, and the concatenation is one more pass over the gradients); tests
  force the multi-tensor path on the CPU and check it bit-identical.
- **The step with one host sync** (:func:`_step`, replacing ``BF16_Optimizer.step`` on the
  instance). DeepSpeed 0.19.8's step reads the gradient norm on the host twice per update:
  ``is_invalid_grad_norm`` (needed: a skipped step changes what runs next) and, with
  ``gradient_clipping`` > 0, ``if clip_coef < 1`` in ``clip_tensors_by_global_norm``; and its
  norm (``get_global_norm_of_tensors``) launches one norm kernel per parameter tensor and makes
  a tensor from host data for its NaN mask (on CUDA a copy from pageable memory, which waits
  for the GPU too). Ours: the norms in one ``torch._foreach_norm`` (multi-tensor on CUDA; on
  the CPU the same per-tensor norm kernel DeepSpeed calls), the sum all-reduced over the
  pipeline stages as DeepSpeed does, the NaN mask filled with a Python -1, one host read (the
  validity check), and the clipping as one multiply of each group's flat fp32 gradient by
  ``min(1, clip / (norm + 1e-6))`` computed on the device (a multiply by exactly 1.0 when not
  clipping leaves every bit as it is). The fused AdamW, the copy into the bf16 weights and the
  clearing are DeepSpeed's own methods, called in DeepSpeed's order. Bit-identical to
  DeepSpeed's step on the CPU (tests/pipeline/test_bf16_grads.py compares the two with
  clipping that clips); on CUDA the multi-tensor norm sums in another order (float rounding).
  With MoE layers, Muon, a gradient accumulation dtype other than fp32 or AutoEP folding the
  engine keeps DeepSpeed's step.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch._utils import _flatten_dense_tensors

from megatron_branchnorm.parallel.pipeline import unsupported_deepspeed
from megatron_branchnorm.training import collectives

BUCKET_ELEMENTS = 1 << 25
"""Kept bf16 gradients (elements) after which the multi-tensor accumulation adds them without
waiting for the end of the backward: 64 MiB of bf16, plus as much for their concatenation."""

_NEEDED_METHODS = (
    "_update_hp_grad",
    "update_hp_grads",
    "accumulate_hp_grads_and_remove_lp",
    "create_grad_acc_hooks",
    "clear_lp_grads",
)
_NEEDED_STATE = (
    "fp32_groups_gradients",
    "fp32_groups_has_gradients",
    "autoep_folding_tp_group",
    "immediate_grad_update",
)
_SIGNATURE = ["self", "lp", "group_idx", "param_idx", "clear_lp_grads"]
_STEP_METHODS = (
    "get_grads_for_norm",
    "update_lp_params",
    "clear_hp_grads",
    "clear_lp_grads",
    "_lazy_init_hp_params_optimizer_state",
)
_STEP_STATE = (
    "optimizer",
    "mpu",
    "clip_grad",
    "norm_type",
    "grad_acc_dtype",
    "has_moe_layers",
    "fp32_groups_flat_partition",
    "fp32_groups_gradient_flat_partition",
    "fp32_groups_gradients_flat",
)


@torch.no_grad()
def _update_hp_grad(optimizer, lp, group_idx: int, param_idx: int, clear_lp_grads: bool) -> None:
    """DeepSpeed 0.19.8's ``BF16_Optimizer._update_hp_grad`` with the cast folded into the add
    (module docstring): ``lp.grad`` (bf16) is added into its fp32 gradient view by one kernel."""
    grad = lp.grad
    if grad is None:
        return
    if optimizer.autoep_folding_tp_group is not None:  # AutoEP folding: DeepSpeed's own path
        return type(optimizer)._update_hp_grad(optimizer, lp, group_idx, param_idx, clear_lp_grads)
    hp_grad = optimizer.fp32_groups_gradients[group_idx][param_idx]
    hp_grad.add_(grad.view(hp_grad.shape))
    lp._hp_grad = hp_grad
    optimizer.fp32_groups_has_gradients[group_idx][param_idx] = True
    if clear_lp_grads:
        grad.zero_()


class _MultiTensorAccumulation:
    """Stands in for ``BF16_Optimizer.accumulate_hp_grads_and_remove_lp`` on one optimizer
    instance (module docstring, "Multi-tensor accumulation"): keeps each parameter's bf16
    gradient and adds the kept ones into the fp32 flat buffer a run of consecutive parameters
    at a time, at the end of the backward or past ``bucket`` elements.

    Which gradients a flush holds, in which order, repeats from one backward to the next, so
    the runs are worked out once per such sequence of parameters (:meth:`_plan`) and kept
    (at most :data:`_PLANS`): a flush is then a few calls per run, where sorting the kept
    gradients and testing each pair for adjacency cost about 1 ms of Python per micro-batch
    for 12L-12L (385 tensors) on the development CPU."""

    def __init__(self, optimizer, bucket: int = BUCKET_ELEMENTS) -> None:
        self.optimizer = optimizer
        self.bucket = bucket
        self.keys: list[tuple[int, int]] = []  # (group, parameter) of each kept gradient
        self.pending: list[torch.Tensor] = []  # the kept bf16 gradients, in that order
        self.numel = 0
        self.queued = False
        self.adds = 0  # the add kernels issued so far (one per run of parameters)
        self._plans: dict[tuple, list[tuple[int, int, int, list[int]]]] = {}

    def __call__(self, lp, group_idx: int, param_idx: int) -> None:
        """A parameter's gradient is complete (its post-accumulate-grad hook): keep it."""
        opt = self.optimizer
        if opt.autoep_folding_tp_group is not None:  # AutoEP folding: DeepSpeed's own path
            type(opt).accumulate_hp_grads_and_remove_lp(opt, lp, group_idx, param_idx)
            return
        grad = lp.grad
        if grad is None:
            return
        self.keys.append((group_idx, param_idx))
        self.pending.append(grad)
        self.numel += grad.numel()
        lp._hp_grad = opt.fp32_groups_gradients[group_idx][param_idx]
        opt.fp32_groups_has_gradients[group_idx][param_idx] = True
        lp.grad = None
        if not self.queued:  # once per backward: add what is left when it ends
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self.queued = True
        if self.numel >= self.bucket:
            self.flush()

    def _end_of_backward(self) -> None:
        self.queued = False
        self.flush()

    @torch.no_grad()
    def flush(self) -> None:
        """Add every kept gradient into its fp32 slice: one concatenation and one add per run
        of parameters adjacent in the flat buffer (a single gradient: its add alone)."""
        keys, grads = tuple(self.keys), self.pending
        self.keys, self.pending, self.numel = [], [], 0
        if not keys:
            return
        plan = self._plans.get(keys)
        if plan is None:
            if len(self._plans) >= _PLANS:
                self._plans.clear()
            plan = self._plans[keys] = self._plan(keys)
        gradients = self.optimizer.fp32_groups_gradients
        for group, param, start, order in plan:
            self.adds += 1
            if len(order) == 1:
                hp_grad = gradients[group][param]
                hp_grad.add_(grads[order[0]].view(hp_grad.shape))
                continue
            run = _flatten_dense_tensors([grads[i] for i in order])  # one concatenation
            flat = self.optimizer.fp32_groups_gradients_flat[group]
            flat.narrow(0, start, run.numel()).add_(run)

    def _plan(self, keys: tuple[tuple[int, int], ...]) -> list[tuple[int, int, int, list[int]]]:
        """The runs of kept gradients ``keys``: (group, first parameter, its offset in the
        group's flat fp32 buffer, the positions in ``keys`` of the run's gradients in buffer
        order). A run continues while the next parameter's fp32 slice starts where the last
        one ends in the same group (and its gradient has the same dtype)."""
        opt = self.optimizer
        plan: list[tuple[int, int, int, list[int]]] = []
        end = None  # (group, where the last slice ends, its dtype)
        for i in sorted(range(len(keys)), key=keys.__getitem__):
            group, param = keys[i]
            hp = opt.fp32_groups_gradients[group][param]
            offset = hp.storage_offset() - opt.fp32_groups_gradients_flat[group].storage_offset()
            dtype = opt.bf16_groups[group][param].dtype
            if end == (group, offset, dtype):
                plan[-1][3].append(i)
            else:
                plan.append((group, param, offset, [i]))
            end = (group, offset + hp.numel(), dtype)
        return plan


_PLANS = 64
"""Sequences of kept gradients whose runs :class:`_MultiTensorAccumulation` keeps (one per
flush point of a backward: the end, and each bucket cut)."""


def _global_grad_norm(grads: list[torch.Tensor], norm_type: float, mpu) -> torch.Tensor:
    """DeepSpeed's ``get_global_norm_of_tensors`` for a p-norm, without its per-tensor loop and
    its tensor made from host data: the norm of all stages' fp32 gradients as a 0-dim fp32
    tensor on their device, -1 where it is not finite."""
    if grads:
        total = torch.stack(torch._foreach_norm(grads, norm_type)).pow(norm_type).sum()
    else:
        total = torch.zeros((), dtype=torch.float32)
    if mpu is not None:  # every stage of the replica, as DeepSpeed sums it
        group = mpu.get_model_parallel_group()
        total = collectives.all_reduce(total, group=group, dtype=torch.float32)
    norm = total.pow(1.0 / norm_type)
    return norm.masked_fill_(~torch.isfinite(norm), -1.0)


@torch.no_grad()
def _step(optimizer, closure=None) -> None:
    """``BF16_Optimizer.step`` with one host read of the gradient norm (module docstring, "The
    step with one host sync"); DeepSpeed's own methods do the rest, in its order."""
    from deepspeed.runtime.utils import is_invalid_grad_norm

    if closure is not None:  # DeepSpeed's step refuses it: let it say so
        return type(optimizer).step(optimizer, closure)
    optimizer.overflow = False
    grads, _experts = optimizer.get_grads_for_norm()
    norm = _global_grad_norm(grads, float(optimizer.norm_type), optimizer.mpu)
    optimizer._global_grad_norm = norm
    if is_invalid_grad_norm(norm):  # the update's one host sync
        optimizer.overflow = True
        optimizer._global_grad_norm = float("inf")
        optimizer.clear_hp_grads()
        optimizer.clear_lp_grads()
        return
    if optimizer.clip_grad > 0.0:
        coef = (optimizer.clip_grad / (norm + 1e-6)).clamp_(max=1.0)  # DeepSpeed's, on device
        torch._foreach_mul_(optimizer.fp32_groups_gradients_flat, coef)
    for param, grad in zip(
        optimizer.fp32_groups_flat_partition,
        optimizer.fp32_groups_gradient_flat_partition,
        strict=True,
    ):
        param.grad = grad
    optimizer.optimizer.step()
    optimizer._lazy_init_hp_params_optimizer_state()
    optimizer.update_lp_params()
    optimizer.clear_hp_grads()


def _own_step_applies(optimizer) -> bool:
    """Whether :func:`_step` does what DeepSpeed's step does for this optimizer: an L2 norm,
    fp32 gradients, no MoE, no Muon, no AutoEP folding."""
    return (
        float(optimizer.norm_type) == 2.0
        and optimizer.grad_acc_dtype == torch.float32
        and not optimizer.has_moe_layers
        and not getattr(optimizer, "_uses_muon", False)
        and optimizer.autoep_folding_tp_group is None
    )


def install_bf16_grad_accumulation(engine, multi_tensor: bool | None = None) -> bool:
    """Give ``engine``'s bf16 optimizer the one-kernel :func:`_update_hp_grad`, on CUDA (or
    with ``multi_tensor``) the multi-tensor accumulation, and the step with one host sync
    (module docstring); True when installed, False (nothing changed) when the engine does not
    use DeepSpeed's bf16 optimizer.

    The one kernel per parameter tensor per micro-batch, and the multi-tensor accumulation,
    need ``bf16.immediate_grad_update: true`` in the DeepSpeed JSON as well
    (``zero1_bf16.json`` has it); without it only the cast kernel goes. A DeepSpeed whose bf16
    optimizer lacks what this relies on is refused here rather than failing mid-step.
    """
    try:
        from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    except ImportError as exc:
        raise unsupported_deepspeed(
            f"deepspeed.runtime.bf16_optimizer.BF16_Optimizer: {exc}"
        ) from None
    optimizer = getattr(engine, "optimizer", None)
    if not isinstance(optimizer, BF16_Optimizer):
        return False
    for name in _NEEDED_METHODS:
        if not callable(getattr(BF16_Optimizer, name, None)):
            raise unsupported_deepspeed(f"BF16_Optimizer.{name} is missing")
    params = list(inspect.signature(BF16_Optimizer._update_hp_grad).parameters)
    if params != _SIGNATURE:
        raise unsupported_deepspeed(
            f"BF16_Optimizer._update_hp_grad{tuple(params)} is not {tuple(_SIGNATURE)}"
        )
    for name in _STEP_METHODS:
        if not callable(getattr(BF16_Optimizer, name, None)):
            raise unsupported_deepspeed(f"BF16_Optimizer.{name} is missing")
    for name in _NEEDED_STATE + _STEP_STATE:
        if not hasattr(optimizer, name):
            raise unsupported_deepspeed(f"the BF16_Optimizer instance has no attribute {name}")
    optimizer._update_hp_grad = functools.partial(_update_hp_grad, optimizer)
    if multi_tensor is None:
        multi_tensor = any(flat.is_cuda for flat in optimizer.fp32_groups_gradients_flat)
    if multi_tensor and optimizer.immediate_grad_update:
        optimizer.accumulate_hp_grads_and_remove_lp = _MultiTensorAccumulation(optimizer)
    if _own_step_applies(optimizer):
        optimizer.step = functools.partial(_step, optimizer)
    return True
