"""Long fault-injection runs behind docs/reliability.md (the CI-sized suite is tests/faults).

    python tools/fault_sweep.py --out runs/faults kill-points   # every save point x rank
    python tools/fault_sweep.py --out runs/faults corruption    # every file x every damage
    python tools/fault_sweep.py --out runs/faults soak --preemptions 10 --hard-kills 2
    python tools/fault_sweep.py --out runs/faults hang          # SIGSTOP a rank: timeout bound

The logic lives in megatron_branchnorm/experiments/fault_sweep.py.
"""

import sys

from megatron_branchnorm.experiments.fault_sweep import main

if __name__ == "__main__":
    sys.exit(main())
