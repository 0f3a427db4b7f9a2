#!/bin/bash
# Validation BLEU beside a training job: a companion job that scores each new checkpoint of
# SAVE_DIR once on the dev split (tools/watch_bleu.py; docs/design.md §8) and ends when the
# run has its last checkpoint scored. Submit it with the training job, same SAVE_DIR:
#
#   export SAVE_DIR=/scratch/runs/200L
#   sbatch slurm/opus100_200L.sh
#   sbatch slurm/watch_bleu.sh                                     # CPU: 1 task, 16 cores
#   DEVICE=cuda sbatch --gres=gpu:1 slurm/watch_bleu.sh            # faster for deep models
#   WATCH_ARGS="--max-sentences 100 --bleu tokenized --compound-split" sbatch slurm/watch_bleu.sh
#
# With train.best_metric=valid_bleu, retention keeps the best checkpoints by its scores (and
# every checkpoint it has not scored yet). Killed or requeued, it scores only what is missing.
# Environment: SAVE_DIR (required), WATCH_ARGS (more flags of tools/watch_bleu.py), DEVICE
# (cpu or cuda), VENV, PYTHON (slurm/common.sh).
#SBATCH --job-name=watch_bleu
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=16
#SBATCH --time=7-00:00:00
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

[[ -n ${SAVE_DIR:-} ]] || mb_die "SAVE_DIR is not set: the training run's save_dir"
mb_int_if_set 1 100000 SLURM_CPUS_PER_TASK
mb_setup_python
read -r -a MB_WATCH_ARGS <<<"${WATCH_ARGS:-}"
mb_log "scoring the checkpoints of $SAVE_DIR as they appear (${WATCH_ARGS:-default flags})"
exec "$PYTHON" -u "$MB_ROOT/tools/watch_bleu.py" --checkpoint "$SAVE_DIR" --follow \
    --device "${DEVICE:-cpu}" --threads "${SLURM_CPUS_PER_TASK:-0}" "${MB_WATCH_ARGS[@]}"
