"""Rehearse losing a node of a shipped sbatch launcher's job on a local CPU SLURM cluster:
SIGKILL every rank on the last node after a checkpoint, resubmit the same command on one node
fewer without a config edit, and check that the job resumes from the last complete checkpoint
in a layout that fits, with the whole training state, and finishes. Prints the checks, the
figures (steps lost, layout chosen, time) and both sbatch commands.

Front door: `python tools/rehearse_node_loss.py --help` gives the usage; the code is
megatron_branchnorm/workflows/rehearse_node_loss.py.
"""

from megatron_branchnorm.workflows.rehearse_node_loss import main

if __name__ == "__main__":
    raise SystemExit(main())
