"""The run's layout on the ranks it got: stage count, data-parallel size and micro-batches per
replica (docs/design.md §17).

A resumed run keeps the checkpoint's micro-batches per update (``G = micro_batches x dp``:
tokens per update are ``G x data.max_tokens``), so a run that moves from 2 x 6 to 3 x 4
(data-parallel x micro-batches) reads the same global batches in the same updates. The
configured ``pipeline.stages`` is taken when it divides the world size and its data-parallel
size divides G; otherwise ``pipeline.fallback_stages`` ("auto" or a list) is tried in order,
each candidate taken only where the memory planner says it fits the device. When nothing
fits, one line names the layouts that would.

A pure function of (config, world size, device memory, the checkpoint's G): every rank
decides the same (the device memory is agreed on beforehand, the smallest rank's).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from megatron_branchnorm.config import ConfigError, ExperimentConfig
from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.partition import spec_entries
from megatron_branchnorm.planner import plan_run, stage_counts


@dataclass(frozen=True)
class SavedBatch:
    """What a checkpoint says of its updates: micro-batches per data-parallel rank and the
    data-parallel size (their product is the micro-batches per update)."""

    micro_batches: int
    data_parallel: int

    @property
    def per_update(self) -> int:
        return self.micro_batches * self.data_parallel


def saved_batch(save_dir: Path) -> SavedBatch | None:
    """The micro-batches per update of the checkpoint a run in ``save_dir`` resumes from (None
    on a fresh start, or a checkpoint that does not say)."""
    tag, _ = ckpt.resume_tag(save_dir)
    if tag is None:
        return None
    info = ckpt.read_train_config(save_dir / tag)
    micro = ckpt.saved_micro_batches(info)
    dp = ckpt.saved_data_parallel(save_dir / tag, info)
    return SavedBatch(micro, dp) if micro is not None and dp is not None else None


@dataclass(frozen=True)
class Layout:
    stages: int
    data_parallel: int
    micro_batches: int
    partition: str
    note: str | None  # what was changed from the config, and why (logged at start)

    def apply(self, cfg: ExperimentConfig) -> ExperimentConfig:
        return dataclasses.replace(
            cfg,
            pipeline=dataclasses.replace(
                cfg.pipeline, stages=self.stages, partition=self.partition
            ),
            train=dataclasses.replace(cfg.train, micro_batches=self.micro_batches),
        )


def fallbacks(cfg: ExperimentConfig, world: int) -> list[int]:
    """The stage counts ``pipeline.fallback_stages`` lets the run try, in order."""
    text = cfg.pipeline.fallback_stages.strip()
    if not text:
        return []
    if text == "auto":
        return stage_counts(cfg, world)
    return [int(s) for s in text.split(",")]


def _micro_batches(cfg: ExperimentConfig, saved: SavedBatch | None, dp: int) -> int | None:
    """Micro-batches per replica at data-parallel size ``dp``: the configured number on a fresh
    start (or when the config changes it from the checkpoint's: an explicit change of the
    global batch), else the checkpoint's per-update count over ``dp`` (None: ``dp`` does not
    divide it)."""
    if saved is None or cfg.train.micro_batches != saved.micro_batches:
        return cfg.train.micro_batches
    return saved.per_update // dp if saved.per_update % dp == 0 else None


@dataclass(frozen=True)
class Device:
    """What the planner sizes a stage against: the smallest rank's device memory, and the
    per-device overhead (CUDA context, NCCL, fragmentation; none on CPU ranks)."""

    memory: float
    overhead: float


def _fits(cfg: ExperimentConfig, world: int, device: Device, stages: int, micro: int) -> bool:
    balanced = dataclasses.replace(cfg.pipeline, partition="balanced")
    plan = plan_run(
        dataclasses.replace(cfg, pipeline=balanced),
        world,
        device.memory,
        stages=stages,
        micro_batches=micro,
        overhead=device.overhead,
    )
    return plan.fits()


def choose_layout(
    cfg: ExperimentConfig, world: int, device: Device, saved: SavedBatch | None
) -> Layout:
    """The layout this run trains in (module docstring); ConfigError naming the layouts that
    would fit when none of the allowed ones does."""
    stages = cfg.pipeline.stages
    keep = saved is not None and cfg.train.micro_batches == saved.micro_batches
    if world % stages == 0:
        micro = _micro_batches(cfg, saved, world // stages)
        if micro is not None:
            note = None
            if micro != cfg.train.micro_batches:
                note = (
                    f"train.micro_batches {cfg.train.micro_batches} -> {micro}: the checkpoint's "
                    f"{saved.per_update} micro-batches per update kept at data-parallel size "
                    f"{world // stages} (saved at {saved.data_parallel})"
                )
            return Layout(stages, world // stages, micro, cfg.pipeline.partition, note)
    why = (
        f"pipeline.stages={stages} does not divide the world size {world}"
        if world % stages
        else f"its data-parallel size {world // stages} does not divide the checkpoint's "
        f"{saved.per_update} micro-batches per update"
    )
    for s in fallbacks(cfg, world):
        if s == stages or world % s or s > len(spec_entries(cfg.model)):
            continue
        micro = _micro_batches(cfg, saved, world // s)
        if micro is not None and _fits(cfg, world, device, s, micro):
            note = (
                f"layout {s} stages x {world // s} data-parallel, {micro} micro-batches per "
                f"replica: {why}; pipeline.fallback_stages={cfg.pipeline.fallback_stages} "
                "chose it (the planner says it fits"
                + (f"; {saved.per_update} micro-batches per update kept)" if keep else ")")
            )
            return Layout(s, world // s, micro, "balanced", note)
    fitting = []
    for s in stage_counts(cfg, world):
        micro = _micro_batches(cfg, saved, world // s)
        if micro is not None and _fits(cfg, world, device, s, micro):
            fitting.append(f"{s} x {world // s} ({micro} micro-batches)")
    tried = (
        cfg.pipeline.fallback_stages
        or "none: set pipeline.fallback_stages=auto to let the run choose"
    )
    raise ConfigError(
        f"config key pipeline.stages: {why}; fallback stages tried: {tried}; layouts (stages x "
        f"data-parallel) that fit {world} ranks"
        + (f" and keep {saved.per_update} micro-batches per update" if keep else "")
        + f": {', '.join(fitting) if fitting else 'none'}"
    )
