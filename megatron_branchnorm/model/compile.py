"""``model.compile``: each encoder and decoder layer's forward body through ``torch.compile``
(off by default).

What is compiled is the body of :meth:`EncoderLayer.forward` / :meth:`DecoderLayer.forward`
(its residual blocks, attention, FFN and dropouts), not the pipeline wrappers around it: those
unpack the boundary tuple and fetch the stage's padding bias (``pipeline.StageBias``, a cache
keyed by tensor identity that a graph would guard on). :func:`layer_body` gives the function a
``*LayerPipe`` calls as ``body(layer, *args)``: the class's own forward, or its compiled form.

- One compiled function per body (per class, backend and ``dynamic``), shared by every layer of
  the stage: Dynamo guards on the layer's type and attributes, not its identity, so all
  encoder layers of a stage run one graph (one compile, however deep the stack).
- ``dynamic=True``: batch size and lengths are symbolic from the first compile, so token
  batches of new (B, S, T) do not recompile. A size of 1 is still specialised: the first
  micro-batch with a single sentence, a one-token source or a one-token target compiles one
  more graph per body that sees it (once each; measured +2, +2 and +1 graphs). Dynamo's
  ``recompile_limit`` (8 per body) bounds the graphs; past it a body runs eagerly (correct,
  slower). Evaluation (no_grad) compiles its own graph per body, once.
- BranchNorm's alpha_t is read from ``Residual.scale_tensor``, a 0-dim tensor filled in place
  each update (``residual.set_branch_scale``): a graph input, so a new alpha does not
  recompile. Past warm-up (alpha = 1) the blocks run Post-LN's code: one recompile, once.
- The LayerNorms pick their backend (Apex or torch) lazily at their first call per device
  type, caching it in a dict a graph would guard on; :class:`CompiledBody` makes that first
  choice eagerly, on a tiny tensor, before the first compiled call on a device, so the
  choice never recompiles. Apex's FusedLayerNorm (an extension call) breaks the graph at every
  LayerNorm: with compile, ``model.layernorm_impl=torch`` (inductor fuses the LayerNorm
  itself).
- model/dropout.py's CPU mask draws its words with ``Tensor.random_()``, which Dynamo does not
  trace (a graph break per dropout with p > 0, several graphs per layer). :func:`_keep_mask`
  is registered as its stand-in under Dynamo (``torch.compiler.substitute_in_graph``): the
  same computation with the out-of-place ``aten.random`` (one draw from torch's default
  generator, kept by inductor as that aten op), so the layer is one graph, the mask is fused
  with the scaling, and compiled and eager layers draw the same masks in the same order (also
  in a recompute). Eager code never calls it. On CUDA the dropout is ``F.dropout``, traced as
  it is (inductor's own RNG, seeded from torch's generator).
- Activation checkpointing (non-reentrant) recomputes the compiled forward; the compiled
  backward's saved tensors go through checkpoint's hooks as eager ones do.

Backend: inductor (C++ kernels on CPU, Triton on CUDA), which needs a C/C++ compiler at run
time (Triton builds its launcher with one too); without one (:func:`compiler_available`)
``aot_eager`` (the same graphs run by eager kernels: no fusion, no gain, but the same code
path), with a warning. Compilation happens at a layer's first call, not at construction.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
from torch import nn

from megatron_branchnorm.model import dropout as _dropout
from megatron_branchnorm.model.residual import LayerNorm

DEFAULT_BACKEND = "inductor"
FALLBACK_BACKEND = "aot_eager"


def _keep_mask(shape: torch.Size, p: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """:func:`megatron_branchnorm.model.dropout.keep_mask` as Dynamo traces it: ``aten.random``
    (out of place) where the original fills with ``random_()``; the same draws, the same mask
    (tests/model/test_compile.py checks it bit for bit)."""
    n = shape.numel()
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=device)
    words = torch.ops.aten.random.default(words)
    lanes = words.view(torch.int16)[:n].view(shape)
    bits = _dropout.LANE_BITS
    return (lanes & (2**bits - 1)) >= round(p * 2**bits)


def _register_keep_mask_stand_in() -> bool:
    """Register :func:`_keep_mask` for Dynamo; False (compiled dropout then breaks the graph,
    still correct) where torch refuses it, e.g. once keep_mask's signature has changed."""
    try:
        torch.compiler.substitute_in_graph(_dropout.keep_mask)(_keep_mask)
    except (TypeError, ValueError, AttributeError):
        return False
    return True


