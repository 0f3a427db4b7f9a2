"""A layer range's forward and backward as two CUDA graphs, replayed through autograd, with the
parameter gradients written into buffers that every graph of a stage shares (docs/design.md §19).

Why not ``torch.cuda.make_graphed_callables``: it returns each parameter's gradient as a static
output of the backward graph, so every graph keeps its own copy of its range's parameter
gradients: ~0.47 GB per graph on a 74-layer opus100_1000L stage in bf16, and a stage wants a
graph per bucket shape and micro-batch in flight (``parallel.planner`` counts it). Here the
backward graph copies each parameter gradient into one buffer per parameter, allocated once per
stage outside any graph pool (``grad_buffers``), and the replay hands autograd views of those:
every graph of the stage writes the same memory. That is safe exactly where the graph path is
used at all: each gradient leaves ``.grad`` within its backward (bf16 with
``immediate_grad_update``, training/cuda_graphs.eager_reason), so no gradient in a shared buffer
is needed once the next backward starts. It also takes that a backward call replays each range
once, as DeepSpeed's (one micro-batch per backward): two replays of one range in a single
backward call would overwrite the shared parameter gradients before autograd had consumed the
first's. Input gradients leave as copies of their own (a stage whose encoder range is walked
by two backward calls of one micro-batch would otherwise lose one of them).

The capture follows torch's recipe for graphing an autograd region (the CUDA graphs notes of
torch's documentation): warm-up iterations on a side stream (none on a stage that recomputes:
a warm-up holds the range's activations outside the pool, which there is no room for; the
eager calls before a capture ran the same kernels) (cuBLAS workspaces, autograd's
first-call work and the allocator's first blocks made outside any capture; they use
``torch.autograd.grad``, so ``.grad`` and DeepSpeed's hooks are untouched), then the forward
captured on the sample inputs, then the backward captured with ``torch.autograd.grad`` from a
static output gradient, both in the caller's memory pool. A replay copies the call's inputs into
the static ones (unless they are those very tensors), replays, and returns the static output
detached; its backward copies the output gradient in, replays the backward graph, and returns
the static input gradients and the shared parameter gradients, detached.

Recompute (:meth:`CapturedRange.recompute`), for a stage that checkpoints activations: the
forward replays the same forward graph and returns a copy of its output, keeping only the
call's inputs and the random-number state; the backward restores that state, copies the inputs
in again, replays the forward graph (the recompute: the same kernels, so the same dropout masks
as the forward drew) and the backward graph right after it, and puts the state back. As a
graph's saved activations are needed only between those two back-to-back replays, one graph per
shape serves every micro-batch in flight (no in-flight slots), all in one pool.

Links (:class:`CapturedChain`, for a :class:`Links` module: a recomputing range cut so that the
pool holds one link's activations, not the whole range's; docs/design.md §19, "Links"): each
link's two graphs are captured in order, link k+1 on link k's static output itself (a detached
alias, so link k's forward replay writes link k+1's input in place), every link on link 0's
other static inputs and on one output-gradient buffer. The forward replays the links in order,
keeping a copy of each link's input and the random-number state before it (as DeepSpeed's
checkpointing keeps each chunk's input); the backward copies the passed-along inputs in once,
then from the last link to the first copies the gradient of the link's output into the shared
output-gradient buffer, restores the link's state, copies its input in, and replays its
forward and backward graphs; its input gradient is the next link's output gradient, and the
other inputs' gradients (a decoder's encoder output) are summed over the links. At a layer a
link that is what eager computes bit for bit; longer links sum the encoder output's gradient
within each link before across them (a float rounding apart). Sharing the pool is safe as it is
between shapes: a link's static outputs are read before any graph captured earlier, whose
temporaries they may overlie, replays again. Hence the order: link k+1's input gradient is
copied out before link k's forward replays (read after it, it may hold link k's activations;
tests/training/graph_double.py models that, and a first version read it after).

``cuda`` is the namespace the capture calls (``CUDAGraph``, ``graph``, ``Stream``, ``stream``,
``current_stream``, ``get_rng_state``, ``set_rng_state``): ``torch.cuda`` in use, a recording
stand-in in the CPU tests (tests/training/graph_double.py), which replays the recorded
operators on the same tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

CAPTURE_MODE = "thread_local"
"""The capture refuses unsafe CUDA calls of this thread only: ProcessGroupNCCL's watchdog thread
polls events of earlier collectives, which a "global" capture would take as an error (torch
pull requests 104487, 104555 and 148594 on that race)."""

GradBuffers = dict[int, torch.Tensor]
"""A stage's shared parameter-gradient buffers, by ``id`` of the parameter."""


