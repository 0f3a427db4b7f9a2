"""Rehearse a shipped sbatch launcher at its real topology on a local CPU SLURM cluster before
spending GPU hours: start K local nodes, submit the launcher unchanged (only the model's width
shrunk), send SIGUSR1 after a few updates, and check that every rank checkpoints and exits 75,
the job requeues, resumes and finishes, and metrics.jsonl has every step once. Prints the checks,
the figures (start-up, time per update, signal to exit, save, requeue to resume, total) and the
exact sbatch command; exit 0 when every check passed.

    python tools/rehearse_slurm.py                                     # opus100_1000L, 4 x 8 ranks
    python tools/rehearse_slurm.py --launcher slurm/opus100_200L.sh --nodes 2
    python tools/rehearse_slurm.py --cluster /tmp/mbslurm              # a cluster already started

The 1000-layer case needs ~10-13 GB of memory for its 32 ranks and ~13 minutes on 2 cores: run
it alone. Logic: megatron_branchnorm/rehearse_slurm.py and megatron_branchnorm/local_slurm.py.
"""

from megatron_branchnorm.commands.rehearse_slurm import main

if __name__ == "__main__":
    raise SystemExit(main())
