"""Memory and time planner for a pipeline run: no model is built, nothing is imported from torch.

    plan = plan_run(load_config("opus100_1000L"), gpus=32, gpu_memory_gb=40)
    print(format_plan(plan))

Per pipeline stage (boundaries from :func:`~megatron_branchnorm.parallel.partition.partition_plan`, the
same call the trainer makes), it estimates in bytes:

* **weights and gradients** -- parameters counted analytically per layer (checked against the
  real ``EncoderLayer``/``DecoderLayer`` in ``tests/slurm/test_planner.py``); the tied
  embedding is held by every stage that has one of ``embed``, ``dec_embed``, ``output``;
* **optimizer state under ZeRO-1** -- fp32 master weights and Adam's two moments, partitioned
  over the data-parallel replicas of the stage;
* **activations** -- per in-flight micro-batch, with and without activation checkpointing.
  DeepSpeed's 1F1B schedule keeps ``min(stages - s, micro_batches)`` micro-batches in flight on
  stage ``s``. Without checkpointing a layer keeps what its forward saves for the backward,
  measured on the model's own layers (:data:`ENC_ACT_BYTES`, :data:`DEC_ACT_BYTES`: per token
  about 8 d + ffn (encoder) or 14 d + ffn (decoder) values of the activation dtype, a one-byte
  dropout mask of width d per dropout (and the FFN's own with ``activation_dropout``), SDPA's
  fp32 log-sum-exp per head and attention; no T x T attention matrix: attention dropout is 0);
  with checkpointing every k layers only each chunk's input is kept, plus one chunk's full
  activations while it is recomputed; both with :data:`ALLOCATOR_MARGIN`;
* **loss workspace** on the last stage -- the logits and their gradient in the activation
  dtype, and one fp32 chunk of logits (model/loss.py works in row chunks);
* a fixed **overhead** (CUDA context, NCCL buffers, allocator fragmentation);
* **CUDA graphs' static buffers** (``model.cuda_graphs``; training/cuda_graphs.py,
  docs/design.md §19) -- not part of the peak: what one *graph set* (a graph of every layer
  range of the stage, for one bucket shape and one micro-batch in flight) keeps between replays,
  the parameter-gradient buffers all of a stage's graphs share (its graphed weights' size,
  once), and how many sets fit in what the planned peak leaves free once the graphs' own
  activation pools (as large as the eager activations; on a recomputing stage one pool of one
  micro-batch's activations of a range, or of a link where the ranges are cut into links:
  :meth:`RunPlan.link_layers`) are set aside (:func:`graph_allowance`).

Precision follows the DeepSpeed JSON the config names (bf16, fp16 or fp32). The pipeline
bubble is ``(p - 1) / (m + p - 1)`` for p stages and m micro-batches per update.

And in seconds (:meth:`RunPlan.stage_time`, :attr:`RunPlan.seconds_per_update`): a stage's
micro-batch takes the slower of its GPU's matmuls at ``--tflops`` and its host's launches, per
eager layer as the H100  ran them (:data:`EAGER_HOST_S`) or, for a layer replayed
from a CUDA graph, its gradients' hand-over; an update of the 1F1B pipeline is each stage's
micro-batch once plus m - 1 more of the slowest stage's. ``tools/plan_memory.py`` prints it
eagerly and with graphs, and what ``train.max_steps`` updates take.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass

from megatron_branchnorm.config import (
    RESIDUAL_SCHEMES,
    ConfigError,
    ExperimentConfig,
    ModelConfig,
)
from megatron_branchnorm.errors import UserError
from megatron_branchnorm.formats.files import (
    MAX_INT,
    MAX_JSON_BYTES,
    FileShapeError,
    read_small_file,
)
from megatron_branchnorm.parallel.partition import partition_plan, spec_entries
from megatron_branchnorm.resources import find_ds_config

GB = 1e9


class PlanError(UserError, ValueError):
    """A bad planner input (a flag out of range, an unreadable size): a one-line message."""


DEFAULT_VOCAB = 64000
TIED_KINDS = ("embed", "dec_embed", "output")

MAX_GRAPHS = 128
"""CUDA graphs a stage captures at most (training/cuda_graphs.py): their memory is bounded
apart (:meth:`RunPlan.graph_allowance`); this bounds the captures' time (each runs its layers
four times) and holds a one-stage run's 48 shapes x 2 layer ranges."""
GRAPHED_KINDS = ("enc", "enc_final", "dec", "dec_final")
"""Entries a graphed layer range may hold (training/cuda_graphs.layer_runs)."""

# What one layer's forward saves for its backward, per token, without checkpointing, measured
# on the model's own layers (tests/slurm/test_planner.py measures it again): (values of the
# activation dtype x d, the same x ffn, one-byte dropout masks x d, fp32 log-sum-exps x heads).
# Before, the planner took Korthikanti et al. 2022's 34 d and 47 d bytes at 16-bit and an
# fp32 log-softmax and gradient for the loss: it planned the H100 run  at 17.2 GiB,
# whose allocator peaked at 9.85 GiB (docs/performance.md, "The planner against the H100").
ENC_ACT_BYTES = (8.125, 1.0, 2.0, 1.0)
DEC_ACT_BYTES = (14.125, 1.0, 3.0, 2.0)
ALLOCATOR_MARGIN = 1.10
"""The activations and the loss workspace are planned 10% above what the tensors hold: the
caching allocator keeps them in blocks cut from larger segments, and micro-batches of up to 48
bucket shapes come and go. A margin, not a measurement: the H100 run measured the allocated
peak only (9.85 GiB, planned now at 10.9 GiB without the fixed overhead); gpu-bench prints the
reserved peak beside it, which is what a next GPU run should set this by."""
CAPTURE_WORK_FFN = 2.0
"""What a graph's memory pool holds beside the activations its forward keeps: the backward's
working set at its peak, while every activation of the range is still live, in FFN-sized
tensors: the gradient of the FFN's hidden state before and after the activation's backward (2
x tokens x ffn) and the FFN's two weight gradients (2 x d x ffn), in the activation's dtype.
Measured as the live peak of what a link's forward and backward allocate (what its capture
allocates in its pool: experiments/graph_pool.py; tests/slurm/test_planner.py at several
widths). The 10% margin alone had a link of a layer or two short: one encoder layer's peaked at
1.45 times its planned pool at d=512, 4,096 tokens (docs/performance.md)."""
LOSS_CHUNK_ELEMENTS = 1 << 24
"""model/loss.py's ``CHUNK_ELEMENTS``: the logits it upcasts to fp32 at a time."""

