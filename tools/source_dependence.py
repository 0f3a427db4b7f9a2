"""How much an exported model reads its source: teacher-forced NLL per target token on held-out
sentences with the true source, with the sources shuffled across the batch, and with only the
language tag (an empty source). A model that has only learnt a target-side language model scores
the three alike (docs/demo.md).

Front door: `python tools/source_dependence.py --help` gives the usage; the code is
megatron_branchnorm/experiments/source_dependence.py.
"""

import sys

from megatron_branchnorm.experiments.source_dependence import main

if __name__ == "__main__":
    sys.exit(main())
