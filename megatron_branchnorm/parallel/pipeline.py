"""The encoder-decoder as a DeepSpeed PipelineModule, built from the flat model's layer classes.

What crosses a stage boundary (docs/design.md §1: every float tensor received gets
requires_grad and must get a gradient back; ids and masks travel as integer tensors):

    embed, enc_i, enc_final:   (x_enc (B,S,C) float, src_tokens (B,S) long, prev_tokens (B,T) long)
    dec_embed, dec_j (j < M):  (x_dec (B,T,C) float, memory (B,S,C) float, src_tokens long)
    dec_M, dec_final:          x_dec (B,T,C)   (memory dropped where its last user is)
    output:                    logits (B,T,V) -> loss_fn(logits, target)

The encoder output (memory) travels through every decoder stage and collects gradient from
each cross-attention. The padding mask is rebuilt from src_tokens once per micro-batch on each
stage (:class:`StageBias`). BranchNorm's alpha_t is set on each stage's residual blocks before
every update (:func:`megatron_branchnorm.model.residual.set_branch_scale`: a 0-dim tensor on
the stage's device, filled in place), never a tensor that crosses stages.

Shapes (docs/design.md §18): the trainer builds the module with ``dynamic_shape=False`` and
pads every micro-batch to one of a few bucket shapes; :func:`fixed_shapes` tells each stage the
bucket of every micro-batch of an update, so a stage sends DeepSpeed's shape metadata only the
first time it sends a bucket and reuses the receive buffers of a bucket it has seen (no
metadata, no host read of it, per micro-batch). Without buckets (validation, or
``data.bucket_shapes=0``) the metadata goes with every micro-batch, as ``dynamic_shape=True``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import types
from collections.abc import Iterator

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import TRAIN_BATCH_TIMER, PipelineEngine
from deepspeed.utils.timer import SynchronizedWallClockTimer
from torch import nn

from megatron_branchnorm.config import ModelConfig
from megatron_branchnorm.model.attention import padding_bias
from megatron_branchnorm.model.compile import layer_body
from megatron_branchnorm.model.embedding import Embed, TokenEmbedding, output_logits
from megatron_branchnorm.model.layers import DecoderLayer, EncoderLayer
from megatron_branchnorm.model.loss import label_smoothed_nll_loss
from megatron_branchnorm.model.residual import stack_constants, stack_final_norm
from megatron_branchnorm.parallel.partition import TIED_KEY, spec_entries
from megatron_branchnorm.tokens import PAD_ID


class SharedEmbeddingPipe(nn.Module):
    """The tied embedding: encoder input here (forward), decoder input and output projection
    through ``decoder_embed_fn`` / ``output_fn`` on the stages that hold those entries."""

    def __init__(self, cfg: ModelConfig, seed: int) -> None:
        super().__init__()
        self.embedding = TokenEmbedding(cfg, seed)
        self.encoder_embed = Embed(cfg)
        self.decoder_embed = Embed(cfg)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        src_tokens, prev_tokens = inputs
        return self.encoder_embed(src_tokens, self.embedding.weight), src_tokens, prev_tokens


def decoder_embed_fn(module: SharedEmbeddingPipe, inputs: tuple[torch.Tensor, ...]):
    """(memory, src, prev) -> (x_dec, memory, src)."""
    memory, src_tokens, prev_tokens = inputs
    return module.decoder_embed(prev_tokens, module.embedding.weight), memory, src_tokens


def output_fn(module: SharedEmbeddingPipe, x: torch.Tensor) -> torch.Tensor:
    """x_dec (B, T, C) -> logits (B, T, V) through the shared matrix."""
    return output_logits(x, module.embedding.weight)


class StageBias:
    """The attention padding bias of this stage's current micro-batch, built once and read by
    every encoder self-attention and decoder cross-attention of the stage (a process runs one
    stage). Keyed by the ids tensor itself: every layer of a stage receives the same
    ``src_tokens`` object, a new micro-batch brings a new one, and a recomputed forward
    (activation checkpointing) that hands back an earlier one rebuilds it."""

    _src: torch.Tensor | None = None
    _bias: torch.Tensor | None = None

    @classmethod
    def get(cls, src_tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(B, 1, 1, S) bias in ``dtype`` for ``src_tokens`` (B, S)."""
        if cls._src is not src_tokens or cls._bias.dtype != dtype:
            cls._src, cls._bias = src_tokens, padding_bias(src_tokens, PAD_ID, dtype)
        return cls._bias

    @classmethod
    def clear(cls) -> None:
        """Forget the cached bias: the next :meth:`get` builds it (at the start of a region a
        CUDA graph captures, so the capture computes it from the graph's ids buffer)."""
        cls._src = cls._bias = None


