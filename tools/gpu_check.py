"""Check this project on a CUDA machine and print one table (megatron_branchnorm/gpu_check.py).

    python tools/gpu_check.py                  # every GPU this machine has
    python tools/gpu_check.py --device cpu     # the same checks on the CPU, in small sizes

Offline (a GPU machine without a network): install torch, then this project from a wheelhouse
built on a networked machine with ``tools/build_wheelhouse.sh`` (README: GPU check).
Exit 0: every check passed; 1: one failed (the table says which); 2: bad input.
"""

from megatron_branchnorm.commands.gpu_check import main

if __name__ == "__main__":
    raise SystemExit(main())
