"""Long fault-injection runs behind docs/reliability.md (the CI-sized suite is tests/faults).

Front door: `python tools/fault_sweep.py --help` gives the usage; the code is
megatron_branchnorm/experiments/fault_sweep.py.
"""

import sys

from megatron_branchnorm.experiments.fault_sweep import main

if __name__ == "__main__":
    sys.exit(main())
