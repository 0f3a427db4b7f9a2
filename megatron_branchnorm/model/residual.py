"""The residual schemes: the one place in the code base that knows what each scheme does.

Every sublayer F (self-attention, cross-attention, feed-forward) sits in a residual block:

    postln:      x = LN(x + F(x))                 vanilla Post-LN (Vaswani et al., 2017)
    preln:       x = x + F(LN(x))                 plus a final LN after the last layer of a stack
    deepnorm:    x = LN(alpha * x + F(x))         DeepNet (Wang et al., 2022)
    branchnorm:  x = LN(x + alpha_t * F(x))       BranchNorm (Liu et al., ACL Findings 2024)

Each scheme is one :class:`Scheme` in the registry :data:`SCHEMES`: its block equation and
its traits (a final LN after each stack, foldable to Post-LN, exportable as Marian, DeepNet's
alpha or init, a step-scaled branch). Every other module asks the scheme
(``scheme_of(cfg).final_norm``) and never compares names, so a new scheme is an entry here
plus its name in ``config.RESIDUAL_SCHEMES`` (docs/design.md §11).

F includes its output dropout. DeepNorm's alpha is a constant per stack (deepnorm_constants;
``Residual.deepnorm_alpha``); BranchNorm's alpha_t comes from the training step
(branchnorm_alpha) and is set on the blocks by set_branch_scale before every update: a 0-dim
tensor on the stage's device, filled in place, that the block reads (a compiled graph sees each
new value), beside the Python float ``Residual.branch_scale`` for logging and export; never a
parameter. After T steps BranchNorm is exactly Post-LN, and its blocks run Post-LN's code.

Initialisation (DeepNet paper, Fig. 2 pseudocode): Xavier-normal with gain beta for the value
and output projections of every attention (cross-attention included) and both FFN matrices;
query and key projections keep gain 1. BranchNorm initialises the same way (its paper follows
DeepNet here). Post-LN and Pre-LN use gain 1 everywhere. ``model.branch_init`` overrides
the scheme's choice, for ablations (e.g. Post-LN with DeepNet's init). torchscale instead
multiplies PyTorch's default nn.Linear init by its own beta (1.15 for the encoder); we follow
the paper.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from megatron_branchnorm.config import RESIDUAL_SCHEMES, ModelConfig
from megatron_branchnorm.model.dropout import Dropout

# --------------------------------------------------------------------------------------------
# The registry of schemes: every site asks a scheme's traits, none compares names
# --------------------------------------------------------------------------------------------

Sublayer = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, eq=False)
class Scheme:
    """A residual scheme (``model.residual``, docs/design.md §11): its block equation and the
    traits the rest of the code base asks about (``scheme_of(cfg).final_norm``), so that a new
    scheme is one entry of :data:`SCHEMES` plus its name in ``config.RESIDUAL_SCHEMES``.

    One instance per scheme: blocks hold the registry's instance, and copying or unpickling a
    block keeps it (as the enum this replaces did), so identity is the scheme's equality.
    """

    name: str
    """Its ``model.residual`` value."""
    label: str
    """How messages name it ("Pre-LN")."""
    block: Callable[[Residual, torch.Tensor, Sublayer], torch.Tensor]
    """The block's forward ``block(residual, x, F)``: the residual's LN, dropout, DeepNorm
    alpha and BranchNorm alpha_t are read from ``residual``."""
    postln_scale: Callable[[Residual], float] | None = None
    """The factor c with which a block equals Post-LN once F's output is scaled by c (what
    fold_to_postln folds); None when the scheme has no Post-LN equivalent."""
    deepnet_alpha: bool = False
    """The residual x is up-weighted by DeepNet's alpha of its stack (deepnorm_constants)."""
    deepnet_init: bool = False
    """``model.branch_init=auto`` initialises the branches with DeepNet's beta (else gain 1)."""
    step_scaled: bool = False
    """The branch is scaled by alpha_t of the training step (branchnorm_alpha): set before
    every update, recorded by an export."""
    hf_refusal: str = "Marian is Post-LN only"
    """Why --format hf refuses a scheme that does not fold to Post-LN (the message's reason)."""

    POSTLN: ClassVar[Scheme]
    """Vanilla Post-LN: what fold_to_postln turns every foldable scheme into."""

    @property
    def final_norm(self) -> bool:
        """Each stack ends in a LayerNorm (Pre-LN). Declared in ``config.RESIDUAL_SCHEMES``,
        where the torch-free plan reads it too (docs/design.md §9)."""
        return RESIDUAL_SCHEMES[self.name].final_norm

    @property
    def foldable_to_postln(self) -> bool:
        """A model in this scheme computes a vanilla Post-LN model's function once its residual
        weights are folded into the sublayers' output projections (fold_to_postln)."""
        return self.postln_scale is not None

    @property
    def marian_exportable(self) -> bool:
        """--format hf can write it: Marian (transformers) is Post-LN, so a scheme that folds to
        Post-LN is one."""
        return self.foldable_to_postln

    def __str__(self) -> str:
        return self.name

    def __copy__(self) -> Scheme:
        return self

    def __deepcopy__(self, memo: dict) -> Scheme:
        return self

    def __reduce__(self) -> tuple:
        return scheme_named, (self.name,)