class CapturedRange:
    """The two graphs of one range and shape, and the static tensors they read and write."""

    def __init__(
        self,
        module: nn.Module,
        sample_args: Sequence[torch.Tensor],
        pool: Any,
        grad_buffers: GradBuffers,
        warmup_iters: int = 1,
        cuda: Any = torch.cuda,
        static_grad_out: torch.Tensor | None = None,
    ) -> None:
        """``static_grad_out``: the buffer the backward graph reads its output gradient from
        (a new one when None; a chain's links share one: :class:`CapturedChain`)."""
        self.cuda = cuda
        self.warmup_iters = warmup_iters
        self.static_in = tuple(sample_args)
        self.params = tuple(p for p in module.parameters() if p.requires_grad)
        for p in self.params:
            if id(p) not in grad_buffers:
                grad_buffers[id(p)] = torch.empty_like(p)
        self.param_grads = tuple(grad_buffers[id(p)] for p in self.params)
        wanting = [a for a in self.static_in if a.requires_grad]
        wrt = (*wanting, *self.params)
        side = cuda.Stream()
        side.wait_stream(cuda.current_stream())
        with cuda.stream(side):
            for _ in range(warmup_iters):
                out = module(*self.static_in)
                torch.autograd.grad(out, wrt, torch.zeros_like(out), allow_unused=True)
                del out
        cuda.current_stream().wait_stream(side)
        self.forward_graph, self.backward_graph = cuda.CUDAGraph(), cuda.CUDAGraph()
        with cuda.graph(self.forward_graph, pool=pool, capture_error_mode=CAPTURE_MODE):
            self.static_out = module(*self.static_in)
        if static_grad_out is None:
            static_grad_out = torch.empty_like(self.static_out)
        self.static_grad_out = static_grad_out
        with cuda.graph(self.backward_graph, pool=pool, capture_error_mode=CAPTURE_MODE):
            grads = torch.autograd.grad(
                self.static_out, wrt, self.static_grad_out, allow_unused=True
            )
            for buffer, g in zip(self.param_grads, grads[len(wanting) :], strict=True):
                buffer.zero_() if g is None else buffer.copy_(g)
            firsts = iter(grads[: len(wanting)])
            self.input_grads = tuple(
                (_or_zeros(next(firsts), a) if a.requires_grad else None) for a in self.static_in
            )
            del grads, firsts

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        """The range on ``args`` (shaped as the sample), by replay, autograd-aware."""
        return _Replay.apply(self, *args, *self.params)

    def recompute(self, *args: torch.Tensor) -> torch.Tensor:
        """The range on ``args`` keeping no activation until the backward, which recomputes
        them (module docstring, "Recompute")."""
        return _RecomputeReplay.apply(self, *args, *self.params)

    def replay_forward(self, args: Sequence[torch.Tensor]) -> None:
        """The forward graph on ``args`` (copied into the static inputs unless they are those
        very tensors)."""
        for static, x in zip(self.static_in, args, strict=True):
            if static.data_ptr() != x.data_ptr():
                static.copy_(x)
        self.forward_graph.replay()


def _or_zeros(g: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if g is None else g


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, captured: CapturedRange, *args: torch.Tensor) -> torch.Tensor:
        ctx.captured = captured
        captured.replay_forward(args[: len(captured.static_in)])
        return captured.static_out.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _backward_replay(ctx.captured, grad)


def _backward_replay(captured: CapturedRange, grad: torch.Tensor) -> tuple:
    """The backward graph on ``grad``: (None for the captured object, each input's gradient,
    each parameter's, the latter in the stage's shared buffers)."""
    if captured.static_grad_out.data_ptr() != grad.data_ptr():
        captured.static_grad_out.copy_(grad)
    captured.backward_graph.replay()
    # Input gradients as tensors of their own (one copy of the hidden states' size): a stage
    # input's .grad would take the static buffer, and a second replay in the same micro-batch
    # (DeepSpeed's stock backward: one call per float output of a stage that sends both x_dec
    # and memory) would overwrite it and count itself twice.
    inputs = (None if g is None else g.clone() for g in captured.input_grads)
    return (None, *inputs, *(g.detach() for g in captured.param_grads))


class _RecomputeReplay(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, captured: CapturedRange, *args: torch.Tensor) -> torch.Tensor:
        inputs = args[: len(captured.static_in)]
        ctx.captured = captured
        ctx.rng = captured.cuda.get_rng_state()
        ctx.save_for_backward(*inputs)
        captured.replay_forward(inputs)
        return captured.static_out.clone()  # the next forward replay overwrites static_out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        captured: CapturedRange = ctx.captured
        cuda = captured.cuda
        now = cuda.get_rng_state()
        cuda.set_rng_state(ctx.rng)  # the recompute draws the forward's dropout masks
        captured.replay_forward(ctx.saved_tensors)
        cuda.set_rng_state(now)
        return _backward_replay(captured, grad)


