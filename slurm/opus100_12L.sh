#!/bin/bash
# OPUS-100, 12 layers (6 encoder + 6 decoder), BranchNorm: 1 node x 8 GPUs, data-parallel
# (pipeline.stages=1 in the config).
#
#   sbatch slurm/opus100_12L.sh                           # from the repository root
#   DATA=/data/opus100 SAVE_DIR=/scratch/runs/12L sbatch slurm/opus100_12L.sh
#   EXTRA_ARGS="model.residual=deepnorm" sbatch slurm/opus100_12L.sh
#
# Signal lead 180 s: a 12L checkpoint is ~1 GB (tools/plan_memory.py; docs/slurm.md).
# Environment overrides (CONFIG, DATA, SAVE_DIR, DS_CONFIG, EXTRA_ARGS, GPUS_PER_NODE, VENV):
# slurm/common.sh. Logs: %x-%j.out in the submission directory (appended across requeues).
#SBATCH --job-name=opus100_12L
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gres=gpu:8
#SBATCH --cpus-per-task=8
#SBATCH --mem=0
#SBATCH --time=24:00:00
#SBATCH --signal=USR1@180
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

CONFIG=${CONFIG:-opus100_12L}
mb_launch