def _postln_block(block: Residual, x: torch.Tensor, f: Sublayer) -> torch.Tensor:
    return block.norm(x + block.dropout(f(x)))


def _preln_block(block: Residual, x: torch.Tensor, f: Sublayer) -> torch.Tensor:
    return x + block.dropout(f(block.norm(x)))


# torch.add(a, b, alpha=s) = a + s * b in one kernel (no separate scale and its backward); at
# s = 1 it is the plain sum, so BranchNorm at alpha=1 is Post-LN exactly.
def _deepnorm_block(block: Residual, x: torch.Tensor, f: Sublayer) -> torch.Tensor:
    return block.norm(torch.add(block.dropout(f(x)), x, alpha=block.deepnorm_alpha))


def _branchnorm_block(block: Residual, x: torch.Tensor, f: Sublayer) -> torch.Tensor:
    if block.scale_is_one:  # past warm-up: Post-LN exactly, no scale to apply
        return block.norm(x + block.dropout(f(x)))
    if block.scale_tensor is not None:  # (): alpha_t on the device, filled once per update
        return block.norm(torch.addcmul(x, block.dropout(f(x)), block.scale_tensor))
    return block.norm(torch.add(x, block.dropout(f(x)), alpha=block.branch_scale))


# LN is invariant to a positive scale of its input (up to epsilon), so
# LN(a x + F(x)) = LN(x + F(x) / a) and LN(x + s F(x)) is Post-LN with F scaled by s.
SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme("postln", "Post-LN", _postln_block, postln_scale=lambda block: 1.0),
        Scheme(
            "preln",
            "Pre-LN",
            _preln_block,
            hf_refusal="Marian is Post-LN only; M2M100's pre-norm layers use a different "
            "sinusoidal position table",
        ),
        Scheme(
            "deepnorm",
            "DeepNorm",
            _deepnorm_block,
            postln_scale=lambda block: 1.0 / block.deepnorm_alpha,
            deepnet_alpha=True,
            deepnet_init=True,
        ),
        Scheme(
            "branchnorm",
            "BranchNorm",
            _branchnorm_block,
            postln_scale=lambda block: block.branch_scale,
            deepnet_init=True,
            step_scaled=True,
        ),
    )
}
"""Every residual scheme by name: the registry (docs/design.md §11)."""
Scheme.POSTLN = SCHEMES["postln"]


