"""Rehearse a shipped sbatch launcher at its real topology on a local CPU SLURM cluster before
spending GPU hours: start K local nodes, submit the launcher unchanged (only the model's width
shrunk), send SIGUSR1 after a few updates, and check that every rank checkpoints and exits 75,
the job requeues, resumes and finishes, and metrics.jsonl has every step once. Prints the
checks, the figures (start-up, time per update, signal to exit, save, requeue to resume, total)
and the exact sbatch command; exit 0 when every check passed.

Front door: `python tools/rehearse_slurm.py --help` gives the usage; the code is
megatron_branchnorm/workflows/rehearse_slurm.py.
"""

from megatron_branchnorm.workflows.rehearse_slurm import main

if __name__ == "__main__":
    raise SystemExit(main())
