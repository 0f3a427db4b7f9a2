#!/usr/bin/env python
"""Run the main job end to end on the built-in corpus (what `make demo` does).

Front door: `python tools/run_demo.py --help` gives the usage; the code is
megatron_branchnorm/commands/demo.py.
"""

from megatron_branchnorm.commands.demo import main

if __name__ == "__main__":
    raise SystemExit(main())
