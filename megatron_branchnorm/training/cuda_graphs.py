"""``model.cuda_graphs``: each stage's encoder and decoder layer stack captured as CUDA graphs,
forward and backward, once per bucket shape, and replayed (docs/design.md §19).

The model does not know (../shared/STYLE.md rule 16): :func:`install` gives a built stage a
second list of entries, its ``forward_funcs`` (the list DeepSpeed's ``PipelineModule.forward``
calls in order) with each contiguous run of ``EncoderLayerPipe`` / ``DecoderLayerPipe`` /
``FinalNormPipe`` entries replaced by one :class:`GraphedRange`, and a ``forward`` that runs
DeepSpeed's own forward over that list. ``forward_funcs`` itself stays as built: DeepSpeed saves
and loads a stage's weights entry by entry from it (``PipelineModule.save_state_dict`` and
``load_state_dir`` skip an entry without ``state_dict`` and name files by index), so a range
there would drop every graphed layer from checkpoints, and a resume would train fresh weights
without a word. The embedding, the tied output projection and the loss stay eager, and so do
DeepSpeed's send/recv, which run between ``forward`` calls, never inside one.

A :class:`GraphedRange` per call:

- runs the layers eagerly when autograd is off or the layers are in eval mode (validation);
- keys the call by its input shapes, dtypes and ``requires_grad`` (one bucket shape of
  docs/design.md §18 gives one key);
- runs a key's first ``warmup`` calls eagerly (cuBLAS handles, the allocator, the LayerNorm
  backend choice are made outside any capture), checking that the layers pass every tuple
  element but the first through unchanged;
- then replays a graph of that key, capturing it first (training/graph_capture.py: a forward
  and a backward graph of a fresh wrapper module around the same layers, with clones of the
  call's inputs as the static input buffers; the call itself then runs by replay).

Only the first tuple element, the hidden states, leaves the graph: the ids and the encoder
output a decoder layer passes on are returned as the very tensors that came in, so their
gradients and the next stage's sends see the eager objects.

In flight. A graph's outputs and saved activations live in static memory that its next replay
overwrites. A pipeline stage runs up to ``stages - stage_id`` forwards before their backwards
(DeepSpeed's 1F1B schedule), so a graph is busy from its forward until the gradient of its
output arrives (a hook on the output), and a forward whose key's graphs are all busy uses (or
captures) the graph of the next free in-flight slot. Graphs of one slot share one memory pool
(they never overlap in time: a slot holds one micro-batch's forward-to-backward window); slots
have their own pools.

Memory. Each graph keeps its own static buffers alive between replays (:func:`static_bytes`):
its inputs, output and their gradients. The parameter gradients its backward computes are
copied into one buffer per parameter shared by every graph of the stage (graph_capture.py),
counted once per range (:func:`grad_buffer_bytes`: its weights' size; with
``torch.cuda.make_graphed_callables`` every graph kept a copy of those, ~0.47 GB a graph on a
deep stage). A stage captures at most ``max_graphs`` graphs
(:data:`~megatron_branchnorm.parallel.planner.MAX_GRAPHS`) whose static buffers fit in
``memory`` bytes: the trainer passes the planner's allowance for the stage (what its planned
peak leaves free, less a second copy of its in-flight activations, which the slots' pools hold
apart from the eager allocator: ``planner.graph_allowance``). A key past either bound runs
eagerly, said once; ``tools/plan_memory.py ... model.cuda_graphs=on`` shows per stage how many
graph sets fit.

Parameter gradients are graph outputs (computed with ``torch.autograd.grad`` inside the
backward graph); autograd's AccumulateGrad adds them into ``.grad`` outside the graph, so the
first micro-batch's hand-over and the later ones' fp32 accumulation (DeepSpeed's hooks,
training/bf16_grads.py) stay eager, as the capture audit requires
(experiments/capture_audit.py). The trap: the gradient handed to AccumulateGrad is a detached
view of the stage's shared gradient buffer, and a ``.grad`` that is None *takes* it (no copy),
so ``.grad`` then aliases memory the next backward replay overwrites. That is harmless only
where each gradient leaves ``.grad`` before the next backward (DeepSpeed's bf16 optimizer with
``immediate_grad_update``: its post-accumulate hooks add it into the fp32 buffer and set
``.grad`` to None, or keep it until the end of that backward: bf16_grads.py); an engine whose
``.grad`` carries gradients across micro-batches (fp32, fp16, bf16 without the flag) stays
eager.

BranchNorm's alpha_t is a 0-dim buffer filled in place (a graph input by address). Dropout on CUDA draws from torch's default generator, whose Philox
offset a capture registers and each replay advances. The stage's padding bias cache
(``pipeline.StageBias``) is cleared at the start of the wrapped region, so the bias is computed
inside the graph from the static ids buffer, not read from a tensor made before the capture.

Recompute. On a stage that checkpoints activations (``pipeline.activation_checkpoint_interval``
as the trainer resolves it) the ranges recompute themselves, and DeepSpeed's checkpointing of
the stage is turned off (every checkpointable layer is in a range): a graph's forward keeps
only its inputs and replays the whole range again right before its backward
(graph_capture.CapturedRange.recompute), so one graph per shape serves every micro-batch in
flight; the eager calls (warm-up, past the budget) run the layers through the module's
checkpoint function in chunks of the interval, as DeepSpeed would (:class:`Recompute`). The
memory differs from DeepSpeed's chunks: one input per micro-batch in flight instead of one per
chunk, and one micro-batch's activations of the whole range in the graphs' pool instead of one
chunk's (``planner.RunPlan.graph_allowance`` sets the pool aside). The stage's ranges share that
one pool (each range's activations live only from its recompute to its backward).

Links. Where a whole range's activations are more than the stage has room for (a stage of
hundreds of layers), ``install``'s ``link_layers`` (the planner's ``RunPlan.link_layers``) cuts
each range's graph into links of at most that many layers (:func:`link_parts`: as even as they
go, a final norm with its layer), captured as one :class:`~.graph_capture.CapturedChain` per
shape (graph_capture.py, "Links"): the pool then holds one link's activations, and each link
keeps its output and input gradients per shape (:func:`static_bytes`). A chain counts as one
graph against the budget.

Eager instead, with one line naming the reason (:func:`eager_reason`): no CUDA device, a torch
without ``torch.cuda.graph(pool=, capture_error_mode=)``, ``data.bucket_shapes=0`` (shapes vary),
``model.compile``, ``torch_autocast`` in the DeepSpeed JSON, parameter gradients kept in
``.grad`` across micro-batches, module hooks on a layer, or no layer to graph on the stage.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from megatron_branchnorm.config import CUDA_GRAPH_MODES
from megatron_branchnorm.formats.files import one_line
from megatron_branchnorm.parallel.pipeline import (
    DecoderLayerPipe,
    EncoderLayerPipe,
    FinalNormPipe,
    StageBias,
)
from megatron_branchnorm.parallel.planner import MAX_GRAPHS, link_count
from megatron_branchnorm.training.graph_capture import Links, capture_factory
from megatron_branchnorm.training.stopping import TrainError

MODES = CUDA_GRAPH_MODES
"""The values of ``model.cuda_graphs``."""

WARMUP = 2
"""Eager calls of a key before its graph is captured."""

GraphFactory = Callable[[nn.Module, tuple, Any], Callable[..., torch.Tensor]]
"""``factory(module, sample_args, pool)`` -> the graphed callable of ``module``."""


class GraphCaptureError(TrainError):
    """A capture the device refused (an operation CUDA does not allow while a stream captures,
    an invalidated capture): one line on that rank naming the range, the shapes and the way
    out, ``model.cuda_graphs=off`` (exit 2 through ``trainer.run``; the other ranks report it
    lost). Not a fall-back to eager: a failed capture can leave the CUDA generator's capture
    state and the pools half set up, and a run that goes on would not be the run asked for."""


_LAYER_TYPES = (EncoderLayerPipe, DecoderLayerPipe)
_RANGE_TYPES = (EncoderLayerPipe, DecoderLayerPipe, FinalNormPipe)


def eager_reason(
    *,
    device: torch.device,
    bucket_shapes: int | str,
    compiled: bool,
    grads_handed_over: bool,
    autocast: bool = False,
) -> str | None:
    """None when a stage on ``device`` with these settings can be graphed (``autocast``: the
    DeepSpeed JSON turns ``torch_autocast`` on); else the one-line reason it runs eagerly."""
    if device.type != "cuda":
        return f"no CUDA device (the stage runs on {device.type})"
    graph = getattr(torch.cuda, "graph", None)
    wanted = {"pool", "capture_error_mode"}
    if graph is None or not wanted <= set(inspect.signature(graph).parameters):
        return f"torch {torch.__version__} has no torch.cuda.graph(pool=, capture_error_mode=)"
    if bucket_shapes == 0:
        return "data.bucket_shapes=0: micro-batch shapes vary and a graph replays fixed shapes"
    if compiled:
        return "model.compile=true: the compiled layer bodies are not captured as graphs"
    if autocast:
        return (
            "torch_autocast in the DeepSpeed JSON: autocast keeps a cache of cast weights, "
            "which a capture would freeze"
        )
    if not grads_handed_over:
        return (
            "parameter gradients stay in .grad from one micro-batch to the next (only bf16 "
            "with immediate_grad_update in the DeepSpeed JSON hands them over at once): "
            "AccumulateGrad may keep a graph's gradient buffer as .grad, which the next "
            "replay overwrites"
        )
    return None


class LayerRun(nn.Module):
    """The layers of one range run in order on a flat argument list: what is captured. Returns
    the first element of the last layer's output (the hidden states)."""

    def __init__(self, layers: Sequence[nn.Module], as_tuple: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.as_tuple = as_tuple

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        StageBias.clear()  # the bias is computed inside the region from these ids
        h: Any = args if self.as_tuple else args[0]
        for layer in self.layers:
            h = layer(h)
        return h[0] if isinstance(h, tuple) else h


def static_bytes(args: Sequence[torch.Tensor], links: int = 1) -> int:
    """Bytes a graph captured on ``args`` keeps alive between replays: each static input and
    the gradient of each that requires one, the output (the hidden states' shape) and its
    gradient (module docstring, "Memory"); cut into ``links`` (module docstring, "Links"),
    each further link's output and its input gradients (its inputs are the previous link's
    output and the first link's others, its output gradient the first link's)."""
    held = sum(a.nbytes * (2 if a.requires_grad else 1) for a in args)
    per_link = 2 * args[0].nbytes + sum(a.nbytes for a in args[1:] if a.requires_grad)
    return held + 2 * args[0].nbytes + (links - 1) * per_link


def grad_buffer_bytes(layers: Sequence[nn.Module]) -> int:
    """Bytes of the shared gradient buffers of ``layers``' parameters (graph_capture.py): one
    per parameter that requires a gradient, in its dtype, however many graphs use them."""
    params = {id(p): p for layer in layers for p in layer.parameters() if p.requires_grad}
    return sum(p.numel() * p.element_size() for p in params.values())


@dataclass
class GraphBudget:
    """What a stage's graphs may still take (shared by its ranges): a number of graphs and
    bytes of static buffers."""

    graphs: int
    memory: float = math.inf

    def refusal(self, need: int) -> str | None:
        """None when a graph keeping ``need`` bytes fits; else why not (one phrase)."""
        if self.graphs <= 0:
            return "the stage's graph budget is spent (its count of graphs)"
        if need > self.memory:
            return (
                f"the stage's graph budget is spent (memory: the graph would keep "
                f"{need / 2**30:.2f} GiB of static buffers, {max(self.memory, 0) / 2**30:.2f} "
                "GiB of the planner's allowance is left)"
            )
        return None

    def take(self, need: int) -> None:
        self.graphs -= 1
        self.memory -= need


@dataclass(frozen=True)
class Recompute:
    """A stage that checkpoints activations: outside a graph its layers run as DeepSpeed's
    ``PipelineModule.forward`` would run them, chunks of ``interval`` layers each through
    ``checkpoint`` (the module's ``activation_checkpoint_func``) when every entry of the chunk
    is a layer; a graph recomputes itself (graph_capture.CapturedRange.recompute)."""

    interval: int
    checkpoint: Callable[..., Any]

    def run(self, layers: Sequence[nn.Module], inputs: Any) -> Any:
        for a in range(0, len(layers), self.interval):
            chunk = layers[a : a + self.interval]
            if all(isinstance(f, _LAYER_TYPES) for f in chunk):
                args = inputs if isinstance(inputs, tuple) else (inputs,)
                inputs = self.checkpoint(_chunk_function(chunk), *args)
            else:
                for f in chunk:
                    inputs = f(inputs)
        return inputs


def _chunk_function(chunk: Sequence[nn.Module]) -> Callable[..., Any]:
    """The layers of ``chunk`` as one function of unpacked arguments (DeepSpeed's
    ``exec_range_func``: a single argument is passed as itself, several as a tuple)."""

    def run(*inputs: Any) -> Any:
        x: Any = inputs[0] if len(inputs) == 1 else inputs
        for f in chunk:
            x = f(x)
        return x

    return run


def link_parts(layers: Sequence[nn.Module], layers_per_link: int) -> list[list[nn.Module]]:
    """``layers`` (a range) cut into the fewest links of at most ``layers_per_link`` encoder or
    decoder layers each (0: one link), as even as they go; a final norm stays with the layer
    before it."""
    count = sum(isinstance(f, _LAYER_TYPES) for f in layers)
    links = link_count(count, layers_per_link)
    sizes = [count // links + (i < count % links) for i in range(links)]
    parts: list[list[nn.Module]] = [[]]
    held = 0  # layers in the last part
    for f in layers:
        if isinstance(f, _LAYER_TYPES):
            if held == sizes[len(parts) - 1]:
                parts.append([])
                held = 0
            held += 1
        parts[-1].append(f)
    return parts


def _returns_tuple(layers: Sequence[nn.Module], as_tuple: bool) -> bool:
    """Whether ``layers`` called on a tuple (``as_tuple``) return one: all do but the model's
    last decoder layer (pipeline.DecoderLayerPipe.is_last), after which only a final norm may
    follow."""
    last = [f for f in layers if isinstance(f, _LAYER_TYPES)][-1]
    return as_tuple and not (isinstance(last, DecoderLayerPipe) and last.is_last)


@dataclass
class _Graph:
    fn: Callable[..., torch.Tensor]
    busy: bool = False


@dataclass
class _Key:
    calls: int = 0
    slots: dict[int, _Graph] = field(default_factory=dict)
    tuple_out: bool = False
    said_eager: bool = False


class GraphedRange:
    """A run of layer entries of a stage's ``forward_funcs``, replayed from per-shape graphs
    (module docstring); called as DeepSpeed calls a layer: ``range(inputs)``."""

    def __init__(
        self,
        layers: Sequence[nn.Module],
        log: Callable[[str], None],
        name: str,
        factory: GraphFactory,
        new_pool: Callable[[], Any],
        warmup: int = WARMUP,
        budget: GraphBudget | None = None,
        recompute: Recompute | None = None,
        link_layers: int = 0,
    ) -> None:
        self.layers = list(layers)
        self.recompute = recompute
        """Set on a stage that checkpoints: eager calls checkpoint, graphs recompute."""
        self.links = link_parts(self.layers, link_layers) if recompute else [self.layers]
        """The layers of each link a graph of this range is cut into (module docstring,
        "Links"): one, unless the stage recomputes with ``link_layers`` fewer than its
        layers."""
        self.log = log
        self.name = name
        self.factory = factory
        self.new_pool = new_pool
        self.warmup = warmup
        self.budget = budget if budget is not None else GraphBudget(MAX_GRAPHS)
        """What this range's graphs may still take (shared by a stage's ranges)."""
        self.keys: dict[tuple, _Key] = {}
        self.pools: dict[int, Any] = {}
        self.disabled: str | None = None
        self.captures = self.replays = 0

    def eager(self, inputs: Any) -> Any:
        """The layers as DeepSpeed would call them."""
        if self.recompute is not None and torch.is_grad_enabled():
            return self.recompute.run(self.layers, inputs)
        for layer in self.layers:
            inputs = layer(inputs)
        return inputs

    def __call__(self, inputs: Any) -> Any:
        as_tuple = isinstance(inputs, tuple)
        args = inputs if as_tuple else (inputs,)
        if (
            self.disabled
            or not torch.is_grad_enabled()
            or not self.layers[0].training
            or not all(isinstance(a, torch.Tensor) for a in args)
        ):
            return self.eager(inputs)
        key = (as_tuple, *((tuple(a.shape), a.dtype, a.requires_grad) for a in args))
        state = self.keys.setdefault(key, _Key())
        state.calls += 1
        if state.calls <= self.warmup:
            out = self.eager(inputs)
            if self.recompute is None:
                self._check_passthrough(args, out, state)
            else:  # checkpoint's outputs are not the inputs' objects: the layers' types say
                state.tuple_out = _returns_tuple(self.layers, as_tuple)
            return out
        graph = self._graph(key, state, args, as_tuple)
        if graph is None:
            return self.eager(inputs)
        self.replays += 1
        if self.recompute is not None:  # one graph per shape: no activation kept in flight
            x = graph.fn.recompute(*args)
            return (x, *args[1:]) if state.tuple_out else x
        x = graph.fn(*args)
        graph.busy = True
        if x.requires_grad:
            x.register_hook(lambda grad, g=graph: self._release(g))
        else:  # nothing will flow back: the graph's buffers are free again after this call
            graph.busy = False
        return (x, *args[1:]) if state.tuple_out else x

    def _release(self, graph: _Graph) -> None:
        graph.busy = False

    def _check_passthrough(self, args: tuple, out: Any, state: _Key) -> None:
        """The layers must return a tensor, or a tuple of the inputs' length whose elements
        after the first are the inputs themselves; else this range stays eager."""
        if isinstance(out, tuple):
            state.tuple_out = True
            same = len(out) == len(args) and all(
                o is a for o, a in zip(out[1:], args[1:], strict=False)
            )
            if not same or not isinstance(out[0], torch.Tensor):
                self._disable("its layers do not pass the tuple's other tensors through")
        elif not isinstance(out, torch.Tensor):
            self._disable(f"its layers return {type(out).__name__}")

    def _disable(self, reason: str) -> None:
        self.disabled = reason
        self.keys.clear()  # graphs already captured free their buffers once none is in flight
        self.pools.clear()
        self.log(f"cuda graphs: {self.name} runs eagerly: {reason}")

    def _graph(self, key: tuple, state: _Key, args: tuple, as_tuple: bool) -> _Graph | None:
        """A free graph of ``key`` (the lowest in-flight slot with none of its graphs busy),
        captured now if that slot has none; None when the stage's graph budget is spent."""
        busy = {s for k in self.keys.values() for s, g in k.slots.items() if g.busy}
        slot = next(s for s in range(len(busy) + 1) if s not in busy)  # 0 when recomputing
        graph = state.slots.get(slot)
        if graph is not None:
            return graph
        need = static_bytes(args, len(self.links))
        need += 0 if self.captures else grad_buffer_bytes(self.layers)
        refusal = self.budget.refusal(need)
        if refusal is not None:
            if not state.said_eager:
                state.said_eager = True
                self.log(
                    f"cuda graphs: {self.name}: inputs of shapes {_shapes(args)} (in-flight slot "
                    f"{slot}) run eagerly: {refusal}"
                )
            return None
        self.budget.take(need)
        if slot not in self.pools:
            self.pools[slot] = self.new_pool()
        sample = tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in args)
        module: nn.Module = LayerRun(self.layers, as_tuple)
        if len(self.links) > 1:
            module = Links([LayerRun(link, as_tuple) for link in self.links])
        try:
            fn = self.factory(module, sample, self.pools[slot])
        except torch.OutOfMemoryError:
            self.log(
                f"cuda graphs: {self.name}: capturing inputs of shapes {_shapes(args)} ran out "
                "of memory"
            )
            raise  # the trainer's one line about the stage's memory plan (memory_note)
        except RuntimeError as exc:
            raise GraphCaptureError(
                f"cuda graphs: {self.name}: the device refused to capture inputs of shapes "
                f"{_shapes(args)} ({one_line(str(exc))[:200]}); train with model.cuda_graphs=off"
            ) from exc
        graph = state.slots[slot] = _Graph(fn)
        self.captures += 1
        if self.captures == 1:
            self.log(
                f"cuda graphs: {self.name}: first graph captured, inputs of shapes {_shapes(args)}"
            )
        if self.captures & (self.captures - 1) == 0 and torch.cuda.is_available():
            # 1, 2, 4, ... graphs: what the pools and buffers really take (a pool shared by
            # several shapes may grow past one micro-batch's activations: design §19)
            self.log(
                f"cuda graphs: {self.name}: {self.captures} graph(s) captured, "
                f"{torch.cuda.memory_reserved() / 2**30:.2f} GiB reserved on the device"
            )
        return graph


def _shapes(args: Sequence[torch.Tensor]) -> str:
    """A call's input shapes, as the log lines and errors name them."""
    return ", ".join(str(tuple(a.shape)) for a in args)


def memory_note(ranges: Sequence[GraphedRange]) -> str:
    """What a stage's out-of-memory line adds about its graphs (``install``'s ``ranges``): ""
    where none was captured; else their count and how to give their memory back (a graph keeps
    its pool and static buffers outside the planned run, and a shape first seen late in a run
    is captured then)."""
    captured = sum(r.captures for r in ranges)
    if not captured:
        return ""
    links = max(len(r.links) for r in ranges)
    longest = max(sum(isinstance(f, _LAYER_TYPES) for f in k) for r in ranges for k in r.links)
    ways = "model.cuda_graphs=off"
    if ranges[0].recompute is not None and longest > 1:  # links of a layer are the shortest
        shorter = f"model.cuda_graph_link_layers below {longest}: a smaller pool"
        ways = f"shorter links ({shorter}) or {ways}"
    cut = f" in links ({links} at most)" if links > 1 else ""
    return (
        f", with {captured} CUDA graph(s) captured{cut}, whose pools and buffers sit outside "
        f"the planned run: resume with {ways}"
    )


def layer_runs(funcs: Sequence[Any]) -> list[tuple[int, int]]:
    """``(start, stop)`` of each maximal run of graphable entries of ``funcs`` that holds at
    least one encoder or decoder layer."""
    runs, start = [], None
    for i, f in enumerate([*funcs, None]):
        if isinstance(f, _RANGE_TYPES):
            start = i if start is None else start
            continue
        if start is not None and any(isinstance(g, _LAYER_TYPES) for g in funcs[start:i]):
            runs.append((start, i))
        start = None
    return runs


def _hooked(layers: Sequence[nn.Module]) -> str | None:
    for layer in layers:
        for name, m in layer.named_modules():
            if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks:
                return f"{type(layer).__name__}{'.' + name if name else ''}"
    return None


def _forward_over(module: Any, graphed_funcs: list) -> None:
    """Give ``module`` a ``forward`` that runs its own over ``graphed_funcs`` in place of its
    ``forward_funcs``, which every other reader (DeepSpeed's checkpoint save and load) still
    sees as built (module docstring)."""
    plain = module.forward
    module.graphed_funcs = graphed_funcs

    def forward(*args: Any, **kwargs: Any) -> Any:
        built = module.forward_funcs
        module.forward_funcs = graphed_funcs
        try:
            return plain(*args, **kwargs)
        finally:
            module.forward_funcs = built

    module.forward = forward


def install(
    module: nn.Module,
    mode: str,
    *,
    device: torch.device,
    bucket_shapes: int | str,
    checkpoint_interval: int,
    compiled: bool,
    grads_handed_over: bool,
    log: Callable[[str], None],
    autocast: bool = False,
    factory: GraphFactory | None = None,
    new_pool: Callable[[], Any] | None = None,
    max_graphs: int = MAX_GRAPHS,
    memory: float = math.inf,
    link_layers: int = 0,
    cuda: Any = torch.cuda,
) -> list[GraphedRange]:
    """Graph ``module``'s layer runs (a built stage: its ``forward_funcs``) as ``mode`` says;
    ``grads_handed_over``: each parameter's gradient leaves ``.grad`` as soon as backward has
    written it (module docstring, "Parameter gradients"); ``memory``: bytes the stage's graphs
    may keep in static buffers (module docstring, "Memory"); ``checkpoint_interval`` > 0: the
    stage recomputes activations, and its ranges do it themselves (module docstring,
    "Recompute"; DeepSpeed's own checkpointing of the stage is turned off), its ranges' graphs
    share one memory pool and are cut into links of at most ``link_layers`` layers (0: one
    link per range; module docstring, "Links"); ``cuda``: the
    namespace the default factory captures with and the memory pools come from (default
    ``new_pool``: its ``graph_pool_handle``; graph_capture.py). Returns the ranges
    installed (none: the stage runs eagerly, and unless ``mode`` is off, or auto on a machine
    without CUDA, one line through ``log`` says why)."""
    if mode not in MODES:
        raise ValueError(f"model.cuda_graphs: unknown mode {mode!r}")
    if mode == "off":
        return []
    reason = eager_reason(
        device=device,
        bucket_shapes=bucket_shapes,
        compiled=compiled,
        grads_handed_over=grads_handed_over,
        autocast=autocast,
    )
    funcs = module.forward_funcs
    runs = layer_runs(funcs)
    if reason is None and not runs:
        reason = "this stage holds no encoder or decoder layer"
    if reason is None:  # the hooks are looked for only where a graph could be made
        hooked = next((h for a, b in runs if (h := _hooked(funcs[a:b]))), None)
        if hooked:
            reason = f"{hooked} has module hooks, which a replay would skip"
    if reason is not None:
        if mode == "on" or device.type == "cuda":
            log(f"model.cuda_graphs={mode}: layers run eagerly: {reason}")
        return []
    budget = GraphBudget(max_graphs, memory)
    recompute = None
    if checkpoint_interval > 0:
        recompute = Recompute(checkpoint_interval, module.activation_checkpoint_func)
    if factory is None:  # the stage's graphs share its parameter-gradient buffers
        # A recomputing stage has no room for a warm-up that keeps a whole range's activations
        # beside the pool holding another shape's (it runs the same kernels in its eager,
        # checkpointed calls first); elsewhere the planner sets that copy aside.
        factory = capture_factory({}, warmup_iters=0 if recompute else 1, cuda=cuda)
    new_pool = new_pool or cuda.graph_pool_handle
    if recompute is not None:  # one pool for all: a range's activations live in its backward
        new_pool = functools.cache(new_pool)
    ranges, graphed_funcs = [], list(funcs)
    for a, b in reversed(runs):
        name = f"layers {a}-{b - 1} of the stage"
        graphed = GraphedRange(
            funcs[a:b], log, name, factory, new_pool, budget=budget, recompute=recompute,
            link_layers=link_layers,
        )  # fmt: skip
        graphed_funcs[a:b] = [graphed]
        ranges.append(graphed)
    _forward_over(module, graphed_funcs)
    if recompute is not None:  # every layer of the stage is in a range, which recomputes
        module.set_checkpoint_interval(0)
    how = ""
    if recompute:
        links = max(len(r.links) for r in ranges)
        how = "recomputed in the backward" + (f" in up to {links} links, " if links > 1 else ", ")
    log(
        f"model.cuda_graphs={mode}: {len(ranges)} layer range(s) captured per bucket shape "
        f"{how}after {WARMUP} eager calls (at most {max_graphs} graphs"
        + (
            f" keeping {memory / 2**30:.2f} GiB of static buffers)"
            if math.isfinite(memory)
            else ")"
        )
    )
    return ranges[::-1]
