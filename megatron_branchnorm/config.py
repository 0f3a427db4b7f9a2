"""Typed experiment configuration: YAML sections map onto nested dataclasses.

    cfg = load_config("tiny_cpu", ["model.hidden_size=128", "train.max_steps=20"])

A config is a YAML file (or the name of one shipped in ``megatron_branchnorm/configs/``) with
the sections ``model``, ``data``, ``pipeline`` and ``train``. Unknown keys, wrong types and
inconsistent values raise :class:`ConfigError` with a one-line message that names the key.
Validation never rewrites a field: what you wrote is what runs.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megatron_branchnorm.errors import UserError
from megatron_branchnorm.formats.files import MAX_INT, FileShapeError, quote, read_small_file
from megatron_branchnorm.formats.yaml_io import MAX_BYTES as YAML_MAX_BYTES
from megatron_branchnorm.formats.yaml_io import YAMLLimitError, load_bounded

CONFIG_DIR = Path(__file__).resolve().parent / "configs"

BRANCHNORM_SCHEDULES = ("linear", "exp", "sigmoid")
BRANCH_INITS = ("auto", "deepnet", "xavier")
LAYERNORM_IMPLS = ("auto", "apex", "torch")
ACTIVATIONS = ("relu", "gelu")
CUDA_GRAPH_MODES = ("off", "on", "auto")


@dataclass(frozen=True)
class SchemeEntry:
    """A residual scheme's entry in :data:`RESIDUAL_SCHEMES`: the one trait that rooms which may
    not import the model need (docs/design.md §9, §11)."""

    final_norm: bool
    """Each stack ends in a LayerNorm (Pre-LN): parallel/planner.py counts its parameters."""


RESIDUAL_SCHEMES: dict[str, SchemeEntry] = {
    "branchnorm": SchemeEntry(final_norm=False),
    "deepnorm": SchemeEntry(final_norm=False),
    "postln": SchemeEntry(final_norm=False),
    "preln": SchemeEntry(final_norm=True),
}
"""The names ``model.residual`` accepts (docs/design.md §11). What each scheme computes and
every other trait live in model/residual.py's registry ``SCHEMES``, which checks at import
that it covers exactly these names: config may not import the model, and neither may the
torch-free plan, which reads ``final_norm`` here. A new scheme is its entry there and here."""


MAX_OVERRIDE_CHARS = 1 << 16
"""Longest value a ``key=value`` override takes (paths and layout strings are far shorter)."""


MAX_COLLECTIVE_TIMEOUT_S = 7 * 24 * 3600.0
"""Largest ``train.collective_timeout_s``: a week. Much larger values overflow the timeout
that torch.distributed holds in nanoseconds (1e10 s failed at once with "timed out", 1e300
raised OverflowError), and no collective should wait longer than a week."""


MAX_LAYERS = 10_000
"""Most layers of ``model.encoder_layers`` and of ``model.decoder_layers``: ten times the
deepest stack of the shipped recipes (500). The balanced partition grows faster than the
depth (measured: 0.2 s at 1,000 layers a stack, 6.5 s at 10,000, minutes at 50,000), so a
start-up at a count such as 2**31 would never end."""

MAX_SYNTHETIC_SIZE = 1_000_000
"""Most sentence pairs of ``data.synthetic_size``: one epoch's plan of the synthetic task
takes about 10 s at 10**6 pairs (measured), and grows with the size (2**31: hours each
epoch)."""


class ConfigError(UserError, ValueError):
    """A bad configuration: the message names the offending key."""


@dataclass
class ModelConfig:
    """Architecture of the encoder-decoder (docs/design.md §11)."""

    encoder_layers: int = 6
    """Number of encoder layers N."""
    decoder_layers: int = 6
    """Number of decoder layers M."""
    hidden_size: int = 512
    """Model width d."""
    ffn_hidden_size: int = 2048
    """Inner width of the feed-forward sublayer."""
    num_attention_heads: int = 8
    """Attention heads; must divide hidden_size."""
    vocab_size: int | None = None
    """Joint vocabulary size; taken from the data manifest when unset."""
    residual: str = "branchnorm"
    """Residual scheme: branchnorm | deepnorm | postln | preln."""
    branchnorm_steps: int = 4000
    """T in alpha_t = min(1, t/T): updates until BranchNorm becomes Post-LN."""
    branchnorm_schedule: str = "linear"
    """How alpha_t rises to 1: linear (the paper's) | exp | sigmoid."""
    branch_init: str = "auto"
    """Init gain of the branch projections: auto (DeepNet's beta for deepnorm and branchnorm, 1
    for postln and preln) | deepnet | xavier (gain 1). For ablations: separates the init from
    the residual scheme, e.g. Post-LN with DeepNet's init."""
    dropout: float = 0.1
    """Dropout on embeddings and on every sublayer output."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    activation_dropout: float = 0.0
    """Dropout after the FFN activation."""
    activation: str = "relu"
    """FFN activation: relu | gelu."""
    layernorm_impl: str = "auto"
    """auto (Apex FusedLayerNorm on CUDA when importable, else torch) | apex | torch."""
    layernorm_eps: float = 1e-5
    """LayerNorm epsilon."""
    max_positions: int = 1024
    """Longest sequence the sinusoidal position table covers."""
    compile: bool = False
    """Run each encoder and decoder layer's forward through torch.compile (inductor, dynamic
    shapes; aot_eager where no C++ compiler is found): model/compile.py. Off until a GPU shows
    the gain (docs/performance.md); the weights are the same either way."""
    cuda_graphs: str = "off"
    """Each stage's encoder/decoder layer stack captured as CUDA graphs (forward and backward)
    per bucket shape and replayed (training/cuda_graphs.py, docs/design.md §19): off | on |
    auto. Off until ``make gpu-bench`` shows graphs correct and faster on a GPU. Where a stage
    cannot be graphed (no CUDA, data.bucket_shapes=0, model.compile, torch_autocast, a
    DeepSpeed JSON other than bf16 with immediate_grad_update) it runs eagerly and one line
    says why; auto says nothing on a machine without CUDA. Quote
    it in YAML ("on"): unquoted, YAML reads on and off as booleans."""
    cuda_graph_link_layers: int | str = "auto"
    """On a stage that recomputes activations, the most layers one CUDA graph link holds (a
    range's graph is cut into links so that the graphs' memory pool holds one link's
    activations, not the whole range's: docs/design.md §19, "Links"). auto: the memory
    planner's choice for the device (whole ranges where they have room); 0: whole ranges; N:
    links of at most N layers. Stages that do not recompute ignore it."""


@dataclass
class DataConfig:
    """Where batches come from (docs/design.md §10)."""

    dataset: str = "synthetic"
    """A preprocessed DATA_DIR (tools/preprocess_data.py) or "synthetic"."""
    max_tokens: int = 4096
    """Tokens per micro-batch (the larger of source and target, padded)."""
    sampling_temperature: float = 5.0
    """T in p_i ~ n_i^(1/T) over translation directions."""
    max_length: int = 256
    """Longest source or target sentence (tokens) used in training."""
    synthetic_size: int = 20000
    """Number of sentence pairs in the synthetic copy/reverse task."""
    valid_samples_per_direction: int = 200
    """Validation takes the first K usable sentences (file order, after data.max_length) of
    every direction's dev split; 0 takes all of them (docs/design.md §16)."""
    bucket_shapes: int | str = "auto"
    """Training micro-batches padded to a few fixed (sentences x source x target) shapes
    chosen from the corpus's lengths, so the pipeline sends fixed shapes (docs/design.md
    §18): auto (the fewest, up to 48, that keep an epoch's padding at or below 9%; the shapes
    and the padding are printed at start-up), N (at most N, 1 to 64), or 0 (off: each
    micro-batch as long as its longest sentence, and the shapes sent with each one)."""


@dataclass
class PipelineConfig:
    """DeepSpeed pipeline parallelism (docs/design.md §1, §12)."""

    stages: int = 1
    """Pipeline stages; data-parallel size is world_size / stages."""
    fallback_stages: str = ""
    """Stage counts to use when ``stages`` does not fit the allocation (a requeue onto more or
    fewer nodes): "" none (a one-line error names the layouts that would fit), "auto" (every
    divisor of the world size, fewest stages first) or a list such as "12,8". The first that
    divides the world size, keeps a resumed run's micro-batches per update and that the
    memory planner says fits is taken (docs/design.md §17)."""
    data_parallel: int = 0
    """The data-parallel size ``train.micro_batches`` is set for (the config's layout is
    ``stages x data_parallel`` ranks): the global batch is then ``train.micro_batches x
    data_parallel`` micro-batches of ``data.max_tokens``, kept on every allocation and layout
    (each replica takes its share; a layout that cannot share it is refused). 0: each replica
    takes ``train.micro_batches``, so the global batch grows with the world size, and a
    fresh start cannot fall back to other stages (docs/design.md §17)."""
    partition: str = "balanced"
    """balanced (cost model: decoder layers cost more) | uniform | a layout string."""
    activation_checkpoint_interval: int | str = 0
    """Checkpoint every k-th encoder/decoder layer's activations; 0 disables; "auto": each
    stage recomputes (every layer) only when the memory planner says that the stage would not
    fit its device without (docs/design.md §14)."""


@dataclass
class TrainConfig:
    """Optimisation, logging and checkpointing (docs/design.md §8, §10)."""

    max_steps: int = 100000
    """Number of optimizer updates."""
    max_time_minutes: float = 0.0
    """Stop after this much wall-clock time with a final checkpoint; 0 disables."""
    micro_batches: int = 1
    """Micro-batches per update (gradient accumulation / pipeline depth)."""
    lr: float = 5e-4
    """Peak learning rate of the inverse-sqrt schedule."""
    warmup_steps: int = 4000
    """Linear warm-up updates before the inverse-sqrt decay."""
    warmup_init_lr: float = 1e-7
    """Learning rate at the first update of warm-up."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.98
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    label_smoothing: float = 0.1
    """Label smoothing epsilon of the cross entropy."""
    clip_grad: float = 0.0
    """Clip the global gradient norm to this value; 0 disables."""
    seed: int = 1
    """Seed for initialisation, dropout and data order."""
    save_dir: str = "runs/default"
    """Checkpoints, metrics.jsonl and TensorBoard logs go here."""
    save_interval: int = 1000
    """Save a checkpoint every k updates (and at the end); 0 saves only at the end."""
    eval_interval: int = 1000
    """Validation loss every k updates; 0 disables."""
    patience: int = 0
    """Stop (saving a checkpoint) once the validation loss has not improved for this many
    validations in a row, as fairseq's --patience; 0 disables."""
    keep_last: int = 0
    """Keep the last k complete checkpoints and remove older ones; 0 keeps every checkpoint.
    The one a resume loads is always kept (megatron_branchnorm/training/retention.py)."""
    keep_best: int = 0
    """Also keep the k best checkpoints by best_metric, named in ``save_dir/best.json``."""
    best_metric: str = "valid_loss"
    """What keep_best ranks by: ``valid_loss`` (the lowest validation loss at a checkpoint's
    step; eval_interval must divide save_interval) or ``valid_bleu`` (the highest BLEU that
    the companion ``tools/watch_bleu.py`` wrote for it to ``save_dir/valid_bleu.jsonl``;
    checkpoints it has not scored yet are kept)."""
    log_interval: int = 10
    """Log a metrics line every k updates."""
    deepspeed_config: str = "ds_configs/cpu_fp32.json"
    """DeepSpeed JSON: precision and ZeRO stage live there. ``ds_configs/NAME.json`` names a
    shipped one (megatron_branchnorm/ds_configs/, its README) from any directory
    (resources.find_ds_config)."""
    max_consecutive_skips: int = 5
    """fp32: stop (exit 3, no save) after this many consecutive updates skipped for a
    non-finite gradient norm."""
    collective_timeout_s: float = 600.0
    """Timeout of every collective: a rank that stops answering (hung, not dead: a dead
    peer's closed socket fails at once) makes the others fail after this many seconds. Also
    the bound of the rendezvous at start (every rank connects to rank 0 at MASTER_ADDR:
    MASTER_PORT; then one line, exit 4) and of a wait for torch's build lock of DeepSpeed's
    CPU op that no build of the node holds (training/environment.py)."""


@dataclass
class ExperimentConfig:
    """One experiment: the four sections of a YAML config."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (YAML/JSON serialisable)."""
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


_YAML11_MISSED_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted where floats are."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(key, value, arg)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"config key {key}: bad value {quote(value)}")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if abs(value) > MAX_INT:
                raise ConfigError(
                    f"config key {key}: {quote(value)} is out of range (|x| <= {MAX_INT})"
                )
            return value
    elif tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value) if abs(value) <= 1e300 else math.inf
        elif isinstance(value, str) and _YAML11_MISSED_FLOAT.fullmatch(value.strip()):
            number = float(value)  # PyYAML (YAML 1.1) reads 3e-4 / 1E5 as strings
        if number is not None:
            if not math.isfinite(number):
                raise ConfigError(f"config key {key}: must be a finite number, got {quote(value)}")
            return number
    elif tp is str:
        if isinstance(value, str):
            if "\x00" in value:
                raise ConfigError(
                    f"config key {key}: contains a NUL byte, which no path or name may hold "
                    f"({quote(value)})"
                )
            return value
    raise ConfigError(
        f"config key {key}: expected {_type_name(tp)}, got {type(value).__name__} {quote(value)}"
    )