class Links(nn.Module):
    """A recomputing range cut into consecutive links (module docstring, "Links"), each a
    module of the range's argument list that returns the hidden states: run in order, a link's
    hidden states go on to the next with the other arguments passed along unchanged."""

    def __init__(self, links: Sequence[nn.Module]) -> None:
        super().__init__()
        self.links = nn.ModuleList(links)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        for link in self.links:
            x = link(*args)
            args = (x, *args[1:])
        return x


class CapturedChain:
    """The graphs of a :class:`Links` range for one shape, replayed with recompute only
    (module docstring, "Links"): link k+1's static hidden-state input is link k's static
    output itself, the other static inputs are link 0's for every link, and every link's
    backward graph reads the one output-gradient buffer."""

    warmup_iters = 0
    """No side-stream warm-up: only recomputing stages cut their ranges into links."""

    def __init__(
        self,
        module: Links,
        sample_args: Sequence[torch.Tensor],
        pool: Any,
        grad_buffers: GradBuffers,
        cuda: Any = torch.cuda,
    ) -> None:
        self.cuda = cuda
        self.static_in = tuple(sample_args)
        self.links: list[CapturedRange] = []
        args, grad_out = self.static_in, None
        for link in module.links:
            captured = CapturedRange(link, args, pool, grad_buffers, 0, cuda, grad_out)
            self.links.append(captured)
            grad_out = captured.static_grad_out
            # the next link reads this one's output where it lies (a detached alias of it);
            # its gradient is always wanted, for this link's parameters
            args = (captured.static_out.detach().requires_grad_(), *args[1:])
        self.params = tuple(p for link in self.links for p in link.params)
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError("a parameter in two links would share one gradient buffer")

    def recompute(self, *args: torch.Tensor) -> torch.Tensor:
        """The range on ``args``, keeping each link's input until the backward recomputes the
        link (module docstring, "Links")."""
        return _ChainReplay.apply(self, *args, *self.params)


class _ChainReplay(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, chain: CapturedChain, *args: torch.Tensor) -> torch.Tensor:
        inputs = args[: len(chain.static_in)]
        ctx.chain = chain
        ctx.rng, kept = [], []
        for k, link in enumerate(chain.links):
            ctx.rng.append(chain.cuda.get_rng_state())
            if k == 0:
                link.replay_forward(inputs)
            else:  # its input is the previous link's static output, where it already lies
                kept.append(chain.links[k - 1].static_out.clone())  # for its recompute
                link.forward_graph.replay()
        ctx.save_for_backward(*inputs, *kept)
        return chain.links[-1].static_out.clone()  # the next replay overwrites static_out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        chain: CapturedChain = ctx.chain
        cuda = chain.cuda
        n = len(chain.static_in)
        saved = ctx.saved_tensors
        xs = (saved[0], *saved[n:])  # each link's hidden-state input
        for static, x in zip(chain.static_in[1:], saved[1:n], strict=True):
            static.copy_(x)  # the passed-along inputs, once for every link
        passed = chain.static_in[1:]
        others: list[torch.Tensor | None] = [None] * (n - 1)  # their gradients, summed
        now = cuda.get_rng_state()
        for k in reversed(range(len(chain.links))):
            link = chain.links[k]
            # the gradient first: from link k+1 it lies in that link's memory, which link k,
            # captured earlier into the same pool, may overwrite as its forward replays
            if link.static_grad_out.data_ptr() != grad.data_ptr():
                link.static_grad_out.copy_(grad)
            cuda.set_rng_state(ctx.rng[k])  # the recompute draws the forward's dropout masks
            link.replay_forward((xs[k], *passed))
            link.backward_graph.replay()
            grad = link.input_grads[0]
            for j, g in enumerate(link.input_grads[1:]):
                if g is not None:
                    others[j] = g.clone() if others[j] is None else others[j].add_(g)
        cuda.set_rng_state(now)
        first = None if grad is None else grad.clone()
        params = (g.detach() for link in chain.links for g in link.param_grads)
        return (None, first, *others, *params)


def capture_factory(
    grad_buffers: GradBuffers, warmup_iters: int = 1, cuda: Any = torch.cuda
) -> Callable[[nn.Module, tuple, Any], Any]:
    """A graph factory for training/cuda_graphs.GraphedRange whose graphs share
    ``grad_buffers`` (one stage's): a :class:`CapturedChain` of a :class:`Links` module, else a
    :class:`CapturedRange`."""

    def factory(module: nn.Module, sample_args: tuple, pool: Any) -> Any:
        if isinstance(module, Links):
            return CapturedChain(module, sample_args, pool, grad_buffers, cuda)
        return CapturedRange(module, sample_args, pool, grad_buffers, warmup_iters, cuda)

    return factory
