"""Check this project on a CUDA machine and print one table.

Front door: `python tools/gpu_check.py --help` gives the usage; the code is
megatron_branchnorm/workflows/gpu_check.py.
"""

from megatron_branchnorm.workflows.gpu_check import main

if __name__ == "__main__":
    raise SystemExit(main())