KEEP_MASK_TRACED = _register_keep_mask_stand_in()
"""Whether Dynamo traces the CPU dropout mask through :func:`_keep_mask` (module docstring)."""


@functools.lru_cache(maxsize=1)
def compiler_available() -> bool:
    """True when inductor finds a C++ compiler (``$CXX`` or ``g++``, run with ``--version``)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception:  # noqa: BLE001 - InvalidCxxCompiler, or an inductor without the helper
        return False
    return True


def default_backend() -> str:
    """inductor where a C++ compiler is found, else aot_eager (with a warning)."""
    if compiler_available():
        return DEFAULT_BACKEND
    warnings.warn(
        "model.compile: no C++ compiler found (inductor needs g++ or $CXX); layers are "
        f"compiled with backend={FALLBACK_BACKEND!r}: same graphs, eager kernels, no speed-up",
        stacklevel=2,
    )
    return FALLBACK_BACKEND


class CompiledBody:
    """``body(layer, *args)`` through ``torch.compile(body, backend, dynamic)``.

    Before the first call on a device type, every LayerNorm of the layer makes its backend
    choice eagerly (module docstring), so the graph never sees that cache change.
    """

    def __init__(self, body: Callable, backend: str, dynamic: bool = True) -> None:
        self.body = body
        self.backend = backend
        self.dynamic = dynamic
        self.compiled = torch.compile(body, backend=backend, dynamic=dynamic)

    def __call__(self, layer: nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        ready = layer.__dict__.setdefault("_compiled_devices", set())
        if x.device.type not in ready:
            _choose_layernorm_backends(layer, x)
            ready.add(x.device.type)
        return self.compiled(layer, x, *args, **kwargs)

    def __repr__(self) -> str:
        return (
            f"CompiledBody({self.body.__qualname__}, backend={self.backend!r}, "
            f"dynamic={self.dynamic})"
        )


def _choose_layernorm_backends(layer: nn.Module, x: torch.Tensor) -> None:
    """Run every LayerNorm of ``layer`` once, eagerly, on one row on ``x``'s device; warn
    where that is Apex's (a graph break at every LayerNorm)."""
    norms = [m for m in layer.modules() if isinstance(m, LayerNorm)]
    with torch.no_grad():
        for norm in norms:
            norm(torch.zeros(1, norm.weight.shape[0], device=x.device, dtype=x.dtype))
    if any(norm.last_backend == "apex" for norm in norms):
        warnings.warn(
            "model.compile with Apex's FusedLayerNorm: every LayerNorm breaks the compiled "
            "graph; set model.layernorm_impl=torch (inductor fuses the LayerNorm itself)",
            stacklevel=3,
        )


@functools.cache
def compiled_body(body: Callable, backend: str | None = None, dynamic: bool = True) -> CompiledBody:
    """The one :class:`CompiledBody` of ``body`` (an unbound layer forward, e.g.
    ``EncoderLayer.forward``) for this backend (None: :func:`default_backend`) and ``dynamic``."""
    if backend is None:
        backend = default_backend()
    return CompiledBody(body, backend, dynamic)


def layer_body(body: Callable, compile: bool, backend: str | None = None) -> Callable:
    """What a pipeline layer calls as ``body(layer, *args)``: ``body`` itself (the class's
    forward), or with ``compile`` (``model.compile``) its compiled form, :func:`compiled_body`."""
    return compiled_body(body, backend) if compile else body