def check_registry() -> None:
    """:data:`SCHEMES` names exactly ``config.RESIDUAL_SCHEMES`` (config validates
    ``model.residual`` against those names, as it may not import the model), and no scheme
    with a final LayerNorm claims a Post-LN equivalent (Post-LN has none). Run at import."""
    if set(SCHEMES) != set(RESIDUAL_SCHEMES):
        raise RuntimeError(
            f"model/residual.py SCHEMES ({', '.join(sorted(SCHEMES))}) and config.py "
            f"RESIDUAL_SCHEMES ({', '.join(sorted(RESIDUAL_SCHEMES))}) name different schemes"
        )
    for name, scheme in SCHEMES.items():
        if scheme.name != name:
            raise RuntimeError(f"SCHEMES[{name!r}] is the scheme {scheme.name!r}")
        if scheme.final_norm and scheme.foldable_to_postln:
            raise RuntimeError(f"scheme {name!r} has a final LayerNorm, so no Post-LN equivalent")


check_registry()


def scheme_named(name: str | Scheme) -> Scheme:
    """The registered scheme called ``name`` (a Scheme is returned as is); ValueError for an
    unknown name."""
    if isinstance(name, Scheme):
        return name
    try:
        return SCHEMES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown residual scheme {name!r} ({', '.join(SCHEMES)})") from None


def scheme_of(cfg: ModelConfig) -> Scheme:
    """The scheme of a model config (``cfg.residual``)."""
    return scheme_named(cfg.residual)


# --------------------------------------------------------------------------------------------
# Constants and schedules
# --------------------------------------------------------------------------------------------


def deepnorm_constants(
    encoder_layers: int, decoder_layers: int
) -> tuple[float, float, float, float]:
    """DeepNet's encoder-decoder constants (alpha_enc, beta_enc, alpha_dec, beta_dec).

    For an N-layer encoder and M-layer decoder (Wang et al., 2022, Table 1):
    alpha_enc = 0.81 (N^4 M)^(1/16), beta_enc = 0.87 (N^4 M)^(-1/16),
    alpha_dec = (3M)^(1/4),          beta_dec = (12M)^(-1/4).
    """
    n, m = float(encoder_layers), float(decoder_layers)
    alpha_enc = 0.81 * (n**4 * m) ** (1.0 / 16.0)
    beta_enc = 0.87 * (n**4 * m) ** (-1.0 / 16.0)
    alpha_dec = (3.0 * m) ** 0.25
    beta_dec = (12.0 * m) ** -0.25
    return alpha_enc, beta_enc, alpha_dec, beta_dec


EXP_RATE = 5.0
"""k of the exp schedule: alpha_t = exp(-k (1 - t/T))."""
SIGMOID_SLOPE = 10.0
"""s of the sigmoid schedule: alpha_t = 1 / (1 + exp(-s (t/T - 1/2)))."""


def branchnorm_alpha(step: int, total_steps: int, schedule: str = "linear") -> float:
    """BranchNorm's branch factor alpha_t for the update ``step`` (counted from 1).

    With r = step / total_steps (T = ``total_steps``), every schedule is 1.0 for r >= 1:
      linear  (the paper's): alpha_t = min(1, r)
      exp:                   alpha_t = exp(-5 (1 - r))              (e^-5 ~ 0.0067 at r = 0)
      sigmoid:               alpha_t = 1 / (1 + exp(-10 (r - 1/2)))  (~0.0067 at r = 0)
    The exp and sigmoid variants are the paper's Fig. 7 alternatives; both are monotone and
    lie in (0, 1]. Step 0 (before any update) gives 0 for linear.
    """
    if total_steps < 1:
        raise ValueError(f"branchnorm total_steps must be >= 1, got {total_steps}")
    r = max(float(step), 0.0) / float(total_steps)
    if r >= 1.0:
        return 1.0
    if schedule == "linear":
        return r
    if schedule == "exp":
        return math.exp(-EXP_RATE * (1.0 - r))
    if schedule == "sigmoid":
        return 1.0 / (1.0 + math.exp(-SIGMOID_SLOPE * (r - 0.5)))
    raise ValueError(f"unknown branchnorm schedule {schedule!r} (linear, exp, sigmoid)")