# What a micro-batch costs in time (:meth:`RunPlan.stage_time`): the GPU's matmuls at the
# sustained rate ``--tflops``, and the host's work, which paces a layer run eagerly at d=512.
DEFAULT_TFLOPS = 100.0
"""The GPU's sustained matmul rate the planner assumes (``--tflops``): an assumption until a GPU
run of the graphed path measures it."""
H100_EAGER_UPDATE_S = 108.4e-3
"""One eager update of 12L-12L (d=512, 4,096 tokens per side, one micro-batch, the 1-stage
DeepSpeed engine, bf16 + ZeRO-1) on the H100  (../shared/DESIGN.md §12): its
2.6 TFLOP of matmuls take 3.4 ms at the measured peak and 16,384 tokens took 125.9 ms, so the
host set this pace. The planner charges all of it to the 24 layers: the update's other host
work (data, embedding, loss, DeepSpeed's schedule, the step; about 2 of 32.5 ms on the
development CPU, docs/performance.md) is counted into them, an upper bound."""
LAYER_LAUNCHES = {"enc": 61, "dec": 101}
"""Kernel-launching ops per layer per micro-batch of opus100_12L with the GPU's dropout
(docs/performance.md, "Kernel launches per layer"): how the host time of a layer
pair splits between its encoder and its decoder layer."""
EAGER_HOST_S = {
    kind: H100_EAGER_UPDATE_S / 12 * n / sum(LAYER_LAUNCHES.values())
    for kind, n in LAYER_LAUNCHES.items()
}
"""Host seconds of one eager layer's forward and backward per micro-batch (3.40 ms encoder,
5.63 ms decoder): :data:`H100_EAGER_UPDATE_S` over 12 layer pairs, split by launches."""
RECOMPUTE_HOST_FACTOR = 1.5
"""What eager recompute (``torch.utils.checkpoint`` of every layer) multiplies a layer's host
time by, measured on the development CPU where the kernels cost nothing: the layers alone
2.14x (``tools/_bench_micro.py --recompute-ab``: 1.36 -> 2.91 ms per encoder + decoder pair,
fastest calls, two runs), and the whole trainer 1.3-2.0x per layer pair over four runs of
``gpu_bench.py --device cpu --systems train.py --tokens 64 --layers 1|12`` at interval 0 and 1
(their wall times move with the machine's load). Recompute repeats a layer's forward and its
checkpoint bookkeeping, not the gradients' hand-over: 1 + 1.55 ms over the trainer's ~2.95 ms
per pair is 1.5."""
PARAM_TENSORS = {"enc": 12, "dec": 20}
"""Parameter tensors of an encoder and a decoder layer (tests/slurm/test_planner.py counts the
real layers')."""
GRAPHED_HOST_S_PER_TENSOR = 3.6e-6
"""Host seconds per parameter tensor per micro-batch of a layer replayed from a CUDA graph: the
gradient's hand-over, which stays eager (DeepSpeed's hook and the multi-tensor fp32 add: 0.5 +
0.87 ms for 12L-12L's 385 tensors on the development CPU, docs/performance.md). A replay's own
launches (a few per layer range) are left out."""
MEAN_SENTENCE_TOKENS = 20
"""Tokens per sentence for the attention's FLOPs (the OPUS-shaped and demo corpora average
15-20, docs/performance.md): at d=512 the attention's share of a layer's FLOPs is ~1%."""


# --------------------------------------------------------------------------------------------
# Parameter counts
# --------------------------------------------------------------------------------------------


def linear_params(fan_in: int, fan_out: int) -> int:
    """Weight plus bias of an ``nn.Linear``."""
    return fan_in * fan_out + fan_out


def encoder_layer_params(m: ModelConfig) -> int:
    """Fused-QKV self-attention, FFN, and one LayerNorm per residual block (2)."""
    d, f = m.hidden_size, m.ffn_hidden_size
    attn = linear_params(d, 3 * d) + linear_params(d, d)
    ffn = linear_params(d, f) + linear_params(f, d)
    return attn + ffn + 2 * (2 * d)


def decoder_layer_params(m: ModelConfig) -> int:
    """The encoder layer plus cross-attention (q, fused kv, out) and its LayerNorm."""
    d = m.hidden_size
    cross = linear_params(d, d) + linear_params(d, 2 * d) + linear_params(d, d)
    return encoder_layer_params(m) + cross + 2 * d


def final_norm_params(m: ModelConfig) -> int:
    """A stack's final LayerNorm, when the scheme ends its stacks with one (Pre-LN; identity
    for the Post-LN family): read from config.RESIDUAL_SCHEMES, as the plan may not import the
    model's registry (docs/design.md §9)."""
    return 2 * m.hidden_size if RESIDUAL_SCHEMES[m.residual].final_norm else 0


def embedding_params(m: ModelConfig) -> int:
    """The shared (V, d) embedding matrix; positions are sinusoidal buffers."""
    return int(m.vocab_size or 0) * m.hidden_size


def entry_params(m: ModelConfig) -> list[int]:
    """Parameters of each entry of the pipeline layer list (the tied embedding counted on
    every entry that uses it)."""
    per_kind = {
        "embed": embedding_params(m),
        "enc": encoder_layer_params(m),
        "enc_final": final_norm_params(m),
        "dec_embed": embedding_params(m),
        "dec": decoder_layer_params(m),
        "dec_final": final_norm_params(m),
        "output": embedding_params(m),
    }
    return [per_kind[e.kind] for e in spec_entries(m)]


def total_params(m: ModelConfig) -> int:
    """Parameters of the whole model, the shared embedding counted once."""
    return (
        m.encoder_layers * encoder_layer_params(m)
        + m.decoder_layers * decoder_layer_params(m)
        + 2 * final_norm_params(m)
        + embedding_params(m)
    )


