"""Train a deep encoder-decoder with BranchNorm on DeepSpeed's pipeline engine (``mbn-train``).

    mbn-train --config tiny_cpu train.max_steps=20                        # one process
    deepspeed --num_gpus 2 --module megatron_branchnorm.train --config tiny_cpu pipeline.stages=2

The same command line as ``megatron_branchnorm/train.py`` (its docstring); that file stays the
script the launchers run by path.
"""

from __future__ import annotations

# Imported first: it installs the SIGUSR1/SIGTERM recorder (stop_signals) at import.
from megatron_branchnorm.train import exit_now
from megatron_branchnorm.train import main as train_main


def main(argv: list[str] | None = None) -> int:
    """Run train.main and end the process with its exit code (train.exit_now)."""
    exit_now(train_main(argv))
    return 0  # not reached: exit_now ends the process


if __name__ == "__main__":
    main()
