#!/usr/bin/env bash
# The GPU steps of a lent device session in one prepared script (issue 41; docs/performance.md):
# install offline from a carried wheelhouse, then `make gpu-check` and `make gpu-bench`'s tools,
# each under its own time limit, appending a summary to $OUT/summary.md as each step ends (so a
# step killed by the session's limit still leaves the earlier ones) and the logs to
# $OUT/logs.tgz. Build the wheelhouse here first, for the device's Python:
#
#     TARGET_PYTHON=3.12 bash tools/build_wheelhouse.sh wheelhouse
#
# and run it there (the device tool's `carry` takes wheelhouse/; one command may run 10 min):
#
#     bash tools/device_run.sh check    # install + the GPU check        (~1 + 4 min)
#     bash tools/device_run.sh bench    # install + gpu-bench            (~1 + 7 min)
#     bash tools/device_run.sh all      # both, when one call has time for them
#     bash tools/device_run.sh graphs   # install + graphs on a deep recomputing stage (~1 + 4 min)
#
# Settings (environment): OUT (default ./device-out; it receives summary.md, logs.tgz and the
# tools' JSON rows: four files), WORK (default ./device-work: the tools' workdirs), WHEELHOUSE (default wheelhouse),
# PYTHON (default python3: the device's, with its torch), VENV (default .device-venv: made with
# --system-site-packages so that it sees that torch, and the wheels go there, not into a
# system Python that refuses them; `none` installs into PYTHON itself, as the CPU rehearsal
# does with .venv/bin/python), DEVICE (auto; `cpu` rehearses the script on the CPU with the
# tools' small modes), CHECK_S / BENCH_S / GRAPHS_S / INSTALL_S (each step's limit in seconds).
# `graphs` times train.py eager against train.py+graphs with a deeper stack that recomputes
# (GRAPHS_LAYERS per side, 24 by default, pipeline.activation_checkpoint_interval=1): the kind
# of stage the first stages of opus100_1000L are (docs/design.md §19, "Recompute"), its graphs
# cut into links of GRAPHS_LINKS layers (8 by default; 0: whole ranges), as a deep recomputing
# stage's are (docs/design.md §19, "Links").
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
case "$what" in check|bench|all|graphs) ;; *) echo "usage: $0 check|bench|all|graphs" >&2; exit 2 ;; esac
out=${OUT:-device-out}
wh=${WHEELHOUSE:-wheelhouse}
py=${PYTHON:-python3}
venv=${VENV:-.device-venv}
device=${DEVICE:-auto}
work=${WORK:-device-work}  # the tools' workdirs (save_dirs too: large), outside $OUT
mkdir -p "$out/logs" "$work"
summary=$out/summary.md
failed=0

note() { echo "$*" | tee -a "$summary"; }

# step NAME LIMIT_S COMMAND...: run it under `timeout`, log to $out/logs/NAME.log, then note its
# exit status, its time and the log's last lines (the tables the tools print end their logs).
step() {
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS rc
    timeout -k 15 "$limit" "$@" > "$out/logs/$name.log" 2>&1
    rc=$?
    [ "$rc" -eq 0 ] || failed=1
    local why=""
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && why=" (over its ${limit} s limit)"
    note ""
    note "## $name: exit $rc$why, $((SECONDS - t0)) s"
    note '```'
    tail -n 60 "$out/logs/$name.log" | tee -a "$summary"
    note '```'
    # our step logs and the tools' own logs (not their checkpoints): $OUT keeps a few files
    find "$work" -name '*.log' -size -20M > "$out/.tool-logs" 2>/dev/null
    tar -czf "$out/logs.tgz" -C "$out" logs -C "$PWD" -T "$out/.tool-logs" 2>/dev/null
    rm -f "$out/.tool-logs"
    return "$rc"
}

note "# device run: $what, $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
note "$("$py" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")' 2>&1 | tail -n 1)"

# The offline install, as one command `timeout` can run.
if [ "$venv" != none ]; then
    "$py" -m venv --system-site-packages "$venv" || { note "cannot make $venv"; exit 1; }
    py=$venv/bin/python
fi
install='
set -e
if [ -d "$WH" ]; then
    "$PY" -m pip install --quiet --no-index --find-links "$WH" "$WH"/*.whl
    if [ "$WHAT" != check ] && [ -d "$WH/anchors" ]; then  # torchscale for a gpu-bench row
        "$PY" -m pip install --quiet --no-deps "$WH"/anchors/*.whl
    fi
fi
"$PY" -m pip install --quiet --no-deps --no-build-isolation -e .
"$PY" -c "import deepspeed, megatron_branchnorm; print(\"deepspeed\", deepspeed.__version__)"
'
export WH="$wh" PY="$py" WHAT="$what"
step install "${INSTALL_S:-150}" bash -c "$install" || { note "install failed: nothing else ran"; exit 1; }

if [ "$what" = check ] || [ "$what" = all ]; then
    step gpu_check "${CHECK_S:-360}" "$py" tools/gpu_check.py --device "$device" \
        --workdir "$work/gpu_check" --json "$out/gpu_check.json"
fi
if [ "$what" = graphs ]; then
    layers=${GRAPHS_LAYERS:-24}
    step gpu_bench_graphs "${GRAPHS_S:-240}" "$py" tools/gpu_bench.py --device "$device" \
        --systems train.py,train.py+graphs --tokens 4096 --max-minutes 3 --layers "$layers" \
        --override pipeline.activation_checkpoint_interval=1 \
        --override "model.cuda_graph_link_layers=${GRAPHS_LINKS:-8}" \
        --workdir "$work/gpu_bench_graphs" --json "$out/gpu_bench_graphs.json"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    minutes=$(( ${BENCH_S:-420} / 60 - 2 ))  # start no system after this: each takes ~1 min
    step gpu_bench "${BENCH_S:-420}" "$py" tools/gpu_bench.py --device "$device" \
        --max-minutes "$minutes" --workdir "$work/gpu_bench" --json "$out/gpu_bench.json"
fi
note ""
note "done: $([ "$failed" -eq 0 ] && echo 'every step exited 0' || echo 'a step failed (see above)')"
exit "$failed"
