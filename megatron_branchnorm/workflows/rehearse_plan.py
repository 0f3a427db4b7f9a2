"""The rehearsal's plan (``tools/rehearse.py``, workflows/rehearse.py): the config shrunk in
width only, its real topology (stages from the config, world size from its SLURM launcher or
``--world``), the other topology of check 3, and the trainer arguments of each of the five runs.
Checked up front: every run is a valid config before any rank starts."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from megatron_branchnorm.config import ConfigError, load_config
from megatron_branchnorm.errors import UserError
from megatron_branchnorm.runner.launch import CHECKOUT

SHRINK: tuple[str, ...] = (
    "model.vocab_size=64",
    "model.hidden_size=16",
    "model.ffn_hidden_size=32",
    "model.num_attention_heads=2",
    "model.max_positions=64",
    "model.dropout=0",
    "model.attention_dropout=0",
    "model.activation_dropout=0",
    "data.dataset=synthetic",
    "data.max_tokens=128",
    "data.max_length=24",
    "train.deepspeed_config=ds_configs/cpu_fp32.json",
)
"""Overrides that shrink the width only (depth, stages, schedule and micro-batches stay)."""
RUN_KEYS: tuple[str, ...] = (
    "train.log_interval=1",
    "train.save_interval=0",
    "train.eval_interval=0",
)
"""Every update logged; checkpoints only at the end or on the signal; no validation."""


class RehearsalError(UserError, ValueError):
    """Bad input to the rehearsal (config, topology, work directory): a one-line message."""


@dataclasses.dataclass
class Plan:
    """What to run: the config, its topology, the step counts."""

    config: str
    """Shipped config name or YAML path."""
    overrides: list[str]
    """SHRINK plus the user's ``--set`` overrides, applied to every run."""
    world: int
    """Ranks of the real topology."""
    world_source: str
    """Where the world size came from (the launcher's #SBATCH lines or --world)."""
    stages: int
    """Pipeline stages of the real topology (the config's, or --stages)."""
    other_stages: int
    """Pipeline stages of the other topology (same world size)."""
    micro_batches: int
    """Micro-batches per update and replica in the real topology."""
    config_micro_batches: int
    """The config's own train.micro_batches."""
    steps: int
    """Updates of the uninterrupted run (and the parity check)."""
    other_steps: int
    """Updates of the other topology after ``steps``."""
    signal_after: int
    """SIGUSR1 once rank 0 logged this update."""
    timeout_s: float
    """Wall-clock limit of each run."""
    layers: tuple[int, int]
    """(encoder, decoder) layers."""
    command: str = ""
    """The command line of the rehearsal (for the report)."""

    @property
    def dp(self) -> int:
        """Data-parallel size of the real topology."""
        return self.world // self.stages

    @property
    def other_dp(self) -> int:
        """Data-parallel size of the other topology."""
        return self.world // self.other_stages

    @property
    def other_micro_batches(self) -> int:
        """Micro-batches per replica in the other topology: the same global batch if it
        divides, else the real topology's per-replica count."""
        total = self.micro_batches * self.dp
        return total // self.other_dp if total % self.other_dp == 0 else self.micro_batches


def launcher_world(config: str) -> tuple[int, str] | None:
    """(nodes x tasks per node, description) from ``slurm/<config>.sh``; None without one."""
    name = Path(config).stem if config.endswith((".yaml", ".yml")) else config
    script = CHECKOUT / "slurm" / f"{name}.sh"  # an installed copy has no slurm/
    if not script.is_file():
        return None
    text = script.read_text(encoding="utf-8")
    nodes = re.search(r"^#SBATCH\s+--nodes[=\s](\d+)", text, re.M)
    tasks = re.search(r"^#SBATCH\s+--ntasks-per-node[=\s](\d+)", text, re.M)
    if not (nodes and tasks):
        return None
    n, t = int(nodes.group(1)), int(tasks.group(1))
    return n * t, f"slurm/{script.name}: {n} node(s) x {t} tasks"


