"""How fast does a setting learn to translate? Train the flat model (one process, CPU or GPU) for a
number of updates per variant of a config, and follow the validation NLL, how much the source is
worth (NLL with the sources shuffled minus NLL with the true source) and, at the end, BLEU/chrF
by beam search on the first test sentences of every direction.

Front door: `python tools/probe_learning.py --help` gives the usage; the code is
megatron_branchnorm/experiments/probe_learning.py.
"""

import sys

from megatron_branchnorm.experiments.probe_learning import main

if __name__ == "__main__":
    sys.exit(main())
