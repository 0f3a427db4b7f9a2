"""Validation BLEU of a training run's checkpoints, from a companion process beside training.

Front door: `python tools/watch_bleu.py --help` gives the usage; the code is
megatron_branchnorm/commands/watch_bleu.py.
"""

from megatron_branchnorm.commands.watch_bleu import main

if __name__ == "__main__":
    raise SystemExit(main())