def make_plan(
    config: str,
    sets: list[str] | None = None,
    world: int | None = None,
    stages: int | None = None,
    other_stages: int | None = None,
    micro_batches: int | None = None,
    steps: int = 4,
    other_steps: int = 1,
    signal_after: int = 1,
    timeout_s: float = 3600.0,
) -> Plan:
    """Resolve the topology and check that every run of the rehearsal is a valid config."""
    overrides = [*SHRINK, *(sets or [])]
    try:
        cfg = load_config(config, overrides)
    except ConfigError as exc:
        raise RehearsalError(str(exc)) from None
    stages = stages or cfg.pipeline.stages
    if world is None:
        found = launcher_world(config)
        if found is None:
            raise RehearsalError(
                f"--config {config}: no slurm/<name>.sh with #SBATCH --nodes and "
                "--ntasks-per-node next to it: pass --world"
            )
        world, source = found
    else:
        source = "--world"
    if world < 1 or stages < 1 or world % stages:
        raise RehearsalError(f"{stages} pipeline stages do not divide the world size {world}")
    if other_stages is None:
        other_stages = stages // 2 if stages > 1 else (2 if world % 2 == 0 else 1)
    if world % other_stages or other_stages == stages:
        raise RehearsalError(
            f"--other-stages {other_stages}: must divide the world size {world} and differ "
            f"from the real topology's {stages} stages"
        )
    if not 1 <= signal_after <= steps - 2:
        raise RehearsalError(
            f"--signal-after {signal_after} must be between 1 and --steps - 2 (two updates "
            "after the signal's checkpoint show an exact resume, Adam moments included)"
        )
    if other_steps < 1:
        raise RehearsalError("--other-steps must be >= 1")
    plan = Plan(
        config=config,
        overrides=overrides,
        world=world,
        world_source=source,
        stages=stages,
        other_stages=other_stages,
        micro_batches=micro_batches or cfg.train.micro_batches,
        config_micro_batches=cfg.train.micro_batches,
        steps=steps,
        other_steps=other_steps,
        signal_after=signal_after,
        timeout_s=timeout_s,
        layers=(cfg.model.encoder_layers, cfg.model.decoder_layers),
    )
    for extra in (
        run_overrides(plan, "uninterrupted", Path("x")),
        run_overrides(plan, "other_topology", Path("x")),
        run_overrides(plan, "reference", Path("x")),
    ):
        try:
            load_config(config, extra)
        except ConfigError as exc:
            raise RehearsalError(str(exc)) from None
    return plan


def run_world(plan: Plan, name: str) -> int:
    """Ranks of run ``name``."""
    return 1 if name == "reference" else plan.world


def run_save_dir(workdir: Path, name: str) -> Path:
    """The save_dir of run ``name`` (interrupted, resumed and other_topology share one)."""
    return workdir / ("interrupted" if name in ("resumed", "other_topology") else name)


def run_overrides(plan: Plan, name: str, save_dir: Path) -> list[str]:
    """The trainer's key=value arguments for run ``name``."""
    steps = plan.steps
    stages, micro = plan.stages, plan.micro_batches
    if name == "other_topology":
        stages, micro, steps = plan.other_stages, plan.other_micro_batches, steps + plan.other_steps
    elif name == "reference":
        stages, micro, steps = 1, plan.micro_batches * plan.dp, steps + plan.other_steps
    return [
        *plan.overrides,
        *RUN_KEYS,
        f"pipeline.stages={stages}",
        f"train.micro_batches={micro}",
        "pipeline.data_parallel=0",  # micro is per replica here: no config batch to share
        f"train.max_steps={steps}",
        f"train.save_dir={save_dir}",
    ]


def other_micro_batches(plan: dict) -> int:
    """Plan.other_micro_batches for a plan read back from JSON."""
    return Plan(**{**plan, "layers": tuple(plan["layers"])}).other_micro_batches
