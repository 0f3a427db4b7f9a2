"""The run's layout on the ranks it got: stage count, data-parallel size and micro-batches per
replica (docs/design.md §17).

Every layout keeps one global batch ``G`` (micro-batches per update; tokens per update are
``G x data.max_tokens``), each replica taking ``G / dp`` (:func:`global_batch`, the one rule
the trainer and tools/plan_memory.py share): the config's ``train.micro_batches x
pipeline.data_parallel`` when it sets ``pipeline.data_parallel``, else a resumed run's
checkpoint's, else ``train.micro_batches`` on each replica of the configured stages. So a run
that moves from 2 x 6 to 3 x 4 (data-parallel x micro-batches) reads the same global batches
in the same updates, and a fresh start on another allocation trains at the config's batch.
The configured ``pipeline.stages`` is taken when it divides the world size and its
data-parallel size divides G; otherwise ``pipeline.fallback_stages`` ("auto" or a list) is
tried in order, each candidate taken only where the memory planner says it fits the device.
When nothing fits, one line names the layouts that would.

A pure function of (config, world size, device memory, the checkpoint's G): every rank
decides the same (the device memory is agreed on beforehand, the smallest rank's).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from megatron_branchnorm.config import ConfigError, ExperimentConfig
from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.formats import train_config
from megatron_branchnorm.parallel.partition import spec_entries
from megatron_branchnorm.parallel.planner import plan_run, stage_counts


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
    ckpt.check_listing(save_dir / tag)  # no file of the tag is read before
    info = train_config.read_train_record(save_dir / tag)
    micro = train_config.saved_micro_batches(info)
    dp = train_config.saved_data_parallel(save_dir / tag, info)
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


@dataclass(frozen=True)
class GlobalBatch:
    """The micro-batches per update every layout of the run keeps, and whose figure it is."""

    per_update: int
    source: str  # for the notes: "the config's 128 micro-batches per update (...)"

    def per_replica(self, dp: int) -> int | None:
        """Micro-batches per replica at data-parallel size ``dp`` (None: ``dp`` does not
        divide the global batch)."""
        return self.per_update // dp if self.per_update % dp == 0 else None


def global_batch(cfg: ExperimentConfig, world: int, saved: SavedBatch | None) -> GlobalBatch:
    """The global batch a run on ``world`` ranks keeps (module docstring): the config's when
    it sets ``pipeline.data_parallel``; else the checkpoint's, unless the config changes
    ``train.micro_batches`` from it (an explicit change); else ``train.micro_batches`` on each
    replica of ``pipeline.stages``. ConfigError in one line when none applies: a config
    without ``pipeline.data_parallel`` whose stages do not divide ``world``."""
    micro, dp, stages = cfg.train.micro_batches, cfg.pipeline.data_parallel, cfg.pipeline.stages
    if dp > 0:
        return GlobalBatch(
            micro * dp,
            f"the config's {micro * dp} micro-batches per update (train.micro_batches {micro} "
            f"x pipeline.data_parallel {dp})",
        )
    if saved is not None and micro == saved.micro_batches:
        return GlobalBatch(
            saved.per_update,
            f"the checkpoint's {saved.per_update} micro-batches per update (saved at "
            f"data-parallel size {saved.data_parallel})",
        )
    if world % stages == 0:
        return GlobalBatch(
            micro * (world // stages),
            f"{micro * (world // stages)} micro-batches per update (train.micro_batches {micro}"
            f" x the {world // stages} replicas of pipeline.stages={stages})",
        )
    raise ConfigError(
        f"config key pipeline.data_parallel: not set, and pipeline.stages={stages} does not "
        f"divide the world size {world}: no layout can take the config's global batch (set "
        f"pipeline.data_parallel to the data-parallel size train.micro_batches={micro} is for, "
        f"or pipeline.stages to a divisor of {world})"
    )


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
    would fit and keep the global batch when none of the allowed ones does."""
    stages = cfg.pipeline.stages
    batch = global_batch(cfg, world, saved)
    changed = None
    if saved is not None and saved.per_update != batch.per_update:
        changed = f"the global batch changes from the checkpoint's {saved.per_update} to "
    if world % stages == 0:
        micro = batch.per_replica(world // stages)
        if micro is not None:
            notes = []
            if micro != cfg.train.micro_batches:
                notes.append(
                    f"train.micro_batches {cfg.train.micro_batches} -> {micro}: {batch.source} "
                    f"kept at data-parallel size {world // stages}"
                )
            if changed:
                notes.append(changed + batch.source)
            note = "; ".join(notes) or None
            return Layout(stages, world // stages, micro, cfg.pipeline.partition, note)
    why = (
        f"pipeline.stages={stages} does not divide the world size {world}"
        if world % stages
        else f"its data-parallel size {world // stages} does not divide {batch.source}"
    )
    for s in fallbacks(cfg, world):
        if s == stages or world % s or s > len(spec_entries(cfg.model)):
            continue
        micro = batch.per_replica(world // s)
        if micro is not None and _fits(cfg, world, device, s, micro):
            note = (
                f"layout {s} stages x {world // s} data-parallel, {micro} micro-batches per "
                f"replica: {why}; pipeline.fallback_stages={cfg.pipeline.fallback_stages} "
                f"chose it (the planner says it fits; {batch.source} kept)"
                + (f"; {changed}{batch.per_update}" if changed else "")
            )
            return Layout(s, world // s, micro, "balanced", note)
    fitting = []
    for s in stage_counts(cfg, world):
        micro = batch.per_replica(world // s)
        if micro is not None and _fits(cfg, world, device, s, micro):
            fitting.append(f"{s} x {world // s} ({micro} micro-batches)")
    tried = (
        cfg.pipeline.fallback_stages
        or "none: set pipeline.fallback_stages=auto to let the run choose"
    )
    raise ConfigError(
        f"config key pipeline.stages: {why}; fallback stages tried: {tried}; GPU counts that "
        f"keep {batch.per_update} micro-batches per update at pipeline.stages={stages}: "
        f"{keeping_worlds(stages, batch)}; layouts (stages x data-parallel) that fit {world} "
        f"ranks and keep {batch.per_update} micro-batches per update: "
        f"{', '.join(fitting) if fitting else 'none'}"
    )


MAX_LISTED_WORLDS = 12
"""The most GPU counts a refusal lists (the smallest of them)."""


def keeping_worlds(stages: int, batch: GlobalBatch) -> str:
    """The world sizes at which ``stages`` stages keep ``batch``: ``stages`` times each
    data-parallel size that divides it (the smallest :data:`MAX_LISTED_WORLDS`)."""
    g = batch.per_update
    small = [d for d in range(1, math.isqrt(g) + 1) if g % d == 0]
    sizes = sorted({*small, *(g // d for d in small)})
    worlds = [str(stages * d) for d in sizes[:MAX_LISTED_WORLDS]]
    return ", ".join(worlds) + (", ..." if len(sizes) > MAX_LISTED_WORLDS else "")