class EncoderLayerPipe(EncoderLayer):
    """An EncoderLayer on the (x, src, prev) tuple; same parameter names as EncoderLayer.
    Its body is EncoderLayer.forward, compiled with ``model.compile`` (model/compile.py)."""

    def __init__(
        self, cfg: ModelConfig, deepnorm_alpha: float, beta: float, seed: int, index: int
    ) -> None:
        super().__init__(cfg, deepnorm_alpha, beta, seed, index)
        self.body = layer_body(EncoderLayer.forward, cfg.compile)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x, src_tokens, prev_tokens = inputs
        return self.body(self, x, StageBias.get(src_tokens, x.dtype)), src_tokens, prev_tokens


class FinalNormPipe(nn.Module):
    """A stack's final norm (Pre-LN) or identity, on the first tensor of the tuple."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = stack_final_norm(
            cfg.residual, cfg.hidden_size, cfg.layernorm_eps, cfg.layernorm_impl
        )

    def forward(self, inputs):
        if isinstance(inputs, tuple):
            return (self.norm(inputs[0]), *inputs[1:])
        return self.norm(inputs)


class DecoderLayerPipe(DecoderLayer):
    """A DecoderLayer on (x, memory, src); the last one returns x alone, so memory's gradient
    is complete on the stage of its last user. Its body is DecoderLayer.forward, compiled with
    ``model.compile`` (model/compile.py)."""

    def __init__(
        self, cfg: ModelConfig, deepnorm_alpha: float, beta: float, seed: int, index: int
    ) -> None:
        super().__init__(cfg, deepnorm_alpha, beta, seed, index)
        self.is_last = index == cfg.decoder_layers - 1
        self.body = layer_body(DecoderLayer.forward, cfg.compile)

    def forward(self, inputs: tuple[torch.Tensor, ...]):
        x, memory, src_tokens = inputs
        x = self.body(self, x, memory, StageBias.get(src_tokens, x.dtype))
        return x if self.is_last else (x, memory, src_tokens)


CHECKPOINTABLE = ["EncoderLayerPipe", "DecoderLayerPipe"]


def _shared_embedding(cfg: ModelConfig, seed: int, forward_fn=None) -> TiedLayerSpec:
    """An entry holding the tied embedding; ``forward_fn`` picks its role (None: the encoder
    input, :func:`decoder_embed_fn`, :func:`output_fn`)."""
    return TiedLayerSpec(
        TIED_KEY,
        SharedEmbeddingPipe,
        cfg,
        seed,
        forward_fn=forward_fn,
        tied_weight_attr=["embedding.weight"],
    )


def layer_specs(cfg: ModelConfig, seed: int) -> list:
    """The DeepSpeed layer list; each entry is built only on the stage that owns it."""
    (a_enc, b_enc), (a_dec, b_dec) = stack_constants(cfg)
    specs = []
    for entry in spec_entries(cfg):
        if entry.kind == "embed":
            specs.append(_shared_embedding(cfg, seed))
        elif entry.kind == "enc":
            specs.append(LayerSpec(EncoderLayerPipe, cfg, a_enc, b_enc, seed, entry.layer))
        elif entry.kind in ("enc_final", "dec_final"):
            specs.append(LayerSpec(FinalNormPipe, cfg))
        elif entry.kind == "dec_embed":
            specs.append(_shared_embedding(cfg, seed, decoder_embed_fn))
        elif entry.kind == "dec":
            specs.append(LayerSpec(DecoderLayerPipe, cfg, a_dec, b_dec, seed, entry.layer))
        else:  # output
            specs.append(_shared_embedding(cfg, seed, output_fn))
    return specs


class PipeLoss:
    """Label-smoothed CE on the last stage, normalised per target token of the whole update.

    DeepSpeed averages the returned loss over micro-batches (1/gas) and data-parallel ranks
    (1/dp); we return ``loss_sum * scale`` with ``scale = gas * dp / N`` (N the non-pad
    target tokens of the update across all micro-batches and ranks), so the gradient is that
    of sum(loss) / N. The sums for logging stay on the logits' device (:meth:`sums`): no
    host sync per micro-batch; the trainer reads them once per update.

    Validation records instead one row of sums per call (:meth:`start_recording`): DeepSpeed
    calls the loss once per micro-batch on the last stage, in order, so row i is micro-batch
    i's, and the validator sums them per translation direction on the device.
    """

    def __init__(self, label_smoothing: float) -> None:
        self.label_smoothing = label_smoothing
        self.scale = 1.0
        self._records: list[torch.Tensor] | None = None
        self.reset()

    def reset(self) -> None:
        """Clear the accumulated sums."""
        self._sums: torch.Tensor | None = None  # (loss, nll, tokens), float64, on the device

    def sums(self, device: torch.device | None = None) -> torch.Tensor:
        """(loss sum, NLL sum, target tokens) since :meth:`reset`, float64 (zeros, made on
        ``device``, on a stage that computed no loss)."""
        if self._sums is not None:
            return self._sums
        return torch.zeros(3, dtype=torch.float64, device=device)

    def start_recording(self) -> None:
        """From now on keep each call's (loss, NLL, tokens) sums as a row of its own, in call
        order, instead of adding them to :meth:`sums`."""
        self._records = []

    def stop_recording(self) -> torch.Tensor | None:
        """The rows recorded since :meth:`start_recording`, (calls, 3) float64 on the logits'
        device (None when there was no call: a stage without the loss); recording stops."""
        records, self._records = self._records, None
        return torch.stack(records) if records else None

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss, nll, ntok = label_smoothed_nll_loss(logits, target, self.label_smoothing)
        sums = torch.stack([loss.detach(), nll.detach(), ntok.to(loss.dtype)]).double()
        if self._records is not None:
            self._records.append(sums)
        else:
            self._sums = sums if self._sums is None else self._sums.add_(sums)
        return loss * self.scale


class EncDecPipelineModule(PipelineModule):
    """PipelineModule with stage boundaries computed by us (partition.partition_plan).

    DeepSpeed offers only 'uniform', 'parameters' (builds every layer on every rank: unusable
    at 1000 layers) and 'type:regex'; we override its private ``_partition_layers`` to hand
    it our boundaries. Pinned to deepspeed>=0.19.8,<0.20 in setup.py for that reason.
    """

    def __init__(self, layers: list, parts: list[int], **kwargs) -> None:
        self._plan = list(parts)
        super().__init__(layers, partition_method="plan", **kwargs)

    def _partition_layers(self, method: str = "plan") -> None:
        if len(self._plan) != self.num_stages + 1 or self._plan[-1] != len(self._layer_specs):
            raise ValueError(
                f"partition plan {self._plan} does not fit {self.num_stages} stages of "
                f"{len(self._layer_specs)} layers"
            )
        self.parts = list(self._plan)
        stage_id = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])

    def _synchronize_tied_weights(self) -> None:
        """DeepSpeed's copy of the tied embedding from its first stage to the others (at
        construction and after a checkpoint load), without autograd.

        DeepSpeed 0.19.8 broadcasts the Parameter itself with grad enabled. ``broadcast_`` has
        no autograd kernel, so torch's fallback hooks the in-place write on the parameter and
        warns at every backward that reaches the embedding ("c10d::broadcast_: an autograd
        kernel was not registered ... silently incorrect behavior", on every stage holding
        it). The hook passes the gradient through unchanged, which is right for a copy of
        values (tests/pipeline/test_pipeline.py checks the embedding's gradient against the
        flat model's either way); the copy needs no autograd, so it is done under no_grad.
        """
        with torch.no_grad():
            super()._synchronize_tied_weights()


def build_pipeline_module(
    cfg: ModelConfig,
    parts: list[int],
    seed: int,
    loss_fn: PipeLoss,
    activation_checkpoint_interval: int = 0,
    dynamic_shape: bool = True,
) -> EncDecPipelineModule:
    """This rank's stage of the pipeline model (only its own layers are built).

    Activation checkpointing (non-reentrant, so the embedding keeps its gradient) applies to
    encoder/decoder layers only, every ``activation_checkpoint_interval`` layers.
    """
    return EncDecPipelineModule(
        layer_specs(cfg, seed),
        parts,
        num_stages=len(parts) - 1,
        loss_fn=loss_fn,
        activation_checkpoint_interval=activation_checkpoint_interval,
        activation_checkpoint_func=functools.partial(
            torch.utils.checkpoint.checkpoint, use_reentrant=False
        ),
        checkpointable_layers=CHECKPOINTABLE,
        dynamic_shape=dynamic_shape,
    )


_DS_BACKWARD = PipelineEngine._INSTRUCTION_MAP[schedule.BackwardPass]


def _backward_once(engine: PipelineEngine, buffer_id: int) -> None:
    """A non-last stage's backward pass as ONE autograd call over all its float outputs.

    DeepSpeed 0.19.8's ``_exec_backward_pass`` calls ``out.backward(grad, retain_graph=True)``
    once per float output. Our boundary carries (x_dec, memory) past the stage where the
    decoder starts, and x_dec depends on memory: the second call walked back through the
    whole encoder (and embedding) a second time. That stage's backward took 2.7x its forward
    instead of 1.4x, and the 2-stage pipeline ran at 61-70% of its bubble-limited ideal
    (docs/performance.md). ``torch.autograd.backward`` over the tuple accumulates the same
    gradients in one walk. The other cases (last stage, partitioned activations, a single
    output) go to DeepSpeed's own method.
    """
    outputs = engine.pipe_buffers["outputs"][buffer_id]
    if (
        engine.is_last_stage()
        or engine.is_pipe_partitioned
        or engine.is_grad_partitioned
        or not isinstance(outputs, tuple)
    ):
        return _DS_BACKWARD(engine, buffer_id)
    out_tensors = [t for t in outputs if t.is_floating_point()]
    grad_tensors = list(engine.grad_layer)
    if len(out_tensors) != len(grad_tensors):
        raise RuntimeError(
            f"stage {engine.stage_id}: {len(out_tensors)} float outputs but "
            f"{len(grad_tensors)} gradients received"
        )
    bf16 = engine.using_bf16_optimizer
    if bf16:  # as DeepSpeed's method: it does not call optimizer.backward() here
        engine.optimizer.clear_lp_grads()
    engine._running_engine_backward = True  # DeepSpeed's post-backward hook checks it
    try:
        torch.autograd.backward(out_tensors, grad_tensors=grad_tensors)
    finally:
        engine._running_engine_backward = False
    if bf16 and not engine._config.bfloat16_config.immediate_grad_update:
        engine.optimizer.update_hp_grads(clear_lp_grads=False)
    engine.pipe_buffers["output_tensors"][buffer_id] = None
    engine.pipe_buffers["outputs"][buffer_id] = None


def install_backward_once(engine: PipelineEngine) -> None:
    """Make ``engine`` run :func:`_backward_once` for its BackwardPass instructions.

    ``_exec_schedule`` looks instructions up in ``self._INSTRUCTION_MAP``: an instance copy
    with one entry replaced changes this engine only, not DeepSpeed's class.
    """
    engine._INSTRUCTION_MAP = {
        **type(engine)._INSTRUCTION_MAP,
        schedule.BackwardPass: _backward_once,
    }


def remember_mode(module: nn.Module) -> None:
    """Make ``module.train(mode)`` (and ``eval()``) walk the module tree only when the mode
    changes. DeepSpeed's ``train_batch`` calls ``self.module.train()`` once per update, and
    the walk sets ``training`` on every submodule through ``nn.Module.__setattr__``: 0.7 ms
    per update for 12L-12L, 3.5 ms for a stage of 62 + 62 layers, measured on the development
    CPU, host time the GPU idles through after each update's host sync. The stage's
    submodules change mode only through the stage (validation's ``eval_batch`` included); a
    mode set on the stage itself by ``nn.Module.train`` directly is seen (``module.training``)
    and walked again. A bound method, so a deep copy of the stage gets its own."""
    module.train = types.MethodType(_train_when_changed, module)  # eval() calls it too


def _train_when_changed(module: nn.Module, mode: bool = True) -> nn.Module:
    """:func:`remember_mode`'s ``train``: the class's walk when ``mode`` is new."""
    if module.__dict__.get("_mbn_mode") != mode or module.training != mode:
        type(module).train(module, mode)
        module.__dict__["_mbn_mode"] = mode
    return module


_DS_SEND_ACTIVATIONS = PipelineEngine._INSTRUCTION_MAP[schedule.SendActivation]
_DS_RECV_ACTIVATIONS = PipelineEngine._INSTRUCTION_MAP[schedule.RecvActivation]
_DS_RECV_GRADS = PipelineEngine._INSTRUCTION_MAP[schedule.RecvGrad]


class _ShapeSchedule:
    """One engine's fixed-shape state: the bucket of each micro-batch of the running
    ``train_batch`` (None: shapes travel with every micro-batch), and per bucket the shapes
    this stage sent first and the receive buffers' shapes it was first told."""

    def __init__(self) -> None:
        self.keys: list[int] | None = None
        self.sends = self.recvs = 0
        self.sent: dict[int, tuple] = {}
        self.received: dict[int, tuple[bool, tuple]] = {}

    def next_key(self, kind: str) -> int:
        """The bucket of the next micro-batch this stage sends or receives (they go in
        micro-batch order in both of DeepSpeed's schedules)."""
        count = self.sends if kind == "send" else self.recvs
        if count >= len(self.keys):
            raise RuntimeError(f"a {kind} of micro-batch {count}: only {len(self.keys)} shapes")
        if kind == "send":
            self.sends += 1
        else:
            self.recvs += 1
        return self.keys[count]


def _shape_schedule(engine: PipelineEngine) -> _ShapeSchedule:
    return engine.__dict__.setdefault("_mbn_shapes", _ShapeSchedule())


def _signature(tensors) -> tuple:
    items = tensors if isinstance(tensors, (tuple, list)) else (tensors,)
    return tuple((tuple(t.shape), t.dtype) for t in items)


def _send_activations(engine: PipelineEngine, buffer_id: int) -> None:
    """DeepSpeed's SendActivation, with the shape metadata sent only where the receiver
    cannot know the shapes: the first micro-batch of each bucket (every micro-batch without
    buckets). A bucket's later micro-batches must have its first one's shapes."""
    plan = _shape_schedule(engine)
    if plan.keys is None:
        engine.first_output_send = True
    else:
        key = plan.next_key("send")
        sig = _signature(engine.pipe_buffers["outputs"][buffer_id])
        engine.first_output_send = key not in plan.sent
        first = plan.sent.setdefault(key, sig)
        if first != sig:
            raise RuntimeError(
                f"stage {engine.stage_id}: a micro-batch of bucket {key} sends shapes {sig}, "
                f"the bucket's first sent {first}"
            )
    _DS_SEND_ACTIVATIONS(engine, buffer_id)


def _recv_activations(engine: PipelineEngine, buffer_id: int) -> None:
    """DeepSpeed's RecvActivation into the buffers of the micro-batch's bucket: the metadata
    is received the first time a bucket comes (as :func:`_send_activations` sends it), the
    buffers are views of the pool of :func:`_typed_recv_buffer` after that."""
    plan = _shape_schedule(engine)
    known = None
    if plan.keys is not None:
        key = plan.next_key("recv")
        known = plan.received.get(key)
    if known is None:
        engine.pipe_recv_buf = None  # DeepSpeed receives the metadata and allocates
    else:
        is_tuple, sig = known
        bufs = [
            engine._allocate_or_extend_buffers(i, list(sh), dt) for i, (sh, dt) in enumerate(sig)
        ]
        engine.pipe_recv_buf = tuple(bufs) if is_tuple else bufs[0]
    _DS_RECV_ACTIVATIONS(engine, buffer_id)
    if plan.keys is not None and known is None:
        buf = engine.pipe_recv_buf
        plan.received[key] = (isinstance(buf, tuple), _signature(buf))


def _recv_grads(engine: PipelineEngine, buffer_id: int) -> None:
    """DeepSpeed's RecvGrad with the gradient buffers shaped from this micro-batch's outputs
    (views of the receive pool: no allocation, no communication), whatever its bucket."""
    engine.grad_layer = None
    _DS_RECV_GRADS(engine, buffer_id)


@contextlib.contextmanager
def fixed_shapes(engine: PipelineEngine, keys: list[int] | None) -> Iterator[None]:
    """Run one ``train_batch`` with ``keys[i]`` the bucket of micro-batch ``i`` (the same list
    on every stage of the pipeline: the data's, docs/design.md §18); None sends the shapes
    with every micro-batch. Checks that the stage sent and received one micro-batch per key."""
    plan = _shape_schedule(engine)
    plan.keys = None if keys is None else list(keys)
    plan.sends = plan.recvs = 0
    try:
        yield
        if keys is not None:
            want_recv = 0 if engine.is_first_stage() else len(keys)
            want_send = 0 if engine.is_last_stage() else len(keys)
            if (plan.recvs, plan.sends) != (want_recv, want_send):
                raise RuntimeError(
                    f"stage {engine.stage_id}: {plan.recvs} micro-batches received and "
                    f"{plan.sends} sent for {len(keys)} shapes"
                )
    finally:
        plan.keys = None


def _typed_recv_buffer(engine: PipelineEngine, idx: int, shape: list[int], dtype: torch.dtype):
    """A receive buffer for tuple slot ``idx`` of ``shape`` and ``dtype``, pooled per (slot, dtype).

    DeepSpeed 0.19.8's ``_allocate_or_extend_buffers`` keeps ONE pool, indexed by tuple slot
    only, for received activations and received gradients, and reuses a pooled tensor when it
    has enough elements, whatever its dtype. Our boundary tuple carries long ids beside float
    activations (module docstring), so on a stage that receives both (any middle stage of a
    3+ stage pipeline) slot 1 holds ``src_tokens`` (int64) from the forward pass when the
    float gradient of ``memory`` arrives: the float gradient was received into an int64 view
    and gloo failed with "Received data size doesn't match expected size" (exactly 2x), or on
    NCCL a silent reinterpretation. Keying the pool by dtype as well removes the collision;
    reusing across activations and gradients stays safe because received activations are
    cloned at once and a received gradient is consumed by the BackwardPass that follows its
    RecvGrad in the same schedule step (``schedule.TrainSchedule.steps``).
    """
    numel = math.prod(shape)
    pool = engine.__dict__.setdefault("_mbn_recv_pool", {})
    buf = pool.get((idx, dtype))
    if buf is None or buf.numel() < numel:
        buf = torch.zeros(numel, dtype=dtype, device=engine.device)
        pool[(idx, dtype)] = buf
    return buf[:numel].view(shape)


def unsupported_deepspeed(what: str) -> RuntimeError:
    """The error for a DeepSpeed whose private engine or optimizer methods differ from the
    0.19.8 ones our engine fixes replace (docs/design.md §2)."""
    import deepspeed

    return RuntimeError(
        f"DeepSpeed {deepspeed.__version__}: {what}; megatron_branchnorm needs "
        "deepspeed>=0.19.8,<0.20 (docs/design.md §2)"
    )


class SummedTrainBatchTimer(SynchronizedWallClockTimer.Timer):
    """DeepSpeed's ``train_batch`` timer holding one running sum instead of a record per update.

    DeepSpeed 0.19.8's ``PipelineEngine.train_batch`` starts and stops its ``train_batch``
    timer every update, whatever ``wall_clock_breakdown`` says; on CUDA each stop keeps a pair
    of CUDA events in the timer's ``event_timers`` list, which only DeepSpeed's read at a
    ``steps_per_print`` boundary clears, and ``steps_per_print`` defaults to 10**9 here
    (training/ds_config.py: no DeepSpeed log lines), so the list grew by two events per update
    for the whole run. This timer takes host time (``time.time()``, as DeepSpeed's timers do on
    host-timer accelerators; ``train_batch`` waits for the device once near its end, so the
    two differ by the work still queued then) and folds each interval into one record:
    :meth:`elapsed`, the only read DeepSpeed makes of it, gives the sum of the intervals since
    its last reset at any ``steps_per_print``, and the timer holds one number and no event."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.use_host_timer = True

    def stop(self, reset: bool = False, record: bool = False) -> None:
        """End the interval and add it to the running sum."""
        super().stop(reset=reset, record=record)
        self.event_timers[:] = [sum(self.event_timers)]


def bound_train_batch_timer(engine: PipelineEngine) -> None:
    """Give ``engine`` a :class:`SummedTrainBatchTimer` as its ``train_batch`` timer (its
    timer group's entry of that name; DeepSpeed's other timers run only under
    ``wall_clock_breakdown``, which DeepSpeed reads and clears at every ``steps_per_print``)."""
    timers = engine.timers.get_timers()
    if not isinstance(timers, dict):
        raise unsupported_deepspeed("the engine's timers keep no dict of timers")
    timers[TRAIN_BATCH_TIMER] = SummedTrainBatchTimer(TRAIN_BATCH_TIMER)


def install_engine_fixes(engine: PipelineEngine) -> None:
    """Apply our changes to this engine instance (DeepSpeed's class is untouched):
    :func:`_backward_once` for BackwardPass, :func:`_typed_recv_buffer` for receive buffers,
    the sends and receives of fixed shapes (:func:`fixed_shapes`), a stage that walks its
    modules only when its mode changes (:func:`remember_mode`), and a ``train_batch`` timer
    that does not grow with the updates (:func:`bound_train_batch_timer`). All replace private
    methods of DeepSpeed 0.19.8 (pinned in setup.py); a DeepSpeed without them is refused here
    rather than failing mid-step."""
    for name in ("_allocate_or_extend_buffers", "_INSTRUCTION_MAP", "_exec_recv_grads"):
        if not hasattr(type(engine), name):
            raise unsupported_deepspeed(f"PipelineEngine.{name} is missing")
    for name in ("first_output_send", "pipe_recv_buf", "grad_layer", "pipe_buffers", "timers"):
        if not hasattr(engine, name):
            raise unsupported_deepspeed(f"PipelineEngine has no attribute {name}")
    install_backward_once(engine)
    bound_train_batch_timer(engine)
    remember_mode(engine.module)
    engine._INSTRUCTION_MAP[schedule.SendActivation] = _send_activations
    engine._INSTRUCTION_MAP[schedule.RecvActivation] = _recv_activations
    engine._INSTRUCTION_MAP[schedule.RecvGrad] = _recv_grads
    engine._allocate_or_extend_buffers = functools.partial(_typed_recv_buffer, engine)
