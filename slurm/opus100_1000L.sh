#!/bin/bash
# OPUS-100, 1000 layers (500 encoder + 500 decoder), BranchNorm: the paper's run on 32 GPUs,
# 4 nodes x 8 = 16 pipeline stages x 2 data-parallel (pipeline.stages=16 in the config).
#
#   sbatch slurm/opus100_1000L.sh                         # from the repository root
#   DATA=/data/opus100 SAVE_DIR=/scratch/runs/1000L sbatch slurm/opus100_1000L.sh
#   EXTRA_ARGS="model.residual=deepnorm" sbatch slurm/opus100_1000L.sh
#   EXTRA_ARGS="pipeline.stages=8" sbatch --nodes=1 slurm/opus100_1000L.sh  # 8 x 1, 128 each
#
# Any GPU count keeps the config's 128 x 4096 tokens per update (pipeline.data_parallel: 2).
#
# Plan it first: python tools/plan_memory.py --config opus100_1000L --gpus 32 --gpu-memory 40GB
# Signal lead 600 s: a 1000L checkpoint is ~52 GB, written by 32 ranks and hashed by rank 0
# (docs/slurm.md). Runs past --time continue by requeue from SAVE_DIR/latest.
# Environment overrides (CONFIG, DATA, SAVE_DIR, DS_CONFIG, EXTRA_ARGS, GPUS_PER_NODE, VENV):
# slurm/common.sh. Logs: %x-%j.out in the submission directory (appended across requeues).
#SBATCH --job-name=opus100_1000L
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=8
#SBATCH --gres=gpu:8
#SBATCH --cpus-per-task=8
#SBATCH --mem=0
#SBATCH --time=24:00:00
#SBATCH --signal=USR1@600
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

CONFIG=${CONFIG:-opus100_1000L}
mb_launch
