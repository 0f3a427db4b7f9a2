"""Start or stop a real SLURM cluster of K nodes on this host (munged, slurmctld, K slurmd),
every file in one directory; for rehearsing the sbatch launchers on CPU before GPU hours.

    python tools/local_slurm.py start --dir /tmp/mbslurm --nodes 4 --cpus 8
    export SLURM_CONF=/tmp/mbslurm/slurm.conf          # what `start` and `env` print
    sbatch --nodes=4 --gres=none --cpus-per-task=1 slurm/opus100_1000L.sh
    python tools/local_slurm.py stop --dir /tmp/mbslurm

Needs root (SlurmUser=root, and slurm/munge are installed with apt-get when missing). The node
names (mbn1..mbnK) are added to /etc/hosts as 127.0.0.1 aliases when they do not resolve, and
left there. Logic: megatron_branchnorm/local_slurm.py.
"""

from megatron_branchnorm.commands.local_slurm import main

if __name__ == "__main__":
    raise SystemExit(main())
