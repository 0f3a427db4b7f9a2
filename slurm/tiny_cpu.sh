#!/bin/bash
# tiny_cpu on 2 CPU ranks as 2 pipeline stages, through the same srun path as the GPU
# launchers: what tests/slurm/test_slurm.py submits to a real one-node SLURM.
#
#   sbatch slurm/tiny_cpu.sh                              # from the repository root
#   SAVE_DIR=/tmp/tiny EXTRA_ARGS="train.max_steps=20" sbatch slurm/tiny_cpu.sh
#   scancel --signal=USR1 JOBID                           # checkpoint, exit 75, requeue
#
# Environment overrides: slurm/common.sh.
#SBATCH --job-name=tiny_cpu
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=1
#SBATCH --time=00:30:00
#SBATCH --signal=USR1@60
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
set -euo pipefail

# sbatch runs a copy of this file: find the checkout from the submission directory.
MB_ROOT=${MB_ROOT:-}
for dir in "${SLURM_SUBMIT_DIR:-$PWD}" "${SLURM_SUBMIT_DIR:-$PWD}/.." "$(dirname "$0")/.."; do
    if [[ -z $MB_ROOT && -f "$dir/slurm/common.sh" ]]; then MB_ROOT=$(cd "$dir" && pwd); fi
done
if [[ -z $MB_ROOT ]]; then
    echo "error: cannot find the checkout: run sbatch from its root or set MB_ROOT" >&2
    exit 2
fi
# shellcheck source=slurm/common.sh
source "$MB_ROOT/slurm/common.sh"

CONFIG=${CONFIG:-tiny_cpu}
GPU_MEMORY=${GPU_MEMORY:-8GB}
EXTRA_ARGS="pipeline.stages=2${EXTRA_ARGS:+ $EXTRA_ARGS}"
mb_launch
