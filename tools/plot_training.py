#!/usr/bin/env python
"""Plot training curves of one or more runs: loss and validation loss, gradient norm, learning rate
and BranchNorm alpha against the update step, the runs overlaid, as one PNG.

Front door: `python tools/plot_training.py --help` gives the usage; the code is
megatron_branchnorm/commands/plot.py.
"""

from megatron_branchnorm.commands.plot import main

if __name__ == "__main__":
    raise SystemExit(main())