def residual_constants(
    scheme: str | Scheme, encoder_layers: int, decoder_layers: int, branch_init: str = "auto"
) -> dict[str, tuple[float, float]]:
    """Per stack ("encoder", "decoder"): (residual alpha, init gain beta) for ``scheme``.

    ``branch_init`` (``model.branch_init``) overrides the scheme's init gain: "deepnet" gives
    DeepNet's beta and "xavier" gain 1 whatever the scheme; "auto" keeps the scheme's own.
    """
    traits = scheme_named(scheme)
    a_enc, b_enc, a_dec, b_dec = deepnorm_constants(encoder_layers, decoder_layers)
    if not traits.deepnet_alpha:  # only DeepNorm up-weights the residual
        a_enc = a_dec = 1.0
    if branch_init == "auto":
        branch_init = "deepnet" if traits.deepnet_init else "xavier"
    if branch_init == "xavier":
        b_enc = b_dec = 1.0
    elif branch_init != "deepnet":
        raise ValueError(f"unknown branch init {branch_init!r} (auto, deepnet, xavier)")
    return {"encoder": (a_enc, b_enc), "decoder": (a_dec, b_dec)}


def stack_constants(cfg: ModelConfig) -> tuple[tuple[float, float], tuple[float, float]]:
    """((DeepNorm alpha, init beta) of the encoder, the same of the decoder) for ``cfg``:
    :func:`residual_constants` of the model config, as the layer constructors take them."""
    consts = residual_constants(
        cfg.residual, cfg.encoder_layers, cfg.decoder_layers, cfg.branch_init
    )
    return consts["encoder"], consts["decoder"]


def branch_scale_at(cfg: ModelConfig, step: int) -> float:
    """BranchNorm's alpha_t for update ``step`` under ``cfg``; 1.0 for the other schemes."""
    if scheme_of(cfg).step_scaled:
        return branchnorm_alpha(step, cfg.branchnorm_steps, cfg.branchnorm_schedule)
    return 1.0


def set_branch_scale(module: nn.Module, cfg: ModelConfig, step: int) -> float:
    """Set alpha_t for update ``step`` on every residual block in ``module`` (a whole model or
    one pipeline stage); returns it.

    BranchNorm blocks read alpha_t from one 0-dim fp32 tensor per ``module``, on its device,
    updated in place (one fill per update, no host sync): a compiled or captured graph sees a
    new value each update instead of a constant baked in at the first. The Python float is
    kept beside it for logging and export. The blocks are found at the first call on
    ``module`` and kept in it (``_residual_blocks``): its Residual blocks are fixed once built
    (code that adds or replaces layers of a built module must drop that list)."""
    alpha = branch_scale_at(cfg, step)
    blocks = module.__dict__.get("_residual_blocks")
    if blocks is None:  # found once: walking the module tree is host time every update
        blocks = [b for b in module.modules() if isinstance(b, Residual)]
        module.__dict__["_residual_blocks"] = blocks  # not a submodule list: no state
    shared = None
    if any(b.scheme.step_scaled for b in blocks):
        device = blocks[0].norm.weight.device
        shared = module.__dict__.get("_branch_scale_tensor")
        if shared is None or shared.device != device:
            shared = torch.zeros((), dtype=torch.float32, device=device)
            module.__dict__["_branch_scale_tensor"] = shared  # not a buffer: no state-dict key
        shared.fill_(alpha)
    for block in blocks:
        tensor = shared if block.scheme.step_scaled else None
        if block.branch_scale != alpha or block.scale_tensor is not tensor:
            block.branch_scale = alpha  # (once alpha_t reaches 1, blocks are left alone)
            block.scale_tensor = tensor
    return alpha


# --------------------------------------------------------------------------------------------
# Initialisation: sublayers declare their projections; nothing here matches names
# --------------------------------------------------------------------------------------------


