"""Train a deep encoder-decoder with BranchNorm on DeepSpeed's pipeline engine.

    deepspeed --num_gpus 2 megatron_branchnorm/train.py --config tiny_cpu pipeline.stages=2
    python megatron_branchnorm/train.py --config tiny_cpu train.max_steps=20   # one process

--config takes a YAML path or the name of a config shipped in megatron_branchnorm/configs/;
``section.key=value`` arguments override it. ``--print-config`` prints the resolved config
(YAML, every key) and exits; ``--config SAVE_DIR/config.yaml`` starts again with the settings
of a run's latest start (a resume, without repeating its overrides). Rank 0 checks that
MASTER_PORT is free before anything slow (runner/launch.py). Exit codes
(training/exit_codes.py): 0 done, 2 bad input, 3 non-finite updates, 4 another rank lost (or
the rendezvous not complete within train.collective_timeout_s), 5 the GPU out of memory, 75
stopped by SIGUSR1/SIGTERM after a checkpoint, or by SIGTERM while starting (requeue), 130
Ctrl-C. While the rank starts, SIGTERM, SIGINT and the death of
DeepSpeed's launcher end it at once (stop_signals).
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a script: make the package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:
    # First of all: the stop signals and the launcher watch hold from here (stop_signals).
    from megatron_branchnorm.training import stop_signals

    stop_signals.install()

    from megatron_branchnorm.cli import interrupts_deferred, run_main
    from megatron_branchnorm.config import config_yaml, load_config
    from megatron_branchnorm.formats.outputs import write_stdout
    from megatron_branchnorm.runner.launch import check_rendezvous_port
except KeyboardInterrupt:  # Ctrl-C before run_main takes over: the same line and exit code
    print("interrupted (Ctrl-C): nothing half-written was kept", file=sys.stderr)
    os._exit(130)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """--config NAME [--local_rank N anywhere] [section.key=value ...]."""
    parser = argparse.ArgumentParser(
        description="Train a deep BranchNorm encoder-decoder on DeepSpeed's pipeline engine.",
        epilog="Overrides: section.key=value, e.g. model.encoder_layers=12 train.max_steps=100. "
        "Resume a run with the same settings: --config SAVE_DIR/config.yaml (the resolved "
        "config of its latest start; add only what changes). See what a config sets: "
        "--config NAME [overrides] --print-config.",
    )
    parser.add_argument("--config", required=True, help="YAML path or shipped config name")
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config (the YAML with overrides and defaults) and exit",
    )
    parser.add_argument(
        "--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher"
    )
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    args, unknown = parser.parse_known_args(argv)
    bad = [u for u in unknown if u.startswith("-")]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    args.overrides += unknown
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    return args


def _train(argv: list[str] | None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        write_stdout(config_yaml(cfg))
        return 0
    check_rendezvous_port()  # a busy port now, not after a minute of start-up
    with interrupts_deferred():  # torch, NumPy, DeepSpeed: a Ctrl-C waits for their imports
        from megatron_branchnorm.training.trainer import run

    return run(cfg)


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse, build, run. Bad input (config, data, checkpoint, DeepSpeed JSON,
    save_dir, a full disk) is one line and exit 2 on every rank; Ctrl-C exits 130."""
    return run_main(_train, argv)


def console_main() -> None:
    """The ``mbn-train`` console script (setup.py): :func:`main` on ``sys.argv``, then
    :func:`exit_now` with its exit code."""
    exit_now(main())


def exit_now(code: int) -> None:
    """End the process with ``code`` once the output is flushed, skipping the interpreter's
    teardown. Under load a rank sometimes aborted there, after the trainer had returned, with
    "terminate called without an active exception" from a C++ thread of the communication
    stack (seen with exit codes 0 and 75, in the demo, the 2-rank and the SLURM tests, even
    after destroy_process_group): 75 became 134 and SLURM did not requeue the job. Everything
    the trainer writes is closed before main() returns (checkpoint, metrics, TensorBoard, lock).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
