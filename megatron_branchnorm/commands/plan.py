"""Plan GPU memory and pipeline bubble for a config before launching it; builds no model.

    python tools/plan_memory.py --config opus100_1000L --gpus 32 --gpu-memory 40GB
    python tools/plan_memory.py --config opus100_1000L --gpus 8 --gpu-memory 80GB --stages 8
    python tools/plan_memory.py --config opus100_200L --gpus 8 --gpu-memory 80GB --stages auto

Without ``--stages`` or ``--micro-batches`` it plans the layout the trainer would take
(training/layout.py): every layout keeps the run's global batch (``training.layout.global_batch``:
the config's ``train.micro_batches x pipeline.data_parallel``, or a resumed run's in
``train.save_dir``), and where ``pipeline.stages`` does not divide ``--gpus``,
``pipeline.fallback_stages`` chooses (a line ``layout: ...`` says what changed; the trainer decides
again with the memory its devices report). The sbatch launchers call it this way before starting
the ranks. ``--stages N`` plans the trainer's run with ``pipeline.stages=N`` and ``--stages auto``
the fewest stages that fit, both keeping the same global batch; ``--micro-batches`` sets the
micro-batches per replica instead. With ``--stages auto`` a table below the plan lists every
layout tried, with its peak and its time per update eagerly and with CUDA graphs, and the
fastest that fits each way (which need not be the fewest stages).

Prints per stage: parameters, weights + gradients, ZeRO-1 optimizer state, activation memory
with and without checkpointing, the pipeline bubble (p-1)/(m+p-1), whether it fits, and a line
``total parameters: X.XXB``; with ``model.cuda_graphs=on`` (or auto) also each stage's
CUDA-graph static memory and how many graph sets fit beside the run (training/cuda_graphs.py);
then each stage's time per micro-batch (GPU and host, eagerly and with CUDA graphs), the time
per update of each and the days ``train.max_steps`` updates take.
``section.key=value`` overrides apply as in train.py. The vocabulary is the trainer's: the
config's ``model.vocab_size``, else the ``vocab_size`` of the manifest of the DATA_DIR that
``data.dataset`` names (a config that disagrees with it is refused, as the trainer refuses it),
else ``--vocab-size`` (where that DATA_DIR is not on this machine). Exit codes: 0 fits, 1 does not fit, 2 bad
input (one line ``error: ...``), 130 Ctrl-C. The estimates are explained in
megatron_branchnorm/parallel/planner.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from megatron_branchnorm.cli import ArgumentParser, float_flag, int_flag, run_main
from megatron_branchnorm.config import ExperimentConfig, load_config
from megatron_branchnorm.data.buckets import max_shapes_of
from megatron_branchnorm.formats.data_dir import MANIFEST
from megatron_branchnorm.formats.outputs import write_stdout
from megatron_branchnorm.parallel.planner import (
    DEFAULT_TFLOPS,
    DEFAULT_VOCAB,
    PlanError,
    first_fitting,
    format_layouts,
    format_plan,
    layout_plans,
    parse_memory,
    plan_run,
)
from megatron_branchnorm.training.layout import Device, choose_layout, global_batch, saved_batch


def _stages(text: str) -> int | str:
    return "auto" if text == "auto" else int_flag(1)(text)


def _size(allow_zero: bool):
    def parse(text: str) -> float:
        try:
            return parse_memory(text, "value", allow_zero)
        except PlanError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix("value ")) from None

    return parse


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = ArgumentParser(
        prog="plan_memory.py",
        description="Per-stage memory, ZeRO-1 optimizer state, activations and pipeline bubble "
        "of a config on N GPUs (no model is built).",
    )
    parser.add_argument("--config", required=True, help="YAML path or shipped config name")
    parser.add_argument("--gpus", type=int_flag(1), required=True, help="total GPUs (world size)")
    parser.add_argument(
        "--gpu-memory",
        type=_size(allow_zero=False),
        default="80GB",
        help="memory per GPU, e.g. 40GB, 80GB",
    )
    parser.add_argument(
        "--stages",
        type=_stages,
        default=None,
        help="pipeline stages (default: the config's); 'auto' = fewest that fit",
    )
    parser.add_argument(
        "--micro-batch-tokens",
        type=int_flag(1),
        default=None,
        help="tokens per micro-batch (default: data.max_tokens)",
    )
    parser.add_argument(
        "--micro-batches",
        type=int_flag(1),
        default=None,
        help="micro-batches per data-parallel replica (default: the trainer's share of the "
        "global batch, training/layout.py)",
    )
    parser.add_argument(
        "--vocab-size",
        type=int_flag(1),
        default=None,
        help="vocabulary when neither the config nor the manifest of data.dataset (a DATA_DIR "
        f"on this machine) gives it (default: {DEFAULT_VOCAB})",
    )
    parser.add_argument(
        "--overhead",
        type=_size(allow_zero=True),
        default="3GB",
        help="fixed per-GPU overhead: CUDA context, NCCL buffers, fragmentation",
    )
    parser.add_argument(
        "--tflops",
        type=float_flag(1e-9),
        default=DEFAULT_TFLOPS,
        help="sustained TFLOP/s of a GPU's matmuls for the time estimate (the host's pace "
        "is the planner's, measured on an H100)",
    )
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    return parser.parse_args(argv)


def with_data_vocab(cfg: ExperimentConfig, vocab_size: int | None) -> ExperimentConfig:
    """``cfg`` with ``model.vocab_size`` as the trainer takes it (``training.data.resolve_vocab``:
    the config's, else the DATA_DIR manifest's; a mismatch is its one-line error) where
    ``data.dataset`` is a DATA_DIR with a manifest here; ``cfg`` otherwise. A ``vocab_size``
    asked for (``--vocab-size``) that the manifest contradicts is a warning on stderr."""
    if cfg.data.dataset == "synthetic" or not (Path(cfg.data.dataset) / MANIFEST).is_file():
        return cfg
    from megatron_branchnorm.training.data import resolve_vocab

    asked = cfg.model.vocab_size
    cfg = resolve_vocab(cfg)
    if asked is None and vocab_size is not None and vocab_size != cfg.model.vocab_size:
        print(
            f"warning: --vocab-size {vocab_size} differs from the vocab_size "
            f"{cfg.model.vocab_size} of {Path(cfg.data.dataset) / MANIFEST}: planning "
            f"{cfg.model.vocab_size}, as the trainer takes it",
            file=sys.stderr,
            flush=True,
        )
    return cfg


def _plan(argv: list[str] | None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    cfg = with_data_vocab(load_config(args.config, args.overrides), args.vocab_size)
    kwargs = dict(
        micro_batch_tokens=args.micro_batch_tokens,
        micro_batches=args.micro_batches,
        vocab_size=args.vocab_size,
        overhead=args.overhead,
        tflops=args.tflops,
        config_name=args.config,
    )
    note, per_update = None, None
    if args.micro_batches is None:  # the trainer's share of the global batch
        saved = saved_batch(Path(cfg.train.save_dir))
        if args.stages == "auto":
            per_update = global_batch(cfg, args.gpus, saved).per_update
        elif args.stages is None or args.gpus % args.stages == 0:  # else plan_run says why
            if args.stages is not None:  # the trainer's run with pipeline.stages=N
                cfg = dataclasses.replace(
                    cfg,
                    pipeline=dataclasses.replace(
                        cfg.pipeline, stages=args.stages, fallback_stages=""
                    ),
                )
            device = Device(args.gpu_memory, args.overhead)
            layout = choose_layout(cfg, args.gpus, device, saved)
            cfg, note = layout.apply(cfg), layout.note
    # the bucket shapes graphs would capture (their time), and their static buffers per stage
    # where the config turns the graphs on
    shapes, graphs = max_shapes_of(cfg.data.bucket_shapes), cfg.model.cuda_graphs != "off"
    layouts = ""
    if args.stages == "auto":  # the fewest stages that fit (planner.auto_stages), and the rest
        plans = layout_plans(cfg, args.gpus, args.gpu_memory, per_update, **kwargs)
        plans = [p.with_shapes(shapes, graphs) for p in plans]
        plan = first_fitting(plans)
        layouts = "\n" + format_layouts(plans, plan) + "\n"
    else:
        plan = plan_run(cfg, args.gpus, args.gpu_memory, stages=args.stages, **kwargs)
        plan = plan.with_shapes(shapes, graphs)
    write_stdout((f"layout: {note}\n" if note else "") + format_plan(plan) + "\n" + layouts)
    return 0 if plan.fits() else 1


def main(argv: list[str] | None = None) -> int:
    """Parse, plan, print. Bad input is one line ``error: ...`` and exit 2."""
    return run_main(_plan, argv)


if __name__ == "__main__":
    sys.exit(main())
