#!/usr/bin/env python
"""Run the main job end to end on the built-in corpus (what `make demo` does).

Front door: `python tools/run_demo.py --help` gives the usage; the code is
megatron_branchnorm/workflows/demo.py.
"""

from megatron_branchnorm.workflows.demo import main

if __name__ == "__main__":
    raise SystemExit(main())
