"""The pipeline layer list and its partition into stages: pure functions, no model is built.

The spec list (docs/design.md §1) is a file format: DeepSpeed names checkpoint files by the
index in it, so its shape never depends on the residual scheme. The maps from a layer file's
(or an engine parameter's) key to the flat model's key live here too, so the converter needs
no DeepSpeed.

    index   0        1..N        N+1        N+2         N+3..N+M+2   N+M+3       N+M+4
    entry   embed    enc_1..N    enc_final  dec_embed   dec_1..M     dec_final   output(+loss)

``partition_plan`` returns stage boundaries ``parts`` (len stages + 1; stage s owns indices
parts[s] .. parts[s+1]-1), balancing a per-token FLOP cost in which a decoder layer (self-
and cross-attention) costs more than an encoder layer and the output projection costs
d x V. A hand-written layout such as ``"E e*6 | e*6 d*2 | d*10 L"`` pins the split instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from megatron_branchnorm.config import ConfigError, ModelConfig
from megatron_branchnorm.formats.files import quote

KINDS = ("embed", "enc", "enc_final", "dec_embed", "dec", "dec_final", "output")


@dataclass(frozen=True)
class SpecEntry:
    """One entry of the pipeline layer list."""

    index: int
    kind: str  # one of KINDS
    layer: int  # encoder/decoder layer number (0-based), -1 otherwise
    name: str  # the flat model's module prefix ("encoder_layers.3", "embedding", ...)


def spec_entries(cfg: ModelConfig) -> list[SpecEntry]:
    """The pipeline layer list of ``cfg`` with each index's flat-model name."""
    n, m = cfg.encoder_layers, cfg.decoder_layers
    out = [SpecEntry(0, "embed", -1, "embedding")]
    out += [SpecEntry(1 + i, "enc", i, f"encoder_layers.{i}") for i in range(n)]
    out.append(SpecEntry(n + 1, "enc_final", -1, "encoder_final_norm"))
    out.append(SpecEntry(n + 2, "dec_embed", -1, "decoder_embed"))
    out += [SpecEntry(n + 3 + j, "dec", j, f"decoder_layers.{j}") for j in range(m)]
    out.append(SpecEntry(n + m + 3, "dec_final", -1, "decoder_final_norm"))
    out.append(SpecEntry(n + m + 4, "output", -1, "output"))
    return out


def spec_names(cfg: ModelConfig) -> dict[int, str]:
    """Index in the pipeline layer list -> flat-model module name (for the converter)."""
    return {e.index: e.name for e in spec_entries(cfg)}


TIED_KEY = "embed"
"""DeepSpeed's tie key of the shared embedding: the embed, dec_embed and output entries hold
one matrix, and the engine names its parameters ``tied_modules.embed.<local key>``."""
TIED_PREFIX = f"tied_modules.{TIED_KEY}."


def pipe_to_flat_key(entry_name: str, local_key: str) -> str:
    """Flat-model state-dict key of ``local_key`` in the layer file of entry ``entry_name``."""
    if entry_name == "embedding":
        return local_key  # "embedding.weight"
    if entry_name in ("encoder_final_norm", "decoder_final_norm"):
        return f"{entry_name}.{local_key.removeprefix('norm.')}"
    return f"{entry_name}.{local_key}"


def engine_param_to_flat_key(param_name: str, names: dict[int, str]) -> str:
    """Flat-model key of a pipeline engine's parameter name: ``tied_modules.embed.<key>`` (the
    shared embedding) or ``<index>.<local key>``, ``names`` being :func:`spec_names`.
    KeyError when the index is not in ``names``."""
    if param_name.startswith(TIED_PREFIX):
        return param_name.removeprefix(TIED_PREFIX)
    idx, local = param_name.split(".", 1)
    return pipe_to_flat_key(names[int(idx)], local)


def entry_costs(cfg: ModelConfig) -> list[float]:
    """Relative per-token cost (multiply-adds) of each entry of the layer list."""
    d, f, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size or 32000
    attn = 4 * d * d  # q, k, v, out projections (score/context terms omitted: length-free)
    enc = attn + 2 * d * f
    dec = 2 * attn + 2 * d * f  # + cross-attention
    small = 1.0 * d  # layer norms, embedding lookups: keep them positive, never free
    costs = {
        "embed": small,
        "enc": enc,
        "enc_final": small,
        "dec_embed": small,
        "dec": dec,
        "dec_final": small,
        "output": d * v,
    }
    return [float(costs[e.kind]) for e in spec_entries(cfg)]


def _heavy(entry: SpecEntry) -> bool:
    # Entries with parameters a stage can own on its own (finals may be identity).
    return entry.kind in ("embed", "enc", "dec")