def xavier_normal_chunks_(
    weight: torch.Tensor, gains: Sequence[float], generator: torch.Generator | None = None
) -> None:
    """Xavier-normal init of a weight stacking len(gains) equal [out/k, in] projections.

    Fans are computed per chunk, so a fused QKV weight gets exactly the init of three
    separate projections: std_i = gain_i * sqrt(2 / (fan_in + fan_out / k)).
    """
    out_features, in_features = weight.shape
    k = len(gains)
    if out_features % k:
        raise ValueError(f"weight of {out_features} rows does not split into {k} chunks")
    rows = out_features // k
    with torch.no_grad():
        for i, gain in enumerate(gains):
            std = gain * math.sqrt(2.0 / float(in_features + rows))
            weight[i * rows : (i + 1) * rows].normal_(0.0, std, generator=generator)


def init_sublayer(sublayer: nn.Module, beta: float, generator: torch.Generator | None) -> None:
    """Initialise a sublayer's projections: gain ``beta`` on branch chunks, 1 elsewhere.

    ``sublayer.projections()`` yields ``(linear, is_branch_per_chunk)``: e.g. a fused QKV
    projection yields ``(qkv, (False, False, True))`` (q, k keep gain 1; v gets beta).
    """
    for linear, branch_chunks in sublayer.projections():
        gains = [beta if is_branch else 1.0 for is_branch in branch_chunks]
        xavier_normal_chunks_(linear.weight, gains, generator)
        if linear.bias is not None:
            with torch.no_grad():
                linear.bias.zero_()


def layer_generator(seed: int, kind: str, index: int) -> torch.Generator:
    """A generator seeded from (seed, kind, index): a layer's init never depends on which
    other layers a process builds (whole model, or any pipeline stage)."""
    kinds = {"embed": 0, "encoder": 1, "decoder": 2}
    mixed = (int(seed) * 1_000_003 + kinds[kind] * 100_003 + int(index) * 7919 + 17) % (2**63 - 1)
    return torch.Generator().manual_seed(mixed)


# --------------------------------------------------------------------------------------------
# LayerNorm: Apex FusedLayerNorm or torch
# --------------------------------------------------------------------------------------------


def apex_layernorm_class() -> type | None:
    """``apex.normalization.FusedLayerNorm`` when NVIDIA Apex is importable, else None."""
    try:
        module = importlib.import_module("apex.normalization")
    except Exception:  # noqa: BLE001 - a missing or broken Apex both mean "not available"
        return None
    return getattr(module, "FusedLayerNorm", None)


def select_layernorm(impl: str, device_type: str) -> str:
    """Which implementation runs for ``impl`` (auto|apex|torch) on ``device_type``.

    auto: Apex on CUDA tensors when importable, else torch. apex: Apex always (Apex itself
    falls back to torch on CPU tensors); an error when not importable.
    """
    if impl == "torch" or (impl == "auto" and device_type != "cuda"):
        return "torch"  # no import attempt: a failed import costs ~0.1 ms per call
    available = apex_layernorm_class() is not None
    if impl == "apex":
        if not available:
            raise RuntimeError(
                "model.layernorm_impl=apex but apex.normalization.FusedLayerNorm is not "
                "importable (build NVIDIA Apex from source; README: Apex)"
            )
        return "apex"
    if impl == "auto":
        return "apex" if available and device_type == "cuda" else "torch"
    raise ValueError(f"unknown layernorm_impl {impl!r} (auto, apex, torch)")


def describe_layernorm(impl: str, device_type: str) -> str:
    """One line for the start-up log: which LayerNorm runs and why."""
    choice = select_layernorm(impl, device_type)
    if choice == "apex":
        return f"LayerNorm: apex FusedLayerNorm (layernorm_impl={impl}, device={device_type})"
    reason = (
        "requested"
        if impl == "torch"
        else ("apex not importable" if apex_layernorm_class() is None else f"device={device_type}")
    )
    return f"LayerNorm: torch.nn.LayerNorm (layernorm_impl={impl}, {reason})"


