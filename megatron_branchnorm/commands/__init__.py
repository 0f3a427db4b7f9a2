"""The user commands, and the one registry of every front door of the package
(:data:`FRONT_DOORS`).

A *command* (this package) does one thing: parse, build, run, its ``main(argv=None) -> int``
one command line through ``cli.run_main`` once. A *workflow* (``megatron_branchnorm.workflows``)
runs a whole job, chaining commands and the trainer. An *experiment*
(``megatron_branchnorm.experiments``) is part of the research harness. Each runs as ``python -m
<module>``, through its front door ``tools/<script>.py`` in a checkout, or as a console script
of an installed copy; the trainer's entry is ``megatron_branchnorm/train.py`` (the launchers
run it by path and as a module).

Every other list of them derives from :data:`FRONT_DOORS` or is checked against it by
tests/core/test_front_doors.py: setup.py's console scripts (:func:`console_scripts`), the thin
``tools/*.py`` doors, ``runner.launch.WORKFLOWS`` and ``tool_command`` (the runner room may not
import this one, docs/design.md §9, so it keeps its own names), and the rooms of design §9.

This module holds data only and imports nothing but the standard library: setup.py reads it by
path before any dependency is installed, and every command imports it first (its package).
"""

from typing import NamedTuple

KINDS = ("command", "workflow", "experiment")
"""What a front door serves, each kind living in its own room (docs/design.md §9)."""


class FrontDoor(NamedTuple):
    """One front door: ``name`` (the user command's name, or the module's for an experiment),
    its ``kind`` (one of :data:`KINDS`), the ``module`` whose ``main`` it runs, its script
    ``tools/<tool>.py`` (None: run as ``python -m module`` only), and its console script
    ``console`` in an installed copy (None: none), which calls ``module:entry``."""

    name: str
    kind: str
    module: str
    tool: str | None = None
    console: str | None = None
    entry: str = "main"


_C = "megatron_branchnorm.commands."
_W = "megatron_branchnorm.workflows."
_E = "megatron_branchnorm.experiments."

FRONT_DOORS: tuple[FrontDoor, ...] = (
    # train: ``exit_now`` skips the interpreter's teardown after training (train.py).
    FrontDoor("train", "command", "megatron_branchnorm.train", None, "mbn-train", "console_main"),
    FrontDoor("preprocess", "command", _C + "preprocess", "preprocess_data", "mbn-preprocess"),
    FrontDoor("convert", "command", _C + "convert", "convert_checkpoint", "mbn-convert"),
    FrontDoor("translate", "command", _C + "translate", "translate", "mbn-translate"),
    FrontDoor("evaluate", "command", _C + "evaluate", "evaluate", "mbn-evaluate"),
    FrontDoor("plan", "command", _C + "plan", "plan_memory", "mbn-plan"),
    FrontDoor("plot", "command", _C + "plot", "plot_training", "mbn-plot"),
    FrontDoor("corpus", "command", _C + "corpus", "build_locale_corpus", "mbn-corpus"),
    FrontDoor("opus_like", "command", _C + "opus_like", "make_opus_like_corpus"),
    FrontDoor("watch_bleu", "command", _C + "watch_bleu", "watch_bleu", "mbn-watch-bleu"),
    # A checkout's developer tool (it writes the checkout's docs/reference/): no console script.
    FrontDoor("reference", "command", _C + "reference", "gen_reference"),
    FrontDoor("demo", "workflow", _W + "demo", "run_demo", "mbn-demo"),
    FrontDoor("rehearse", "workflow", _W + "rehearse", "rehearse", "mbn-rehearse"),
    FrontDoor("gpu_check", "workflow", _W + "gpu_check", "gpu_check", "mbn-gpu-check"),
    # The SLURM workflows use the checkout's slurm/ launchers: no console script.
    FrontDoor("local_slurm", "workflow", _W + "local_slurm", "local_slurm"),
    FrontDoor("rehearse_slurm", "workflow", _W + "rehearse_slurm", "rehearse_slurm"),
    FrontDoor("rehearse_node_loss", "workflow", _W + "rehearse_node_loss", "rehearse_node_loss"),
    FrontDoor("analyze_model", "experiment", _E + "analyze_model", "analyze_model"),
    FrontDoor("apex_layernorm", "experiment", _E + "apex_layernorm", "apex_check"),
    FrontDoor("bench_anchors", "experiment", _E + "bench_anchors", "_bench_anchors"),
    FrontDoor("bench_micro", "experiment", _E + "bench_micro", "_bench_micro"),
    FrontDoor("bench_models", "experiment", _E + "bench_models", "_bench_models"),
    FrontDoor(
        "bench_pipeline_shapes", "experiment", _E + "bench_pipeline_shapes", "bench_pipeline_shapes"
    ),
    FrontDoor("bench_plan", "experiment", _E + "bench_plan"),
    FrontDoor("benchmark", "experiment", _E + "benchmark", "benchmark"),
    FrontDoor("compare_metrics", "experiment", _E + "compare_metrics", "compare_metrics"),
    FrontDoor("depth_study", "experiment", _E + "depth_study", "depth_study"),
    FrontDoor(
        "fairseq_side_by_side", "experiment", _E + "fairseq_side_by_side", "fairseq_side_by_side"
    ),
    # The trainer with faults patched in (tests/faults, fault_sweep): a module, no script.
    FrontDoor("fault_inject", "experiment", _E + "fault_inject"),
    FrontDoor("fault_sweep", "experiment", _E + "fault_sweep", "fault_sweep"),
    FrontDoor("gpu_bench", "experiment", _E + "gpu_bench", "gpu_bench", "mbn-gpu-bench"),
    FrontDoor("graph_pool", "experiment", _E + "graph_pool"),
    FrontDoor("launches", "experiment", _E + "launches"),
    FrontDoor("probe_learning", "experiment", _E + "probe_learning", "probe_learning"),
    FrontDoor("source_dependence", "experiment", _E + "source_dependence", "source_dependence"),
    FrontDoor("sweep", "experiment", _E + "sweep", "sweep"),
)
"""Every front door, once."""