def balanced_parts(costs: list[float], heavy: list[bool], stages: int) -> list[int]:
    """Contiguous split of ``costs`` into ``stages`` parts minimising the largest part's cost,
    each part holding at least one heavy entry. Exact dynamic programme, O(stages n^2)."""
    n = len(costs)
    if stages > sum(heavy):
        raise ConfigError(
            f"config key pipeline.stages: {stages} stages but only {sum(heavy)} layers with weights"
        )
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    heavy_prefix = np.concatenate([[0], np.cumsum(np.asarray(heavy, dtype=np.int64))])
    # best[k, i]: minimal largest part cost splitting the first i entries into k parts
    best = np.full((stages + 1, n + 1), np.inf)
    arg = np.zeros((stages + 1, n + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for k in range(1, stages + 1):
        for i in range(1, n + 1):
            j = np.arange(i)
            cand = np.maximum(best[k - 1, :i], prefix[i] - prefix[:i])
            cand[heavy_prefix[i] - heavy_prefix[j] == 0] = np.inf
            jbest = int(np.argmin(cand))
            best[k, i], arg[k, i] = cand[jbest], jbest
    parts = [n]
    i = n
    for k in range(stages, 0, -1):
        i = int(arg[k, i])
        parts.append(i)
    return parts[::-1]


_TOKEN = re.compile(r"^(E|L|e|d)(?:\*(\d+))?$")


def layout_parts(cfg: ModelConfig, layout: str) -> list[int]:
    """Stage boundaries from a layout string: stages separated by ``|``; tokens ``E``
    (embedding), ``e``/``e*K`` (encoder layers), ``d``/``d*K`` (decoder layers), ``L``
    (output + loss). enc_final stays with the last encoder layer, dec_embed goes with the
    first decoder layer, dec_final with the last decoder layer."""
    key = "pipeline.partition"
    expected = ["E"] + ["e"] * cfg.encoder_layers + ["d"] * cfg.decoder_layers + ["L"]
    counted: list[list[str]] = []
    total = 0
    for stage_text in layout.split("|"):
        items: list[str] = []
        for tok in stage_text.split():
            match = _TOKEN.match(tok)
            if not match:
                raise ConfigError(
                    f"config key {key}: bad layout token {quote(tok)} in {quote(layout)}"
                )
            digits = match.group(2) or "1"
            # A repeat count is bounded by the layers there are before it is expanded: a
            # count like e*99999999999999999999 overflowed, and e*999999999 allocated GBs.
            repeat = int(digits) if len(digits) <= 9 else len(expected) + 1
            total += repeat
            if total > len(expected):
                raise ConfigError(
                    f"config key {key}: layout {quote(layout)} counts more than the "
                    f"{len(expected)} entries of E e*{cfg.encoder_layers} "
                    f"d*{cfg.decoder_layers} L (at {quote(tok)})"
                )
            items += [match.group(1)] * repeat
        if not items:
            raise ConfigError(f"config key {key}: empty stage in layout {quote(layout)}")
        counted.append(items)
    flat = [x for items in counted for x in items]
    if flat != expected:
        raise ConfigError(
            f"config key {key}: layout {quote(layout)} does not spell E e*{cfg.encoder_layers} "
            f"d*{cfg.decoder_layers} L in order"
        )
    n = cfg.encoder_layers
    # spec index of each counted item
    positions = (
        [0]
        + [1 + i for i in range(n)]
        + [n + 3 + j for j in range(cfg.decoder_layers)]
        + [n + cfg.decoder_layers + 4]
    )
    parts = [0]
    seen = 0
    for items in counted[:-1]:
        seen += len(items)
        boundary = positions[seen]
        if seen == 1 + n:  # next item is the first decoder layer: dec_embed goes with it
            boundary = n + 2
        parts.append(boundary)
    parts.append(len(positions) + 3)
    return parts


def partition_plan(cfg: ModelConfig, stages: int, method: str = "balanced") -> list[int]:
    """Stage boundaries over the layer list for ``stages`` stages (see module docstring)."""
    entries = spec_entries(cfg)
    n = len(entries)
    if stages < 1:
        raise ConfigError(f"config key pipeline.stages: must be >= 1, got {stages}")
    if method == "balanced":
        parts = balanced_parts(entry_costs(cfg), [_heavy(e) for e in entries], stages)
    elif method == "uniform":
        if stages > n:
            raise ConfigError(f"config key pipeline.stages: {stages} stages for {n} entries")
        parts = [round(s * n / stages) for s in range(stages + 1)]
    else:
        parts = layout_parts(cfg, method)
        if len(parts) - 1 != stages:
            raise ConfigError(
                f"config key pipeline.partition: layout has {len(parts) - 1} stages but "
                f"pipeline.stages={stages}"
            )
    for s in range(stages):
        if parts[s + 1] <= parts[s]:
            raise ConfigError(f"config key pipeline.partition: stage {s} would be empty")
    return parts


def describe_plan(cfg: ModelConfig, parts: list[int]) -> str:
    """A readable one-line-per-stage summary of a plan."""
    entries = spec_entries(cfg)
    costs = entry_costs(cfg)
    total = sum(costs)
    lines = []
    for s in range(len(parts) - 1):
        chunk = entries[parts[s] : parts[s + 1]]
        enc = sum(e.kind == "enc" for e in chunk)
        dec = sum(e.kind == "dec" for e in chunk)
        extra = [e.kind for e in chunk if e.kind not in ("enc", "dec")]
        share = sum(costs[parts[s] : parts[s + 1]]) / total
        lines.append(
            f"stage {s}: entries {parts[s]}..{parts[s + 1] - 1} "
            f"({enc} enc, {dec} dec{', ' + ', '.join(extra) if extra else ''}) cost {share:.1%}"
        )
    return "\n".join(lines)
