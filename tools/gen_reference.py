#!/usr/bin/env python
"""Write docs/reference/ (config keys, every front door's --help, exit codes, on-disk formats,
environment variables) from the code; ``--check`` says which pages are out of date.

Front door: `python tools/gen_reference.py --help` gives the usage; the code is
megatron_branchnorm/commands/reference.py.
"""

from megatron_branchnorm.commands.reference import main

if __name__ == "__main__":
    raise SystemExit(main())
