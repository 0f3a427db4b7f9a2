#!/usr/bin/env python
"""Plot training curves of one or more runs: loss and validation loss, gradient norm, learning
rate and BranchNorm alpha against the update step, the runs overlaid, as one PNG.

    python tools/plot_training.py runs/demo/train --output runs/demo/plots/training.png
    python tools/plot_training.py runs/a runs/b --labels branchnorm,postln --output cmp.png

Each RUN_DIR is a train.save_dir holding metrics.jsonl.
"""

from megatron_branchnorm.commands.plot import main

if __name__ == "__main__":
    raise SystemExit(main())
