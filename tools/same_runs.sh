#!/bin/bash
# Whether a change altered what training does: the same fixed-seed runs with an earlier
# revision and with the working tree, their metrics.jsonl compared row by row (timings left
# out; tools/compare_metrics.py). The runs: 2 stages with evaluation, retention and a resume
# (30 + 10 updates), 4 stages in bf16 with ZeRO-1, 1 process with early stopping on.
#
#   bash tools/same_runs.sh REV [WORKDIR]     # e.g. bash tools/same_runs.sh HEAD~3
#
# About 6 minutes on 2 cores. Exit 0 when every run matches. Needs .venv (make venv).
set -euo pipefail
REV=${1:?usage: bash tools/same_runs.sh REV [WORKDIR]}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${2:-$(mktemp -d)}
export PATH="$ROOT/.venv/bin:$PATH"

runs() {  # runs CHECKOUT OUT
    local tree=$1 out=$2 t=megatron_branchnorm/train.py
    local common="--config tiny_cpu train.log_interval=1"
    rm -rf "$out" && mkdir -p "$out"
    (
        cd "$tree"
        local two="$common pipeline.stages=2 train.eval_interval=10 train.save_interval=10"
        two="$two train.keep_last=2 train.keep_best=1 train.save_dir=$out/two"
        deepspeed --num_gpus 2 $t $two train.max_steps=30 >"$out/two.log" 2>&1
        deepspeed --num_gpus 2 $t $two train.max_steps=40 >>"$out/two.log" 2>&1
        deepspeed --num_gpus 4 $t $common pipeline.stages=4 train.max_steps=12 \
            train.eval_interval=6 train.save_interval=6 \
            train.deepspeed_config=ds_configs/zero1_bf16.json train.save_dir="$out/four" \
            >"$out/four.log" 2>&1
        python $t $common train.max_steps=20 train.log_interval=2 train.eval_interval=10 \
            train.save_interval=0 train.patience=1 train.save_dir="$out/one" >"$out/one.log" 2>&1
    ) || { echo "error: a run of $tree failed: logs in $out" >&2; exit 2; }
}

git -C "$ROOT" worktree add --detach "$WORK/before" "$REV" >/dev/null
trap 'git -C "$ROOT" worktree remove --force "$WORK/before"' EXIT
echo "runs of $REV in $WORK/before, of the working tree in $ROOT; outputs in $WORK"
runs "$WORK/before" "$WORK/out_before"
runs "$ROOT" "$WORK/out_after"
status=0
for run in two four one; do
    python "$ROOT/tools/compare_metrics.py" "$WORK/out_before/$run" "$WORK/out_after/$run" || status=1
done
exit $status
