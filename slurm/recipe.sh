#!/bin/bash
# The paper's bilingual recipes (docs/recipes.md) on 32 GPUs, as the paper ran them: 4 nodes x 8
# GPUs; each config sets its own stages x data-parallel (32 / stages) and micro-batches so that an
# update is 128 x 4096 tokens. CONFIG names the recipe:
#
#   CONFIG=wmt17_en_de_6L DATA=data/wmt17_en_de sbatch slurm/recipe.sh   # from the repository root
#   CONFIG=wmt14_en_fr_500L EXTRA_ARGS="model.residual=deepnorm" sbatch slurm/recipe.sh
#   CONFIG=iwslt14_de_en_18L SAVE_DIR=/scratch/runs/iwslt18 sbatch slurm/recipe.sh
#
# Recipes: wmt17_en_de_{6,18,50,100,250}L, wmt14_en_fr_{6,18,50,100,250,500}L,
# iwslt14_de_en_{6,18}L. A sweep over schemes and depths submits this once per cell:
#   python tools/sweep.py submit --task wmt17_en_de --schemes postln,branchnorm --depths 6,18 ...
# Signal lead 600 s: the largest recipe (500L-500L) writes a ~52 GB checkpoint (docs/slurm.md).
# Environment overrides (CONFIG, DATA, SAVE_DIR, DS_CONFIG, EXTRA_ARGS, GPUS_PER_NODE, VENV):
# slurm/common.sh. Logs: %x-%j.out in the submission directory (appended across requeues).
#SBATCH --job-name=recipe
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

if [[ -z ${CONFIG:-} ]]; then
    mb_die "set CONFIG to a recipe, e.g. CONFIG=wmt17_en_de_6L (docs/recipes.md)"
fi
GPU_MEMORY=${GPU_MEMORY:-40GB}
mb_launch