# --------------------------------------------------------------------------------------------
# Precision
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each state for one DeepSpeed precision mode."""

    name: str
    weights: float  # model weights on the GPU
    grads: float  # gradient buffers (full, not partitioned under ZeRO-1)
    optim: float  # optimizer state (fp32 master + Adam m, v), partitioned over dp under ZeRO-1
    activation: float  # bytes per activation element
    zero_stage: int


def precision_from_ds_config(path: str) -> Precision:
    """Read the precision and ZeRO stage from a DeepSpeed JSON (resources.find_ds_config).

    bf16 (DeepSpeed's BF16_Optimizer, grad_accum_dtype fp32): bf16 weights, bf16 grads plus the
    fp32 accumulation buffer, fp32 master + m + v. fp16 (ZeRO-1 optimizer): fp16 weights and
    grads, fp32 master + m + v + the fp32 gradient partition. fp32: weights, grads, m, v.
    A missing, unreadable or malformed file raises ConfigError naming the key and the file.
    """
    key = "config key train.deepspeed_config"
    p = find_ds_config(path)
    if not p.is_file():
        what = "not a file" if p.exists() else "no such file"
        raise ConfigError(f"{key}: {path}: {what}")
    try:
        ds = json.loads(read_small_file(p, MAX_JSON_BYTES))
    except FileShapeError as exc:  # a FIFO, a device, a huge file: never read without bound
        raise ConfigError(f"{key}: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{key}: {p}: cannot read ({exc.strerror or exc})") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ConfigError(f"{key}: {p}: not valid JSON ({' '.join(str(exc).split())})") from None
    if not isinstance(ds, dict):
        raise ConfigError(f"{key}: {p}: expected a JSON object, got {type(ds).__name__}")
    sections = {}
    for name in ("zero_optimization", "bf16", "fp16"):
        section = ds.get(name, {})
        if not isinstance(section, dict):
            raise ConfigError(f"{key}: {p}: {name} must be an object, got {section!r:.60}")
        sections[name] = section
    stage = sections["zero_optimization"].get("stage", 0)
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage <= 3:
        raise ConfigError(f"{key}: {p}: zero_optimization.stage must be 0..3, got {stage!r:.60}")
    if sections["bf16"].get("enabled"):
        return Precision("bf16", 2, 2 + 4, 12, 2, stage)
    if sections["fp16"].get("enabled"):
        return Precision("fp16", 2, 2, 16, 2, stage)
    return Precision("fp32", 4, 4, 8, 4, stage)


def matmul_flops(
    enc_layers: int,
    dec_layers: int,
    dim: int,
    ffn: int,
    vocab: int,
    src_tokens: float,
    tgt_tokens: float,
    sentences: float,
) -> float:
    """Model FLOPs of one training pass (forward + backward = 3x the forward's matmuls) over
    ``sentences`` sentence pairs holding ``src_tokens`` source and ``tgt_tokens`` target tokens
    in all: every weight matmul, the attention scores and weighted values at the mean sentence
    lengths, the output projection; not the embedding lookup, not the elementwise work and not
    a recompute (the model-FLOPs convention of PaLM, Chowdhery et al. 2022, appendix B, which
    counts the work the model needs, whatever the implementation repeats)."""
    ls = src_tokens / sentences if sentences else 0.0
    lt = tgt_tokens / sentences if sentences else 0.0
    d, f = dim, ffn
    enc = src_tokens * enc_layers * (2 * (4 * d * d + 2 * d * f) + 4 * ls * d)
    dec = tgt_tokens * dec_layers * (2 * (6 * d * d + 2 * d * f) + 4 * lt * d + 4 * ls * d)
    cross_kv = src_tokens * dec_layers * 2 * 2 * d * d  # the cross-attention's keys and values
    out = tgt_tokens * 2 * d * vocab
    return 3.0 * (enc + dec + cross_kv + out)


def training_flops(m: ModelConfig, src_tokens: float, tgt_tokens: float, sentences: float) -> float:
    """:func:`matmul_flops` of model ``m`` (its vocabulary set): what train.py's
    ``tflops_per_gpu`` counts for the real tokens of an update."""
    return matmul_flops(
        m.encoder_layers,
        m.decoder_layers,
        m.hidden_size,
        m.ffn_hidden_size,
        m.vocab_size or 0,
        src_tokens,
        tgt_tokens,
        sentences,
    )


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------


@dataclass
class StagePlan:
    """Estimated memory of one pipeline stage (bytes)."""

    stage: int
    entries: tuple[int, int]  # first, last index in the layer list
    encoder_layers: int
    decoder_layers: int
    params: int
    weights_grads: float
    optimizer: float
    in_flight: int
    act_no_ckpt: float
    act_ckpt: float
    loss_workspace: float
    graph_set_bytes: float = 0.0
    """Static bytes of one graph set (module docstring): each layer range's inputs, outputs and
    their gradients at ``micro_batch_tokens``."""
    graph_grad_bytes: float = 0.0
    """The shared parameter-gradient buffers of the stage's graphs (its graphed weights)."""
    layer_ranges: int = 0
    """Runs of encoder/decoder layers (with their final norms) a graph set captures."""
    graph_links: tuple[tuple[int, float, float], ...] = ()
    """Per layer range: (its layers, one micro-batch's activations of one of them, the static
    bytes each further link adds where a recomputing stage cuts the range into links)."""
    capture_work: float = 0.0
    """What a graph pool holds beside a micro-batch's activations: the backward's working set
    (:data:`CAPTURE_WORK_FFN`), with the allocator's margin; 0 without a layer range."""
    flops: float = 0.0
    """Matmul FLOPs of one micro-batch's forward and backward on the stage, recompute left out
    (:func:`matmul_flops` of its layers, and the output projection on the last stage)."""
    recompute_flops: float = 0.0
    """What recompute adds: the forward of its layers (a third of theirs; not the output's)."""

    def total(self, checkpointing: bool, overhead: float) -> float:
        """Peak estimate with or without activation checkpointing."""
        act = self.act_ckpt if checkpointing else self.act_no_ckpt
        return self.weights_grads + self.optimizer + act + self.loss_workspace + overhead


@dataclass
class RunPlan:
    """A whole run: topology, per-stage estimates and the verdict."""

    config_name: str
    model: ModelConfig
    gpus: int
    gpu_memory: float
    stages: int
    dp: int
    micro_batches: int
    micro_batch_tokens: int
    checkpoint_interval: int | str  # "auto": per stage (stage_checkpoints)
    precision: Precision
    overhead: float
    stage_plans: list[StagePlan]
    tflops: float
    graph_shapes: int = 0
    """Bucket shapes a stage graphs (the most ``data.bucket_shapes`` allows) when the config
    turns ``model.cuda_graphs`` on or auto; 0 leaves graphs out of :func:`format_plan`."""
    max_steps: int = 0
    """``train.max_steps``: the updates the run's time is given for."""
    bucket_shapes: int = 0
    """The most bucket shapes ``data.bucket_shapes`` allows, graphs or not: what graphs would
    capture, for the time with CUDA graphs (:meth:`graphed`); 0 leaves that time out."""
    graph_link_layers: int | str = "auto"
    """``model.cuda_graph_link_layers``: the most layers a link of a recomputing stage's graphs
    holds (0: whole ranges; "auto": :meth:`link_layers` chooses)."""

    @property
    def total_params(self) -> int:
        """Parameters of the model (embedding once)."""
        return total_params(self.model)

    @property
    def bubble(self) -> float:
        """Idle fraction of the 1F1B pipeline: (p - 1) / (m + p - 1)."""
        p, m = self.stages, self.micro_batches
        return (p - 1) / (m + p - 1)

    def stage_checkpoints(self, stage: StagePlan) -> bool:
        """Whether ``stage`` recomputes its layers: as configured, or under "auto" when it does
        not fit one GPU without, or when with its CUDA graphs (``graph_shapes`` > 0) it runs its
        micro-batches faster recomputing than not (:meth:`graphs_pay`)."""
        if self.checkpoint_interval == "auto":
            return self._must_recompute(stage) or self.graphs_pay(stage)
        return self.checkpoint_interval > 0

    def _must_recompute(self, stage: StagePlan) -> bool:
        """Whether ``stage`` does not fit one GPU without recompute."""
        return stage.total(False, self.overhead) > self.gpu_memory

    def recomputes_for_graphs(self, stage: StagePlan) -> bool:
        """Whether ``stage`` recomputes under "auto" for its graphs alone (it fits without)."""
        return (
            self.checkpoint_interval == "auto"
            and not self._must_recompute(stage)
            and self.graphs_pay(stage)
        )

    def graphs_pay(self, stage: StagePlan) -> bool:
        """Whether a stage that fits without recompute should still recompute so that its CUDA
        graphs cover more of its micro-batches (docs/design.md §19, "Recompute for the graphs"):
        recomputing, a stage wants one graph set per shape instead of one per shape and
        micro-batch in flight, and its pool holds one micro-batch's activations instead of a
        second copy of them all. A micro-batch a graph does not cover runs its layers eagerly,
        which the host paces at several times the GPU's time for them, where recompute adds
        one forward (a third of a layer's GPU time): it pays where the stage's micro-batch is
        then faster (:meth:`stage_time`); on a tie (every micro-batch replays either way) it
        does not. Judged at :data:`DEFAULT_TFLOPS`, as the trainer plans, whatever ``--tflops``
        the time is shown at."""
        if not self.graph_shapes:
            return False
        with_, without = (self._stage_time(stage, r, DEFAULT_TFLOPS) for r in (True, False))
        return with_.seconds < without.seconds

    @property
    def checkpointing(self) -> bool:
        """Whether some stage checkpoints activations."""
        return any(self.stage_checkpoints(s) for s in self.stage_plans)

    def peak(self, checkpointing: bool | None = None) -> float:
        """Largest per-GPU estimate over the stages (None: each stage as configured)."""
        return max(
            s.total(
                self.stage_checkpoints(s) if checkpointing is None else checkpointing, self.overhead
            )
            for s in self.stage_plans
        )

    def fits(self, checkpointing: bool | None = None) -> bool:
        """Whether every stage's estimate fits in one GPU's memory."""
        return self.peak(checkpointing) <= self.gpu_memory

    def graph_allowance(self, stage: StagePlan) -> float:
        """Bytes ``stage``'s CUDA graphs may keep in static buffers: one GPU less the stage's
        planned peak as configured, less what the graphs' memory pools hold apart from the
        eager allocator's: a second copy of the in-flight activations, or on a stage that
        recomputes, one micro-batch's activations of its largest link (training/cuda_graphs.py,
        "Recompute" and "Links"; :meth:`link_layers`)."""
        recompute = self.stage_checkpoints(stage)
        return self._allowance(stage, recompute, self.link_layers(stage) if recompute else 0)

    def _allowance(self, stage: StagePlan, recompute: bool, link_layers: int = 0) -> float:
        if recompute:
            pool = self._pool(stage, link_layers)
            free = self.gpu_memory - stage.total(True, self.overhead) - pool
        else:  # each slot's pool: its micro-batch's activations and its backward's working set
            pools = stage.act_no_ckpt + stage.in_flight * stage.capture_work
            free = self.gpu_memory - stage.total(False, self.overhead) - pools
        return max(0.0, free)

    @staticmethod
    def _pool(stage: StagePlan, link_layers: int) -> float:
        """What a recomputing stage's one graph pool holds: one micro-batch's activations of
        its largest link (links of at most ``link_layers`` layers, as even as they go; 0: a
        whole range), which only lives from its recompute to its backward, and the backward's
        working set (:attr:`StagePlan.capture_work`)."""
        return stage.capture_work + max(
            (math.ceil(n / link_count(n, link_layers)) * act for n, act, _ in stage.graph_links),
            default=stage.act_no_ckpt / max(stage.in_flight, 1),
        )

    def set_bytes(self, stage: StagePlan, link_layers: int) -> float:
        """Static bytes of one graph set whose ranges are cut into links of at most
        ``link_layers`` layers (0: one link a range)."""
        more = sum((link_count(n, link_layers) - 1) * b for n, _, b in stage.graph_links)
        return stage.graph_set_bytes + more

    def graph_sets(self, stage: StagePlan) -> tuple[int, int]:
        """(graph sets ``stage`` needs: every bucket shape times every micro-batch in flight,
        or every shape once on a stage that recomputes; graph sets its allowance holds), the
        latter also capped by the graph count (:data:`MAX_GRAPHS` per stage)."""
        return self._graph_sets(stage, self.stage_checkpoints(stage))

    def _graph_sets(self, stage: StagePlan, recompute: bool) -> tuple[int, int]:
        if recompute:
            return self._links(stage)[1]
        return self._sets(stage, False, 0)

    def _sets(self, stage: StagePlan, recompute: bool, link_layers: int) -> tuple[int, int]:
        slots = 1 if recompute else stage.in_flight
        wanted = self.graph_shapes * slots
        if not stage.graph_set_bytes or not stage.layer_ranges:
            return wanted, 0
        room = self._allowance(stage, recompute, link_layers) - stage.graph_grad_bytes
        fit = int(max(room, 0.0) // self.set_bytes(stage, link_layers))
        return wanted, min(fit, MAX_GRAPHS // stage.layer_ranges, wanted)

    def link_layers(self, stage: StagePlan) -> int:
        """Layers per link of ``stage``'s graphs (docs/design.md §19, "Links"): 0 (one link a
        range) unless the stage recomputes and its graphs cover more shapes cut shorter, or
        ``model.cuda_graph_link_layers`` sets it."""
        return self._links(stage)[0] if self.stage_checkpoints(stage) else 0

    def _links(self, stage: StagePlan) -> tuple[int, tuple[int, int]]:
        """(layers per link, its graph sets) of a recomputing ``stage``: the cut whose graphs
        cover the most shapes, the fewest links on a tie. Shorter links need a smaller pool
        (one link's activations) and more static buffers (each link's output and input
        gradients, per shape)."""
        longest = max((n for n, _, _ in stage.graph_links), default=0)
        if self.graph_link_layers != "auto":  # as configured; as long as a range: whole ranges
            layers = int(self.graph_link_layers)
            layers = 0 if layers >= longest else layers
            return layers, self._sets(stage, True, layers)
        best = (0, self._sets(stage, True, 0))
        for layers in _link_lengths(stage):
            if layers >= longest:
                continue  # one link a range: tried first
            sets = self._sets(stage, True, layers)
            if sets[1] > best[1][1]:
                best = (layers, sets)
            if best[1][1] >= best[1][0]:
                break  # every shape fits: shorter links only add links
        return best

    @property
    def tokens_per_update(self) -> int:
        """Tokens (source side, padded) per optimizer update over all replicas."""
        return self.micro_batch_tokens * self.micro_batches * self.dp

    @property
    def flops_per_update(self) -> float:
        """Model FLOPs of an update's forward and backward over all replicas (every stage's
        :attr:`StagePlan.flops` per micro-batch; padding counted, recompute not)."""
        return sum(s.flops for s in self.stage_plans) * self.micro_batches * self.dp

    def checkpoint_bytes(self) -> tuple[float, float]:
        """(whole checkpoint, largest rank's share): weights in the training dtype from one
        replica per stage, plus fp32 master weights and Adam moments from every ZeRO-1 shard."""
        saved_optim = 8.0 if self.precision.name == "fp32" else 12.0
        shards = self.dp if self.precision.zero_stage >= 1 else 1
        total = sum(s.params for s in self.stage_plans) * self.precision.weights
        total += self.total_params * saved_optim
        per_rank = max(
            s.params * (self.precision.weights + saved_optim / shards) for s in self.stage_plans
        )
        return total, per_rank

    def stage_time(self, stage: StagePlan) -> StageTime:
        """One micro-batch's forward and backward on ``stage`` as this plan runs it: the
        matmuls at :attr:`tflops` (and the layers' forward again where the stage recomputes)
        and the host's
        launches, :data:`EAGER_HOST_S` per eager layer (x :data:`RECOMPUTE_HOST_FACTOR`
        recomputing) or :data:`GRAPHED_HOST_S_PER_TENSOR` per parameter tensor of a layer a
        graph replays. With graphs (``graph_shapes`` set) the share of micro-batches they cover
        (:meth:`graph_sets`) replays and the rest runs eagerly, each at its own pace."""
        return self._stage_time(stage, self.stage_checkpoints(stage), self.tflops)

    def stage_flops(self, stage: StagePlan) -> float:
        """The matmul FLOPs ``stage``'s GPU runs per micro-batch as this plan runs it: its
        forward and backward, and its layers' forward again where it recomputes."""
        return self._stage_flops(stage, self.stage_checkpoints(stage))

    @staticmethod
    def _stage_flops(stage: StagePlan, recompute: bool) -> float:
        return stage.flops + (stage.recompute_flops if recompute else 0.0)

    def _stage_time(self, stage: StagePlan, recompute: bool, tflops: float) -> StageTime:
        gpu = self._stage_flops(stage, recompute) / (tflops * 1e12)
        layers = {"enc": stage.encoder_layers, "dec": stage.decoder_layers}
        eager = sum(n * EAGER_HOST_S[k] for k, n in layers.items())
        eager *= RECOMPUTE_HOST_FACTOR if recompute else 1.0
        if not self.graph_shapes:
            return StageTime(gpu, eager, max(gpu, eager))
        graphed = sum(n * PARAM_TENSORS[k] for k, n in layers.items()) * GRAPHED_HOST_S_PER_TENSOR
        c = _covered(self._graph_sets(stage, recompute))
        pace = c * max(gpu, graphed) + (1.0 - c) * max(gpu, eager)
        return StageTime(gpu, c * graphed + (1.0 - c) * eager, pace)

    @property
    def seconds_per_update(self) -> float:
        """One update of the 1F1B pipeline: each stage's micro-batch time once (filling and
        draining) plus m - 1 more of the slowest stage's, which paces the steady state (equal
        stages: (m + p - 1) x t). Left out: the optimizer step, the data-parallel reductions
        and the sends between stages."""
        times = [self.stage_time(s).seconds for s in self.stage_plans]
        return sum(times) + (self.micro_batches - 1) * max(times)

    def with_shapes(self, shapes: int, graphs: bool) -> RunPlan:
        """This plan for data of up to ``shapes`` bucket shapes (``data.bucket_shapes``), whose
        stages capture CUDA graphs of them where ``graphs`` (``model.cuda_graphs`` not off)."""
        return dataclasses.replace(self, bucket_shapes=shapes, graph_shapes=shapes if graphs else 0)

    def graphed(self) -> RunPlan | None:
        """This plan with CUDA graphs of every bucket shape (``model.cuda_graphs=on``; under
        ``activation_checkpoint_interval: auto`` a stage may then recompute for its graphs),
        or None without bucket shapes (dynamic shapes are not graphed)."""
        shapes = self.graph_shapes or self.bucket_shapes
        return dataclasses.replace(self, graph_shapes=shapes) if shapes else None


@dataclass(frozen=True)
class StageTime:
    """Seconds of one micro-batch's forward and backward on a stage (:meth:`RunPlan.stage_time`)."""

    gpu: float
    """The GPU's work: matmul FLOPs at the sustained rate."""
    host: float
    """The host's: launching it (on average over eager and replayed micro-batches)."""
    seconds: float
    """The stage's pace: the slower of the two, micro-batch by micro-batch (the host runs
    ahead of the GPU as long as nothing syncs: one host sync per update)."""


def link_count(layers: int, link_layers: int) -> int:
    """Links a range of ``layers`` layers is cut into, at most ``link_layers`` each (0: one),
    as even as they go (training/cuda_graphs.link_parts cuts by it)."""
    return max(1, math.ceil(layers / link_layers)) if link_layers > 0 else 1


def _link_lengths(stage: StagePlan) -> list[int]:
    """The link lengths worth trying on ``stage``, longest first: each ceil(n / k) of a range
    of n layers cut into k links."""
    return _lengths(tuple(n for n, _, _ in stage.graph_links))


@functools.cache
def _lengths(ranges: tuple[int, ...]) -> list[int]:
    return sorted({math.ceil(n / k) for n in ranges for k in range(1, n + 1)}, reverse=True)


def _covered(sets: tuple[int, int]) -> float:
    """The share of a stage's (shape, micro-batch) pairs its graphs replay: fit / wanted."""
    wanted, fit = sets
    return fit / wanted if wanted else 0.0


def parse_memory(text: str, flag: str = "--gpu-memory", allow_zero: bool = False) -> float:
    """'80GB', '40G', '79.6GiB' or a plain number of GB -> bytes; anything else, a
    non-finite, negative (or, unless ``allow_zero``, zero) size raises PlanError naming
    ``flag``."""
    t = str(text).strip().upper()
    number, unit = t, GB
    for suffix, size in (("GIB", 2**30), ("GB", GB), ("G", GB), ("MIB", 2**20), ("MB", 1e6)):
        if t.endswith(suffix):
            number, unit = t[: -len(suffix)], size
            break
    try:
        value = float(number) * unit
    except ValueError:
        raise PlanError(
            f"{flag} {text!r:.60}: expected a size such as 80GB, 40G, 79.6GiB or 512MB"
        ) from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise PlanError(f"{flag} {text!r:.60}: must be a finite size {bound}")
    return value


def _check_count(value: int | None, flag: str) -> None:
    if value is not None and (isinstance(value, bool) or not 1 <= value <= MAX_INT):
        raise PlanError(f"{flag} must be an integer in [1, {MAX_INT}], got {value!r}")


def layer_activation_bytes(
    m: ModelConfig, per_token: tuple[float, float, float, float], act_bytes: float
) -> float:
    """Bytes one layer keeps for its backward per token (:data:`ENC_ACT_BYTES` or
    :data:`DEC_ACT_BYTES`) with activations of ``act_bytes`` bytes: the dropout masks only
    with ``model.dropout`` > 0; ``model.activation_dropout`` > 0 adds the FFN's own mask and
    its dropped output (measured the same way)."""
    values_d, values_ffn, masks_d, lse_heads = per_token
    d, ffn = m.hidden_size, m.ffn_hidden_size
    values = (values_d * d + values_ffn * ffn) * act_bytes
    masks = masks_d * d if m.dropout > 0 else 0.0
    if m.activation_dropout > 0:
        masks += (act_bytes + 1) * ffn
    return values + masks + 4 * lse_heads * m.num_attention_heads


def capture_work(m: ModelConfig, tokens: int, act_bytes: float) -> float:
    """Bytes of a graph backward's working set for one micro-batch of ``tokens`` tokens beside
    the activations (:data:`CAPTURE_WORK_FFN`), with the allocator's margin."""
    ffn_sized = tokens + m.hidden_size  # the hidden state's gradients, the weights' gradients
    return CAPTURE_WORK_FFN * ffn_sized * m.ffn_hidden_size * act_bytes * ALLOCATOR_MARGIN


def _activation_bytes(
    m: ModelConfig, enc: int, dec: int, tokens: int, act_bytes: float, interval: int
) -> tuple[float, float]:
    """(without, with checkpointing) activation bytes of one micro-batch on one stage."""
    d = m.hidden_size
    enc_full = tokens * layer_activation_bytes(m, ENC_ACT_BYTES, act_bytes)
    dec_full = tokens * layer_activation_bytes(m, DEC_ACT_BYTES, act_bytes)
    without = (enc * enc_full + dec * dec_full) * ALLOCATOR_MARGIN
    if interval <= 0:
        return without, without
    layers = enc + dec
    chunks = math.ceil(layers / interval) if layers else 0
    kept = chunks * tokens * d * act_bytes  # each chunk's input; memory is one shared tensor
    kept += (tokens * d * act_bytes) if dec else 0  # the encoder output travelling along
    one_chunk = min(interval, layers) * max(enc_full if enc else 0.0, dec_full if dec else 0.0)
    return without, (kept + one_chunk) * ALLOCATOR_MARGIN


def _graph_set(
    m: ModelConfig,
    kinds: list[str],
    params: list[int],
    tokens: int,
    prec: Precision,
    layer_act: dict[str, float],
) -> tuple[float, float, tuple[tuple[int, float, float], ...]]:
    """(static bytes of one graph set, shared gradient bytes, per layer range
    :attr:`StagePlan.graph_links`) of a stage whose entries are ``kinds`` with ``params`` each:
    per range its hidden states in, out and both gradients, the decoder's encoder output in
    and its gradient, the int64 token ids passed along, and for each further link its output
    and its input gradients (training/cuda_graphs.static_bytes); once, its parameters' gradient
    buffers (in the weights' dtype, as ``torch.autograd.grad`` returns them). ``layer_act``:
    one micro-batch's activations of an "enc" and of a "dec" layer."""
    hidden = tokens * m.hidden_size * prec.activation
    total, grads, ranges, run = 0.0, 0.0, [], []
    for kind, n in [*zip(kinds, params, strict=True), ("", 0)]:
        if kind in GRAPHED_KINDS:
            run.append((kind, n))
            continue
        layers = sum(k in ("enc", "dec") for k, _ in run)
        if layers:
            decoder = any(k == "dec" for k, _ in run)  # (x, memory, src) in; else (x, src, prev)
            grads += sum(n for _, n in run) * prec.weights
            total += 4 * hidden
            total += 2 * hidden + tokens * 8 if decoder else 2 * tokens * 8
            per_link = (3 if decoder else 2) * hidden
            ranges.append((layers, layer_act["dec" if decoder else "enc"], per_link))
        run = []
    return total, grads, tuple(ranges)


def plan_run(
    cfg: ExperimentConfig,
    gpus: int,
    gpu_memory: float,
    stages: int | None = None,
    micro_batch_tokens: int | None = None,
    micro_batches: int | None = None,
    vocab_size: int | None = None,
    overhead: float = 3 * GB,
    tflops: float = DEFAULT_TFLOPS,
    config_name: str = "",
) -> RunPlan:
    """Plan ``cfg`` on ``gpus`` GPUs of ``gpu_memory`` bytes (see the module docstring)."""
    for value, flag in (
        (gpus, "--gpus"),
        (stages, "--stages"),
        (micro_batch_tokens, "--micro-batch-tokens"),
        (micro_batches, "--micro-batches"),
        (vocab_size, "--vocab-size"),
    ):
        _check_count(value, flag)
    for value, flag, low in ((gpu_memory, "--gpu-memory", 0.0), (tflops, "--tflops", 0.0)):
        if not (math.isfinite(value) and value > low):
            raise PlanError(f"{flag} must be a finite number > {low:g}, got {value!r}")
    if not (math.isfinite(overhead) and overhead >= 0):
        raise PlanError(f"--overhead must be a finite size >= 0, got {overhead!r}")
    vocab = cfg.model.vocab_size or vocab_size or DEFAULT_VOCAB
    m = dataclasses.replace(cfg.model, vocab_size=vocab)
    p = stages if stages is not None else cfg.pipeline.stages
    if gpus % p:
        raise ConfigError(
            f"config key pipeline.stages: {p} stages do not divide {gpus} GPUs "
            f"(try --stages with a divisor of {gpus}, or --stages auto)"
        )
    dp = gpus // p
    tokens = micro_batch_tokens if micro_batch_tokens is not None else cfg.data.max_tokens
    mb = micro_batches if micro_batches is not None else cfg.train.micro_batches
    prec = precision_from_ds_config(cfg.train.deepspeed_config)
    interval = cfg.pipeline.activation_checkpoint_interval
    parts = partition_plan(m, p, cfg.pipeline.partition)
    entries = spec_entries(m)
    params = entry_params(m)
    plans = []
    for s in range(p):
        chunk = range(parts[s], parts[s + 1])
        kinds = [entries[i].kind for i in chunk]
        n_params = sum(params[i] for i in chunk if entries[i].kind not in TIED_KINDS)
        if any(k in TIED_KINDS for k in kinds):
            n_params += embedding_params(m)  # one tied copy per stage that uses it
        enc, dec = kinds.count("enc"), kinds.count("dec")
        optim_div = dp if prec.zero_stage >= 1 else 1
        in_flight = min(p - s, mb)
        without, _ = _activation_bytes(m, enc, dec, tokens, prec.activation, 0)
        # "with checkpointing" for a config that has none is reported at interval 1
        every = interval if isinstance(interval, int) and interval > 0 else 1
        _, with_ckpt = _activation_bytes(m, enc, dec, tokens, prec.activation, every)
        sentences = tokens / MEAN_SENTENCE_TOKENS
        d, f = m.hidden_size, m.ffn_hidden_size
        layer_flops = matmul_flops(enc, dec, d, f, 0, tokens, tokens, sentences)
        output_flops = matmul_flops(0, 0, d, f, vocab, tokens, tokens, sentences)
        output_flops *= "output" in kinds
        layer_act = {  # one micro-batch's activations of one layer
            k: _activation_bytes(m, k == "enc", k == "dec", tokens, prec.activation, 0)[0]
            for k in ("enc", "dec")
        }
        graph_bytes, graph_grads, ranges = _graph_set(
            m, kinds, [params[i] for i in chunk], tokens, prec, layer_act
        )
        loss = 0.0
        if "output" in kinds:  # logits and their gradient (act dtype), one fp32 chunk
            loss = (
                tokens * vocab * 2 * prec.activation + min(tokens * vocab, LOSS_CHUNK_ELEMENTS) * 4
            )
            loss *= ALLOCATOR_MARGIN
        plans.append(
            StagePlan(
                stage=s,
                entries=(parts[s], parts[s + 1] - 1),
                encoder_layers=enc,
                decoder_layers=dec,
                params=n_params,
                weights_grads=n_params * (prec.weights + prec.grads),
                optimizer=n_params * prec.optim / optim_div,
                in_flight=in_flight,
                act_no_ckpt=in_flight * without,
                act_ckpt=in_flight * with_ckpt,
                loss_workspace=loss,
                graph_set_bytes=graph_bytes,
                graph_grad_bytes=graph_grads,
                layer_ranges=len(ranges),
                graph_links=ranges,
                capture_work=capture_work(m, tokens, prec.activation) if ranges else 0.0,
                flops=layer_flops + output_flops,
                recompute_flops=layer_flops / 3.0,
            )
        )
    return RunPlan(
        config_name=config_name,
        model=m,
        gpus=gpus,
        gpu_memory=gpu_memory,
        stages=p,
        dp=dp,
        micro_batches=mb,
        micro_batch_tokens=tokens,
        checkpoint_interval=interval,
        graph_link_layers=cfg.model.cuda_graph_link_layers,
        precision=prec,
        overhead=overhead,
        stage_plans=plans,
        tflops=tflops,
        max_steps=cfg.train.max_steps,
    )


def stage_plan(
    cfg: ExperimentConfig, world: int, device_memory: float, graph_shapes: int = 0
) -> RunPlan:
    """The plan the trainer follows for ``cfg`` on ``world`` ranks of ``device_memory`` bytes;
    ``graph_shapes`` > 0: the stages capture CUDA graphs (training/cuda_graphs.py) of up to
    that many bucket shapes."""
    plan = plan_run(cfg, world, device_memory, stages=cfg.pipeline.stages)
    return dataclasses.replace(plan, graph_shapes=graph_shapes)


def auto_checkpoint_interval(
    cfg: ExperimentConfig, world: int, stage: int, device_memory: float, graph_shapes: int = 0
) -> int:
    """``pipeline.activation_checkpoint_interval`` for ``stage`` of ``cfg`` on ``world``
    ranks with ``device_memory`` bytes each: the configured interval, or under "auto" 1 when
    the planner says the stage does not fit without recompute, or when with the CUDA graphs of
    ``graph_shapes`` shapes it runs its micro-batches faster recomputing
    (:meth:`RunPlan.graphs_pay`), else 0 (recompute costs a forward pass and its kernel
    launches: docs/design.md §14)."""
    interval = cfg.pipeline.activation_checkpoint_interval
    if interval != "auto":
        return int(interval)
    plan = stage_plan(cfg, world, device_memory, graph_shapes)
    return int(plan.stage_checkpoints(plan.stage_plans[stage]))


def graph_allowance(
    cfg: ExperimentConfig, world: int, stage: int, device_memory: float, graph_shapes: int
) -> float:
    """Bytes of static buffers ``stage``'s CUDA graphs of up to ``graph_shapes`` shapes may
    keep on a device of ``device_memory`` bytes (:meth:`RunPlan.graph_allowance`, with the
    recompute :func:`auto_checkpoint_interval` chooses for the same shapes): the trainer's
    bound on them (training/cuda_graphs.install), so that graphs never take what the planned
    run needs."""
    plan = stage_plan(cfg, world, device_memory, graph_shapes)
    return plan.graph_allowance(plan.stage_plans[stage])


def stage_counts(cfg: ExperimentConfig, gpus: int) -> list[int]:
    """The stage counts that divide ``gpus`` and that the model can be cut into, fewest first
    (the smallest bubble first)."""
    layers = cfg.model.encoder_layers + cfg.model.decoder_layers + 1
    # Only stage counts up to the layer count can be tried: never loop up to --gpus.
    return [k for k in range(1, min(gpus, layers) + 1) if gpus % k == 0]


def auto_stages(
    cfg: ExperimentConfig,
    gpus: int,
    gpu_memory: float,
    per_update: int | None = None,
    **kwargs,
) -> RunPlan:
    """The plan with the fewest stages (smallest bubble) among divisors of ``gpus`` that fits;
    the largest stage count if none does. With ``per_update`` (the global batch in
    micro-batches, training/layout.global_batch) only the stage counts whose data-parallel
    size divides it are tried, each replica taking its share; ConfigError when none can."""
    return first_fitting(layout_plans(cfg, gpus, gpu_memory, per_update, **kwargs))


def first_fitting(plans: list[RunPlan]) -> RunPlan:
    """The first of ``plans`` (fewest stages first) that fits, or the last when none does."""
    return next((p for p in plans if p.fits()), plans[-1])


def layout_plans(
    cfg: ExperimentConfig,
    gpus: int,
    gpu_memory: float,
    per_update: int | None = None,
    **kwargs,
) -> list[RunPlan]:
    """A plan per stage count :func:`auto_stages` may take, fewest stages first (with
    ``per_update``, each replica taking its share of it); ConfigError when there is none."""
    _check_count(gpus, "--gpus")
    plans = []
    for p in stage_counts(cfg, gpus):
        if per_update is not None:
            if per_update % (gpus // p):
                continue
            kwargs["micro_batches"] = per_update // (gpus // p)
        plans.append(plan_run(cfg, gpus, gpu_memory, stages=p, **kwargs))
    if not plans and per_update is not None:
        raise ConfigError(
            f"--stages auto: no stage count that divides {gpus} GPUs has a data-parallel size "
            f"that divides the {per_update} micro-batches per update to keep (training/layout.py)"
        )
    if not plans:
        raise ConfigError(f"no stage count divides {gpus} GPUs")
    return plans


def format_layouts(plans: list[RunPlan], chosen: RunPlan) -> str:
    """The layouts :func:`layout_plans` tried, with whether each fits and its time per update
    eagerly and with CUDA graphs (:attr:`RunPlan.seconds_per_update`), and the fastest that
    fits each way: ``--stages auto`` takes the fewest stages that fit (the smallest bubble),
    which is not always the fastest (a deep stage's graphs may find no room, and eager host
    work is split between the stages of a pipeline)."""
    lines = [
        f"layouts of {chosen.gpus} GPUs (--stages auto takes the fewest stages that fit; time "
        "per update as above):",
        "",
        "| stages x data-parallel | micro-batches per replica | peak per GPU GB | eager s per "
        "update | CUDA graphs s per update |",
        "|---|---:|---:|---:|---:|",
    ]
    fastest: dict[str, tuple[float, RunPlan]] = {}
    for plan in plans:
        eager, graphed = dataclasses.replace(plan, graph_shapes=0), plan.graphed()
        times = {"eager": eager.seconds_per_update}
        if graphed is not None:
            times["with CUDA graphs"] = graphed.seconds_per_update
        if plan.fits():
            for way, t in times.items():
                if way not in fastest or t < fastest[way][0]:
                    fastest[way] = (t, plan)
        fit = _gb(plan.peak()) + ("" if plan.fits() else " (does not fit)")
        mark = " (taken)" if plan is chosen else ""
        graph_cell = f"{times['with CUDA graphs']:.3g}" if graphed is not None else "-"
        lines.append(
            f"| {plan.stages} x {plan.dp}{mark} | {plan.micro_batches} | {fit} | "
            f"{times['eager']:.3g} | {graph_cell} |"
        )
    if fastest:
        best = [f"{way} {p.stages} x {p.dp} (~{t:.3g} s)" for way, (t, p) in fastest.items()]
        lines += ["", "the fastest that fits: " + "; ".join(best)]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def _gb(x: float) -> str:
    return f"{x / GB:.2f}"


def _describe_checkpointing(plan: RunPlan) -> str:
    if plan.checkpoint_interval == "auto":
        memory = [s.stage for s in plan.stage_plans if plan._must_recompute(s)]
        for_graphs = [s.stage for s in plan.stage_plans if plan.recomputes_for_graphs(s)]
        which = "none" if not memory else f"stage(s) {', '.join(map(str, memory))}"
        text = f"auto (recompute where a stage does not fit without: {which}"
        if for_graphs:
            text += "; where it is then faster with its CUDA graphs: stage(s) " + ", ".join(
                map(str, for_graphs)
            )
        return text + ")"
    return f"every {plan.checkpoint_interval} layer(s)" if plan.checkpointing else "off"


def _as_configured(plan: RunPlan) -> str:
    if plan.checkpoint_interval == "auto":
        return "checkpointing auto"
    return f"{'with' if plan.checkpointing else 'without'} checkpointing"


def format_plan(plan: RunPlan) -> str:
    """The plan as a markdown table plus summary lines (``total parameters: X.XXB`` among them)."""
    m = plan.model
    ck = plan.checkpointing
    ckpt_total, ckpt_rank = plan.checkpoint_bytes()
    lines = [
        f"config: {plan.config_name or '(custom)'}  ({m.encoder_layers}L-{m.decoder_layers}L, "
        f"d={m.hidden_size}, ffn={m.ffn_hidden_size}, vocab={m.vocab_size}, {m.residual})",
        f"topology: {plan.gpus} GPUs x {_gb(plan.gpu_memory)} GB = {plan.stages} stages x "
        f"{plan.dp} data-parallel; {plan.precision.name}, ZeRO-{plan.precision.zero_stage}; "
        f"{plan.micro_batches} micro-batches x {plan.micro_batch_tokens} tokens; "
        "activation checkpointing: " + _describe_checkpointing(plan),
        "",
        "| stage | entries | enc | dec | params (M) | weights+grads GB | ZeRO-1 optim GB "
        "| in flight | act no-ckpt GB | act ckpt GB | loss GB | total no-ckpt GB | total ckpt GB |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in plan.stage_plans:
        lines.append(
            f"| {s.stage} | {s.entries[0]}..{s.entries[1]} | {s.encoder_layers} | "
            f"{s.decoder_layers} | {s.params / 1e6:.1f} | {_gb(s.weights_grads)} | "
            f"{_gb(s.optimizer)} | {s.in_flight} | {_gb(s.act_no_ckpt)} | {_gb(s.act_ckpt)} | "
            f"{_gb(s.loss_workspace)} | {_gb(s.total(False, plan.overhead))} | "
            f"{_gb(s.total(True, plan.overhead))} |"
        )
    verdict = "fits" if plan.fits() else "does NOT fit"
    other = "fits" if plan.fits(not ck) else "does not fit"
    lines += [
        "",
        f"total parameters: {plan.total_params / 1e9:.2f}B ({plan.total_params:,})",
        f"per-layer parameters: encoder {encoder_layer_params(m):,}, decoder "
        f"{decoder_layer_params(m):,}, embedding {embedding_params(m):,}",
        f"pipeline bubble: (p-1)/(m+p-1) = ({plan.stages}-1)/({plan.micro_batches}+"
        f"{plan.stages}-1) = {plan.bubble:.1%}",
        f"overhead per GPU (CUDA context, NCCL, fragmentation): {_gb(plan.overhead)} GB",
        f"peak per GPU as configured ({_as_configured(plan)}): "
        f"{_gb(plan.peak())} GB of {_gb(plan.gpu_memory)} GB -> {verdict}",
        f"peak per GPU {'without' if ck else 'with'} checkpointing: {_gb(plan.peak(not ck))} GB "
        f"-> {other}",
        f"tokens per update: {plan.tokens_per_update:,} per side; "
        f"~{plan.flops_per_update / 1e15:.3g} PFLOP of matmuls per update (model FLOPs, as "
        "train.py's tflops_per_gpu counts them)",
        f"checkpoint: ~{_gb(ckpt_total)} GB in total, up to {_gb(ckpt_rank)} GB written by one rank",
    ]
    if plan.graph_shapes:
        lines += ["", *_format_graphs(plan)]
    lines += ["", *_format_time(plan)]
    return "\n".join(lines)


def _pace(plan: RunPlan) -> str:
    """'~T s per update, paced by stage s (host-bound: ...)'."""
    times = [plan.stage_time(s) for s in plan.stage_plans]
    s = max(range(len(times)), key=lambda i: times[i].seconds)
    t = times[s]
    bound = "host-bound" if t.host > t.gpu else "GPU-bound"
    return (
        f"~{plan.seconds_per_update:.3g} s per update, paced by stage {s} ({bound}: "
        f"{t.host * 1e3:.0f} ms of host time and {t.gpu * 1e3:.0f} ms of GPU time per "
        "micro-batch)"
    )


def _format_time(plan: RunPlan) -> list[str]:
    """Per stage, a micro-batch's GPU and host time eagerly and with CUDA graphs, the time per
    update of each, and what ``train.max_steps`` updates take (:meth:`RunPlan.stage_time`)."""
    eager = dataclasses.replace(plan, graph_shapes=0)
    graphed = plan.graphed()
    configured = "CUDA graphs" if plan.graph_shapes else "eager"
    lines = [
        f"time per micro-batch and stage: GPU at {plan.tflops:g} TFLOP/s sustained (--tflops; "
        "a third more where a stage recomputes), host as an H100 ran eager layers (~"
        f"{EAGER_HOST_S['enc'] * 1e3:.1f} ms per encoder and {EAGER_HOST_S['dec'] * 1e3:.1f} ms "
        f"per decoder layer, {RECOMPUTE_HOST_FACTOR:g}x that recomputing) or, replayed from CUDA "
        "graphs, their gradients' hand-over; the slower of the two sets the stage's pace "
        "(planner.py)",
        "",
        "| stage | GFLOP per micro-batch | eager: GPU ms | eager: host ms | graphs: GPU ms "
        "| graphs: host ms |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for s, g in zip(eager.stage_plans, (graphed or eager).stage_plans, strict=True):
        cells = [eager.stage_time(s), *([graphed.stage_time(g)] if graphed else [])]
        ms = " | ".join(f"{t.gpu * 1e3:.1f} | {t.host * 1e3:.1f}" for t in cells)
        lines.append(f"| {s.stage} | {s.flops / 1e9:,.0f} | {ms} |" + ("" if graphed else "  |  |"))
    lines += ["", f"time per update (1F1B: each stage's micro-batch once, then "
              f"{plan.micro_batches - 1} more of the slowest stage's; as configured: {configured}):"]  # fmt: skip
    lines.append(f"- eager: {_pace(eager)}")
    if graphed is not None:
        lines.append(f"- CUDA graphs (model.cuda_graphs=on): {_pace(graphed)}")
    else:
        lines.append("- CUDA graphs: not with data.bucket_shapes=0 (dynamic shapes)")
    if plan.max_steps:
        days = [f"~{eager.seconds_per_update * plan.max_steps / 86400:.1f} days eager"]
        if graphed is not None:
            days.append(f"~{graphed.seconds_per_update * plan.max_steps / 86400:.1f} days with "
                        "CUDA graphs")  # fmt: skip
        lines.append(f"- train.max_steps = {plan.max_steps:,} updates: " + ", ".join(days))
    return lines


def _format_graphs(plan: RunPlan) -> list[str]:
    """The CUDA-graph rows: per stage, one graph set's static bytes, the sets wanted and the
    sets that fit (:meth:`RunPlan.graph_sets`); micro-batches beyond them run eagerly."""
    lines = [
        f"CUDA graphs (model.cuda_graphs on, up to {plan.graph_shapes} bucket shapes; "
        "training/cuda_graphs.py): a graph set is every layer range of a stage for one shape "
        "and one micro-batch in flight (one per shape on a stage that recomputes, whose graphs "
        "share one memory pool and may be cut into links, each recomputed in turn, so that the "
        "pool holds one link's activations), all sharing the stage's gradient buffers; sets "
        "that do not fit run eagerly",
        "",
        "| stage | graphs per shape | graph set GB | shared gradients GB | allowance GB "
        "| sets wanted | sets that fit |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for s in plan.stage_plans:
        if not s.layer_ranges:
            lines.append(f"| {s.stage} | no layers | - | - | - | - | - |")
            continue
        wanted, fit = plan.graph_sets(s)
        per, links = f"{s.in_flight} (in flight)", 0
        if plan.stage_checkpoints(s):
            per = "1 (recomputes for them" if plan.recomputes_for_graphs(s) else "1 (recomputes"
            links = plan.link_layers(s)
            per += f"; links of {links} layers)" if links else ")"
        lines.append(
            f"| {s.stage} | {per} | {plan.set_bytes(s, links) / GB:.3f} | "
            f"{_gb(s.graph_grad_bytes)} | "
            f"{_gb(plan.graph_allowance(s))} | {wanted} | {fit} |"
        )
    return lines
