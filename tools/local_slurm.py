"""Start or stop a real SLURM cluster of K nodes on this host (munged, slurmctld, K slurmd), every
file in one directory; for rehearsing the sbatch launchers on CPU before GPU hours.

Front door: `python tools/local_slurm.py --help` gives the usage; the code is
megatron_branchnorm/workflows/local_slurm.py.
"""

from megatron_branchnorm.workflows.local_slurm import main

if __name__ == "__main__":
    raise SystemExit(main())
