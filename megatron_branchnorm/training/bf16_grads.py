"""One kernel per parameter tensor per micro-batch for the bf16 gradient accumulation (issue 28).

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
"""

from __future__ import annotations

import functools
import inspect

import torch

from megatron_branchnorm.pipeline import unsupported_deepspeed

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


def install_bf16_grad_accumulation(engine) -> bool:
    """Give ``engine``'s bf16 optimizer the one-kernel :func:`_update_hp_grad`; True when
    installed, False (nothing changed) when the engine does not use DeepSpeed's bf16 optimizer.

    The one kernel per parameter tensor per micro-batch needs ``bf16.immediate_grad_update:
    true`` in the DeepSpeed JSON as well (``zero1_bf16.json`` has it); without it only the cast
    kernel goes. A DeepSpeed whose bf16 optimizer lacks what this relies on is refused here
    rather than failing mid-step.
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
    for name in _NEEDED_STATE:
        if not hasattr(optimizer, name):
            raise unsupported_deepspeed(f"the BF16_Optimizer instance has no attribute {name}")
    optimizer._update_hp_grad = functools.partial(_update_hp_grad, optimizer)
    return True
