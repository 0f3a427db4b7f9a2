"""Build NVIDIA Apex's fused LayerNorm from a source snapshot and check it against torch's on a
CUDA device (tools/apex_snapshot.sh makes the snapshot).

Front door: `python tools/apex_check.py --help` gives the usage; the code is
megatron_branchnorm/experiments/apex_layernorm.py.
"""

from megatron_branchnorm.experiments.apex_layernorm import main

if __name__ == "__main__":
    raise SystemExit(main())