def _build(cls: type, data: Any, prefix: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config key {prefix}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            where = f"{prefix}.{key}" if prefix else str(key)
            raise ConfigError(
                f"config key {where}: unknown key (known: {', '.join(sorted(names))})"
            )
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        where = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = _build(tp, data[f.name], where)
        else:
            kwargs[f.name] = _coerce(where, data[f.name], tp)
    return cls(**kwargs)


def resolve_config_path(name_or_path: str | Path) -> Path:
    """A YAML path as given, or the name of a config shipped in ``megatron_branchnorm/configs``."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = CONFIG_DIR / f"{name_or_path}.yaml"
    if shipped.is_file():
        return shipped
    names = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
    raise ConfigError(
        f"--config {name_or_path}: no such file and no shipped config (known: {names})"
    )


def _read_yaml(path: Path) -> dict[str, Any]:
    try:  # a regular file, read bounded (UTF-8: at most 4 bytes a character of the limit)
        text = read_small_file(path, 4 * YAML_MAX_BYTES).decode("utf-8")
    except FileShapeError as exc:
        raise ConfigError(str(exc)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read config: {exc}") from None
    try:
        data = load_bounded(text, str(path))
    except YAMLLimitError as exc:
        raise ConfigError(str(exc)) from None
    except yaml.YAMLError as exc:
        msg = " ".join(str(exc).split())
        raise ConfigError(f"{path}: invalid YAML: {msg}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    return data


_PLAIN_INT = re.compile(r"[-+]?(0|[1-9][0-9]*)")
_PLAIN_FLOAT = re.compile(r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?")
_NULLS = ("null", "Null", "NULL", "~")
_BOOLS = {"true": True, "false": False}


def _field_type(section: str, name: str) -> Any:
    """The annotation of ``section.name`` in :class:`ExperimentConfig`, or None if unknown."""
    sections = typing.get_type_hints(ExperimentConfig)
    cls = sections.get(section)
    if cls is None or not dataclasses.is_dataclass(cls):
        return None
    return typing.get_type_hints(cls).get(name)


def _parse_override(key: str, raw: str, tp: Any) -> Any:
    """The value of a ``key=raw`` override, read as the key's type ``tp`` means it, never by
    YAML 1.1's rules (which read ``1:30`` as 90, ``0x10`` as 16, ``010`` as 8 and drop a
    ``#...`` as a comment):

    - int: a plain decimal integer (``-3``, ``4000``); float: a plain decimal number with an
      optional exponent (``5e-4``, ``.5``, ``3``); bool: ``true`` or ``false`` (any case);
      ``null`` (or ``~``) where the key may be unset; str: the text exactly as given, ``#``
      and all. A union (``int | str``) takes the first type the text reads as.
    - anything else for an int, float or bool key is refused naming the key: a person may mean
      something other than what a YAML reader would make of ``1:30``, ``0x10`` or ``1_000``.

    An unknown key keeps its text; :func:`_build` refuses it naming the known keys."""
    if tp is None:
        return raw
    args = (
        typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    )
    if type(None) in args and raw.strip() in _NULLS:
        return None
    text = raw.strip()
    for arg in args:
        if arg is bool and text.lower() in _BOOLS:
            return _BOOLS[text.lower()]
        if arg is int and _PLAIN_INT.fullmatch(text):
            if len(text) > 20:  # int() of thousands of digits is slow, then refused anyway
                raise ConfigError(
                    f"config key {key}: {quote(raw)} is out of range (|x| <= {MAX_INT})"
                )
            return int(text)
        if arg is float and _PLAIN_FLOAT.fullmatch(text):
            return float(text)
        if arg is str:
            return raw
    wanted = " or ".join(
        {
            bool: "bool (true or false)",
            int: "int (a plain decimal integer such as 12)",
            float: "float (a plain decimal number such as 0.5 or 5e-4)",
            type(None): "null",
        }.get(arg, _type_name(arg))
        for arg in args
    )
    kind = "bool " if text.lower() in _BOOLS else "null " if text in _NULLS else ""
    raise ConfigError(f"config key {key}: expected {wanted}, got {kind}{quote(raw)}")


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply dotted ``section.key=value`` overrides, each value read as its key's type means
    it (:func:`_parse_override`), never by YAML 1.1's number rules."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {quote(item)}: expected section.key=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        parts = key.split(".")
        if len(parts) != 2 or not all(parts):
            raise ConfigError(f"config key {key}: overrides take the form section.key=value")
        if len(raw) > MAX_OVERRIDE_CHARS:
            raise ConfigError(
                f"config key {key}: {len(raw):,} characters of value, more than the "
                f"{MAX_OVERRIDE_CHARS:,} an override takes"
            )
        value = _parse_override(key, raw, _field_type(parts[0], parts[1]))
        section = data.setdefault(parts[0], {})
        if not isinstance(section, dict):
            raise ConfigError(f"config key {parts[0]}: expected a mapping")
        section[parts[1]] = value
    return data


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None
) -> ExperimentConfig:
    """Load a YAML config (path or shipped name), apply ``key=value`` overrides, validate."""
    data = _read_yaml(resolve_config_path(path)) if path is not None else {}
    data = apply_overrides(data, list(overrides or []))
    cfg = _build(ExperimentConfig, data, "")
    validate(cfg)
    return cfg


def config_from_dict(data: dict[str, Any]) -> ExperimentConfig:
    """Build and validate a config from a nested dict (e.g. one saved in a checkpoint)."""
    cfg = _build(ExperimentConfig, data, "")
    validate(cfg)
    return cfg


def model_config_from_dict(data: dict[str, Any]) -> ModelConfig:
    """Build and validate a ModelConfig from the ``model`` mapping alone (e.g. an export's)."""
    cfg = _build(ModelConfig, data, "model")
    validate_model(cfg)
    return cfg


def config_yaml(cfg: ExperimentConfig) -> str:
    """The resolved config as YAML text, every key in its section's order; :func:`load_config`
    reads it back to the same config."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def dump_config(cfg: ExperimentConfig, path: str | Path) -> None:
    """Write the resolved config as YAML (:func:`config_yaml`)."""
    Path(path).write_text(config_yaml(cfg), encoding="utf-8")


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _check(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"config key {key}: {msg}")


def validate_model(m: ModelConfig, prefix: str = "model") -> None:
    """Consistency checks of a ModelConfig; raises ConfigError naming the key."""
    for name in ("encoder_layers", "decoder_layers"):
        layers = getattr(m, name)
        _check(layers >= 1, f"{prefix}.{name}", f"must be >= 1, got {layers}")
        _check(
            layers <= MAX_LAYERS, f"{prefix}.{name}", f"must be <= {MAX_LAYERS:,}, got {layers:,}"
        )
    _check(m.hidden_size >= 1, f"{prefix}.hidden_size", f"must be >= 1, got {m.hidden_size}")
    _check(
        m.ffn_hidden_size >= 1,
        f"{prefix}.ffn_hidden_size",
        f"must be >= 1, got {m.ffn_hidden_size}",
    )
    _check(
        m.num_attention_heads >= 1,
        f"{prefix}.num_attention_heads",
        f"must be >= 1, got {m.num_attention_heads}",
    )
    _check(
        m.hidden_size % m.num_attention_heads == 0,
        f"{prefix}.hidden_size",
        f"{m.hidden_size} is not divisible by {prefix}.num_attention_heads={m.num_attention_heads}",
    )
    if m.vocab_size is not None:
        _check(m.vocab_size >= 8, f"{prefix}.vocab_size", f"must be >= 8, got {m.vocab_size}")
    _check(
        m.residual in RESIDUAL_SCHEMES,
        f"{prefix}.residual",
        f"unknown scheme {quote(m.residual)} (choose from {', '.join(RESIDUAL_SCHEMES)})",
    )
    _check(
        m.branchnorm_schedule in BRANCHNORM_SCHEDULES,
        f"{prefix}.branchnorm_schedule",
        f"unknown schedule {quote(m.branchnorm_schedule)} (choose from {', '.join(BRANCHNORM_SCHEDULES)})",
    )
    _check(
        m.branch_init in BRANCH_INITS,
        f"{prefix}.branch_init",
        f"unknown init {quote(m.branch_init)} (choose from {', '.join(BRANCH_INITS)})",
    )
    _check(
        m.branchnorm_steps >= 1,
        f"{prefix}.branchnorm_steps",
        f"must be >= 1, got {m.branchnorm_steps}",
    )
    for name in ("dropout", "attention_dropout", "activation_dropout"):
        v = getattr(m, name)
        _check(0.0 <= v < 1.0, f"{prefix}.{name}", f"must be in [0, 1), got {v}")
    _check(
        m.activation in ACTIVATIONS,
        f"{prefix}.activation",
        f"unknown activation {quote(m.activation)} (choose from {', '.join(ACTIVATIONS)})",
    )
    _check(
        m.layernorm_impl in LAYERNORM_IMPLS,
        f"{prefix}.layernorm_impl",
        f"unknown implementation {quote(m.layernorm_impl)} (choose from {', '.join(LAYERNORM_IMPLS)})",
    )
    _check(m.layernorm_eps > 0, f"{prefix}.layernorm_eps", f"must be > 0, got {m.layernorm_eps}")
    _check(m.max_positions >= 2, f"{prefix}.max_positions", f"must be >= 2, got {m.max_positions}")
    _check(
        m.cuda_graphs in CUDA_GRAPH_MODES,
        f"{prefix}.cuda_graphs",
        f"unknown mode {quote(m.cuda_graphs)} (choose from {', '.join(CUDA_GRAPH_MODES)})",
    )
    links = m.cuda_graph_link_layers
    _check(
        links == "auto" or (type(links) is int and 0 <= links <= MAX_INT),
        f"{prefix}.cuda_graph_link_layers",
        f"must be an integer >= 0 or auto, got {quote(links)}",
    )


def _check_update_size(cfg: ExperimentConfig) -> None:
    """The micro-batches one update draws, where the config fixes them (``train.micro_batches
    x pipeline.data_parallel``; without ``pipeline.data_parallel`` the world size multiplies
    them, training/layout.py), within a count key's range and, on the synthetic task, within
    the pairs it holds (a micro-batch holds at least one). The trainer checks them against
    the batches an epoch of a DATA_DIR holds (training/data.py)."""
    micro, dp = cfg.train.micro_batches, cfg.pipeline.data_parallel
    key = "pipeline.data_parallel" if dp else "train.micro_batches"
    per_update = micro * max(dp, 1)
    what = (
        f"train.micro_batches {micro:,} x pipeline.data_parallel {dp:,}"
        if dp
        else "train.micro_batches, on each data-parallel replica"
    )
    _check(
        per_update <= MAX_INT,
        key,
        f"{per_update:,} micro-batches per update ({what}), more than {MAX_INT:,}",
    )
    size = cfg.data.synthetic_size
    _check(
        cfg.data.dataset != "synthetic" or per_update <= size,
        key,
        f"an update takes {per_update:,} micro-batches ({what}), more than the {size:,} "
        f"sentence pairs of the training data (data.synthetic_size) could fill",
    )


def validate(cfg: ExperimentConfig) -> None:
    """Consistency checks of a whole config; raises ConfigError naming the key."""
    validate_model(cfg.model)
    d, p, t = cfg.data, cfg.pipeline, cfg.train
    _check(bool(d.dataset), "data.dataset", "must be a DATA_DIR or 'synthetic'")
    _check(d.max_tokens >= 1, "data.max_tokens", f"must be >= 1, got {d.max_tokens}")
    _check(
        d.sampling_temperature > 0,
        "data.sampling_temperature",
        f"must be > 0, got {d.sampling_temperature}",
    )
    _check(d.max_length >= 1, "data.max_length", f"must be >= 1, got {d.max_length}")
    _check(
        d.max_length + 2 <= cfg.model.max_positions,
        "data.max_length",
        f"{d.max_length} (+2 special tokens) exceeds model.max_positions={cfg.model.max_positions}",
    )
    _check(
        d.max_tokens >= d.max_length + 2,
        "data.max_tokens",
        f"{d.max_tokens} cannot hold one sentence of data.max_length={d.max_length} (+2 special tokens)",
    )
    _check(d.synthetic_size >= 1, "data.synthetic_size", f"must be >= 1, got {d.synthetic_size}")
    _check(
        d.synthetic_size <= MAX_SYNTHETIC_SIZE,
        "data.synthetic_size",
        f"must be <= {MAX_SYNTHETIC_SIZE:,}, got {d.synthetic_size:,}",
    )
    if d.dataset == "synthetic":  # a micro-batch holds at most every pair of the task
        most = d.synthetic_size * (d.max_length + 2)
        _check(
            d.max_tokens <= most,
            "data.max_tokens",
            f"{d.max_tokens:,} tokens per micro-batch, more than the {most:,} that all "
            f"data.synthetic_size={d.synthetic_size:,} pairs of data.max_length="
            f"{d.max_length} (+2 special tokens) hold",
        )
    _check(
        d.valid_samples_per_direction >= 0,
        "data.valid_samples_per_direction",
        f"must be >= 0 (0: the whole dev split), got {d.valid_samples_per_direction}",
    )
    shapes = d.bucket_shapes
    _check(
        shapes == "auto" or (isinstance(shapes, int) and 0 <= shapes <= 64),
        "data.bucket_shapes",
        f"must be auto or an integer from 0 (off) to 64, got {quote(shapes)}",
    )
    _check(p.stages >= 1, "pipeline.stages", f"must be >= 1, got {p.stages}")
    # The spec list is [embed, enc_1..N, enc_final, dec_embed, dec_1..M, dec_final, output].
    n_specs = cfg.model.encoder_layers + cfg.model.decoder_layers + 5
    _check(
        p.stages <= n_specs,
        "pipeline.stages",
        f"{p.stages} stages for {n_specs} pipeline layers "
        f"({cfg.model.encoder_layers} encoder + {cfg.model.decoder_layers} decoder + 5)",
    )
    fallback = p.fallback_stages.strip()
    _check(
        fallback in ("", "auto") or re.fullmatch(r"[1-9][0-9]{0,5}(,[1-9][0-9]{0,5})*", fallback),
        "pipeline.fallback_stages",
        f'must be "", auto or stage counts such as 12,8, got {quote(p.fallback_stages)}',
    )
    _check(p.data_parallel >= 0, "pipeline.data_parallel", f"must be >= 0, got {p.data_parallel}")
    _check(bool(p.partition), "pipeline.partition", "must be balanced, uniform or a layout string")
    interval = p.activation_checkpoint_interval
    _check(
        interval == "auto" or (isinstance(interval, int) and interval >= 0),
        "pipeline.activation_checkpoint_interval",
        f"must be an integer >= 0 or auto, got {quote(interval)}",
    )
    _check(t.max_steps >= 1, "train.max_steps", f"must be >= 1, got {t.max_steps}")
    _check(
        t.max_time_minutes >= 0, "train.max_time_minutes", f"must be >= 0, got {t.max_time_minutes}"
    )
    _check(t.micro_batches >= 1, "train.micro_batches", f"must be >= 1, got {t.micro_batches}")
    _check_update_size(cfg)
    _check(t.lr > 0, "train.lr", f"must be > 0, got {t.lr}")
    _check(t.warmup_steps >= 0, "train.warmup_steps", f"must be >= 0, got {t.warmup_steps}")
    _check(t.warmup_init_lr >= 0, "train.warmup_init_lr", f"must be >= 0, got {t.warmup_init_lr}")
    _check(0 <= t.adam_beta1 < 1, "train.adam_beta1", f"must be in [0, 1), got {t.adam_beta1}")
    _check(0 <= t.adam_beta2 < 1, "train.adam_beta2", f"must be in [0, 1), got {t.adam_beta2}")
    _check(t.adam_eps > 0, "train.adam_eps", f"must be > 0, got {t.adam_eps}")
    _check(t.weight_decay >= 0, "train.weight_decay", f"must be >= 0, got {t.weight_decay}")
    _check(
        0 <= t.label_smoothing < 1,
        "train.label_smoothing",
        f"must be in [0, 1), got {t.label_smoothing}",
    )
    _check(t.clip_grad >= 0, "train.clip_grad", f"must be >= 0, got {t.clip_grad}")
    _check(t.seed >= 0, "train.seed", f"must be >= 0, got {t.seed}")
    _check(bool(t.save_dir), "train.save_dir", "must not be empty")
    _check(t.save_interval >= 0, "train.save_interval", f"must be >= 0, got {t.save_interval}")
    _check(t.eval_interval >= 0, "train.eval_interval", f"must be >= 0, got {t.eval_interval}")
    _check(t.log_interval >= 1, "train.log_interval", f"must be >= 1, got {t.log_interval}")
    _check(t.patience >= 0, "train.patience", f"must be >= 0, got {t.patience}")
    _check(t.keep_last >= 0, "train.keep_last", f"must be >= 0, got {t.keep_last}")
    _check(t.keep_best >= 0, "train.keep_best", f"must be >= 0, got {t.keep_best}")
    _check(
        t.best_metric in ("valid_loss", "valid_bleu"),
        "train.best_metric",
        f"must be valid_loss or valid_bleu, got {t.best_metric!r}",
    )
    _check(
        not (
            t.keep_best
            and t.best_metric == "valid_loss"
            and t.eval_interval
            and t.save_interval % t.eval_interval
        ),
        "train.keep_best",
        f"needs train.eval_interval ({t.eval_interval}) to divide train.save_interval "
        f"({t.save_interval}): a checkpoint is scored by the validation loss at its step",
    )
    _check(bool(t.deepspeed_config), "train.deepspeed_config", "must name a DeepSpeed JSON")
    _check(
        t.max_consecutive_skips >= 1,
        "train.max_consecutive_skips",
        f"must be >= 1, got {t.max_consecutive_skips}",
    )
    _check(
        0 < t.collective_timeout_s <= MAX_COLLECTIVE_TIMEOUT_S,
        "train.collective_timeout_s",
        f"must be > 0 and at most {MAX_COLLECTIVE_TIMEOUT_S:g} (a week), got {t.collective_timeout_s:g}",
    )