class LayerNorm(nn.Module):
    """LayerNorm with parameters ``weight``/``bias`` (as torch's), run by Apex or torch."""

    def __init__(self, dim: int, eps: float = 1e-5, impl: str = "auto") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.impl = impl
        self.last_backend = ""
        self._apex: dict[str, nn.Module] = {}  # not a submodule: no duplicate state-dict keys
        self._backend: dict[str, str] = {}  # device type -> "apex" | "torch", decided once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Decided at the first call per device type, not per call: on CUDA without Apex every
        # call would retry the failed import (~30 us, several LNs per layer per micro-batch).
        backend = self._backend.get(x.device.type)
        if backend is None:
            backend = self._backend[x.device.type] = select_layernorm(self.impl, x.device.type)
        self.last_backend = backend
        if backend == "apex":
            fused = self._apex.get("m")
            if fused is None:
                fused = apex_layernorm_class()(self.weight.shape[0], eps=self.eps)
                self._apex["m"] = fused
            fused.weight, fused.bias = self.weight, self.bias
            return fused(x)
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


# --------------------------------------------------------------------------------------------
# The residual block
# --------------------------------------------------------------------------------------------


class Residual(nn.Module):
    """One residual block around a sublayer F, in the configured scheme (its ``Scheme.block``).

    ``forward(x, f)`` takes F as a callable so the caller can pass masks, memory or a cache.
    Parameters (the LN's) are named identically in every scheme, so state dicts of
    postln / deepnorm / branchnorm (and preln) models load into each other.
    """

    def __init__(
        self,
        scheme: str | Scheme,
        dim: int,
        dropout: float,
        deepnorm_alpha: float = 1.0,
        eps: float = 1e-5,
        layernorm_impl: str = "auto",
    ) -> None:
        super().__init__()
        self.scheme = scheme_named(scheme)
        self.norm = LayerNorm(dim, eps, layernorm_impl)
        self.dropout = Dropout(dropout)
        self.deepnorm_alpha = float(deepnorm_alpha)  # DeepNorm's constant residual weight
        self.branch_scale = 1.0  # BranchNorm's alpha_t, set from the step before each update

    @property
    def branch_scale(self) -> float:
        """BranchNorm's alpha_t as a Python float (what logging and export read)."""
        return self._branch_scale

    @branch_scale.setter
    def branch_scale(self, value: float) -> None:
        """Set alpha_t as a constant (tests, export); :func:`set_branch_scale` sets the shared
        0-dim tensor that training reads."""
        self._branch_scale = float(value)
        # a bool, not the float, is what forward branches on: a compiled forward guards on
        # it and recompiles once (at t = T), not at every new alpha_t
        self.scale_is_one = self._branch_scale == 1.0
        self.scale_tensor: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, f: Sublayer) -> torch.Tensor:
        return self.scheme.block(self, x, f)

    def output_scale_for_postln(self) -> float:
        """The factor c with which this block equals Post-LN once F's output is scaled by c.

        LN is invariant to a positive scale of its input (up to epsilon), so
        LN(a x + F(x)) = LN(x + F(x) / a) and LN(x + s F(x)) is Post-LN with F scaled by s.
        """
        if self.scheme.postln_scale is None:
            raise ValueError(f"a {self.scheme.label} block has no Post-LN equivalent")
        return self.scheme.postln_scale(self)


def stack_final_norm(scheme: str | Scheme, dim: int, eps: float, layernorm_impl: str) -> nn.Module:
    """The LN after the last layer of a stack when the scheme has one (``Scheme.final_norm``:
    Pre-LN); an identity otherwise."""
    if scheme_named(scheme).final_norm:
        return LayerNorm(dim, eps, layernorm_impl)
    return nn.Identity()
