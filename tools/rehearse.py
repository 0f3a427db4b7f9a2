"""Rehearse a config at its real depth and topology, width shrunk, on gloo ranks on this machine.

Front door: `python tools/rehearse.py --help` gives the usage; the code is
megatron_branchnorm/workflows/rehearse.py.
"""

from megatron_branchnorm.workflows.rehearse import main

if __name__ == "__main__":
    raise SystemExit(main())