OUTPUT_OPTIONS: dict[str, dict[str, str]] = {
    "train": {},  # train.save_dir is a config key: formats.dirs.check_run_dir
    "preprocess": {"--output": "dir", "--stats": "file"},
    "convert": {"--output": "dir"},
    "translate": {"--output": "file"},
    "evaluate": {"--json": "file", "--hyp-dir": "dir"},
    "plan": {},
    "plot": {"--output": "file"},
    "corpus": {"--output": "dir"},
    "opus_like": {"--output": "dir"},
    "watch_bleu": {},  # valid_bleu.jsonl inside the run it scores, a run's own entry
    "reference": {},  # the checkout's docs/reference/ pages, its own
    "demo": {"--out": "dir"},
    "rehearse": {"--workdir": "dir", "--json": "file", "--markdown": "file"},
    "gpu_check": {"--workdir": "dir", "--json": "file"},
    "local_slurm": {"--dir": "dir"},
    "rehearse_slurm": {"--work": "dir"},
    "rehearse_node_loss": {"--work": "dir"},
    "analyze_model": {"--output": "file", "--json": "file"},
    "apex_layernorm": {"--build-dir": "dir", "--json": "file"},
    "bench_anchors": {},
    "bench_micro": {},
    "bench_models": {},
    "bench_pipeline_shapes": {},
    "bench_plan": {"--work": "dir", "--json": "file"},
    "benchmark": {"--workdir": "dir", "--json": "file"},
    "compare_metrics": {},
    "depth_study": {"--out": "dir"},
    "fairseq_side_by_side": {"--out": "dir"},
    "fault_inject": {},  # the trainer's command line
    "fault_sweep": {"--out": "dir"},
    "gpu_bench": {"--workdir": "dir", "--json": "file"},
    "graph_pool": {},
    "launches": {"--json": "file"},  # --out: with --child only, spawn_child's temporary file
    "probe_learning": {"--output": "file"},
    "source_dependence": {},
    "sweep": {"submit --out": "dir", "table --markdown": "file", "table --json": "file"},
}
"""Every option of every front door (by its name) that names a file (``"file"``) or a
directory (``"dir"``) it writes, a sub-command's as ``"SUB --flag"``. Each goes through
formats/outputs.py's placement rules (never over an input, never inside a directory of a
known kind unless it is the tool's own output, never over what the tool did not write without
``--overwrite``), checked before any work; tests/faults/test_output_placement.py checks this
table against each door's parser and runs every option against a run's files and a user's."""

COMMANDS = {d.name: d.module for d in FRONT_DOORS if d.kind in ("command", "workflow")}
"""Each user command's name (a command's or a workflow's) and the module whose ``main`` it
runs (``python -m MODULE``; ``runner.launch.tool_command(name)``)."""


def console_scripts() -> list[str]:
    """setup.py's ``console_scripts``: ``NAME=MODULE:ENTRY`` for each door that has one."""
    return [f"{d.console}={d.module}:{d.entry}" for d in FRONT_DOORS if d.console]
