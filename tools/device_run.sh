#!/usr/bin/env bash
# The GPU measurements of a lent device in ONE call of at most 9 minutes (the machine goes back
# 30 s after a call, and one command may run 10 minutes): the install, then the sections in the
# order of what matters most, each under its own time limit, the summary ($OUT/summary.md)
# appended as each ends, so that whatever cuts the call short keeps what finished.
#
#     TARGET_PYTHON=3.12 bash tools/build_wheelhouse.sh wheelhouse   # here, once
#     bash tools/device_run.sh plan        # the sections and their budgets: fits 9 minutes?
#     bash tools/device_run.sh             # there (the device tool's carry: wheelhouse, and
#                                          # apex-src for the last section): every section
#     bash tools/device_run.sh install     # the install and its import check only
#     bash tools/device_run.sh graphs_check,bench_train   # some sections, in the plan's order
#
# The install follows the device's layout (../shared's design notes, docs: GPU check): its
# python3 is a virtual environment's interpreter holding torch, numpy and much else; a second
# venv made from it would see the base interpreter's packages, not torch. So the wheels of the
# wheelhouse that the interpreter lacks (by distribution name; the image's torch, numpy and
# every package it has are never replaced) go with `pip install --no-index --no-deps --target
# SITE`, SITE and the checkout go on PYTHONPATH, SITE/bin on PATH, and `import torch,
# deepspeed, megatron_branchnorm` is checked before anything else: one line and exit 1 if not.
#
# Settings (environment): OUT (default device-out: summary.md, logs.tgz and one JSON per
# section, at most 8 files), WORK (device-work: the tools' workdirs), WHEELHOUSE (wheelhouse),
# SITE (device-site), PYTHON (python3: the device's), DEVICE (auto; cpu rehearses the sections
# in the tools' small modes), TOTAL_S (540: no section starts or runs past it), APEX_SRC
# (apex-src: tools/apex_snapshot.sh's folder; the apex section runs when it is there), IMPORTS
# (more modules the install's import check imports, comma-separated).
set -uo pipefail
cd "$(dirname "$0")/.."

# name:budget_s, in the order they run: correctness of the graphs first, then train.py eager
# against graphs at 4,096 and 16,384 tokens per side (the goals), the anchors, the precision
# checks, the compiled nn.Transformer, and Apex's fused LayerNorm built from source. Launch
# counts are exact on the CPU (make test counts them): not here.
PLAN="install:40 graphs_check:100 bench_train:150 anchors:40 precision:50 compile:60 apex:100"
TOTAL_S=${TOTAL_S:-540}

what=${1:-all}
out=${OUT:-device-out}
wh=${WHEELHOUSE:-wheelhouse}
site=${SITE:-device-site}
py=${PYTHON:-python3}
device=${DEVICE:-auto}
work=${WORK:-device-work}  # the tools' workdirs (save_dirs too: large), outside $OUT
apex_src=${APEX_SRC:-apex-src}
case "$site" in /*) ;; *) site=$PWD/$site ;; esac

names=()
for entry in $PLAN; do names+=("${entry%%:*}"); done
budget_of() { for entry in $PLAN; do [ "${entry%%:*}" = "$1" ] && echo "${entry##*:}"; done; }

if [ "$what" = plan ]; then
    total=0
    echo "one call, in this order (seconds: budget, then the call's time when it ends):"
    for entry in $PLAN; do
        total=$((total + ${entry##*:}))
        printf '  %-13s %4d s   by %4d s\n' "${entry%%:*}" "${entry##*:}" "$total"
    done
    if [ "$total" -le "$TOTAL_S" ]; then
        echo "total: $total s of $TOTAL_S s: fits"
        exit 0
    fi
    echo "total: $total s of $TOTAL_S s: does not fit"
    exit 1
fi

chosen=()
if [ "$what" = all ]; then
    chosen=("${names[@]}")
else
    IFS=, read -r -a asked <<< "$what"
    for a in "${asked[@]}"; do
        [ -n "$(budget_of "$a")" ] || {
            echo "error: unknown section $a; of: plan all ${names[*]}" >&2
            exit 2
        }
    done
    for n in "${names[@]}"; do  # the plan's order, whatever the order asked
        for a in "${asked[@]}"; do [ "$a" = "$n" ] && chosen+=("$n"); done
    done
fi

mkdir -p "$out" "$work/logs"
summary=$out/summary.md
failed=0
start=$SECONDS

note() { echo "$*" | tee -a "$summary"; }

pack_logs() {  # our step logs and the tools' own logs (not their checkpoints): $OUT keeps 8 files
    find "$work" -name '*.log' -size -20M > "$work/.logs-list" 2>/dev/null
    tar -czf "$out/logs.tgz" -T "$work/.logs-list" 2>/dev/null
    rm -f "$work/.logs-list"
}

# step NAME COMMAND...: run it under `timeout` for its budget, cut to what is left of TOTAL_S
# (a section with under 15 s left is not started); log to $work/logs/NAME.log, then note its
# exit status, its time and the log's last lines (the tables the tools print end their logs).
step() {
    local name=$1
    shift
    local limit left t0=$SECONDS rc
    limit=$(budget_of "$name")
    left=$((TOTAL_S - (SECONDS - start)))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 15 ]; then
        note ""
        note "## $name: not run: ${left} s of the call's ${TOTAL_S} s left"
        return 0
    fi
    timeout -k 10 "$limit" "$@" > "$work/logs/$name.log" 2>&1
    rc=$?
    [ "$rc" -eq 0 ] || failed=1
    local why=""
    { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; } && why=" (over its ${limit} s limit)"
    note ""
    note "## $name: exit $rc$why, $((SECONDS - t0)) s"
    note '```'
    tail -n 60 "$work/logs/$name.log" | tee -a "$summary"
    note '```'
    pack_logs
    return "$rc"
}

note "# device run: ${chosen[*]}, $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"

# The install: the wheels $py lacks, into $site, on PYTHONPATH. A Python helper decides which
# (a wheel's distribution name against the interpreter's installed distributions).
install() {
    set -e
    "$py" -c 'import sys; print("python", sys.version.split()[0], "at", sys.executable, "(a venv)" if sys.prefix != sys.base_prefix else "(no venv)")'
    if [ -d "$wh" ]; then
        local lacking
        lacking=$("$py" - "$wh" <<'PYEOF'
import importlib.metadata as md
import pathlib
import sys

have, lack = [], []
wheelhouse = pathlib.Path(sys.argv[1])  # anchors/: torchscale and fairscale for the bench
for wheel in sorted([*wheelhouse.glob("*.whl"), *wheelhouse.glob("anchors/*.whl")]):
    name, version = wheel.name.split("-")[:2]
    try:
        have.append(f"{name} {md.version(name)} (the wheelhouse's {version} not installed)")
    except md.PackageNotFoundError:
        lack.append(str(wheel))
print("the interpreter's own:", "; ".join(have) or "none", file=sys.stderr)
print("\n".join(lack))
PYEOF
)
        if [ -n "$lacking" ]; then
            echo "installing into $site: $(echo "$lacking" | xargs -n1 basename | tr '\n' ' ')"
            # shellcheck disable=SC2086
            "$py" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
                --disable-pip-version-check --upgrade --target "$site" $lacking
        fi
    else
        echo "no wheelhouse at $wh: nothing installed"
    fi
    "$py" -c "import torch, deepspeed, megatron_branchnorm${IMPORTS:+, $IMPORTS}" || exit 1
    "$py" -c 'import torch, deepspeed; print("torch", torch.__version__, "cuda", torch.version.cuda, "deepspeed", deepspeed.__version__, "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")'
}
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$site/bin:$PATH"
export PYTHONUNBUFFERED=1
export py wh site
export -f install
step install bash -c install || {
    note "install failed: $(grep -E 'Error|error' "$work/logs/install.log" | tail -n 1)"
    note "nothing else ran"
    exit 1
}

small=$([ "$device" = cpu ] && echo 1 || echo 0)
for name in "${chosen[@]}"; do
    case "$name" in
    install) ;;
    graphs_check)  # the CUDA-graph correctness rows (graphed vs eager, recompute, links)
        step graphs_check "$py" tools/gpu_check.py --device "$device" --sections graphs \
            --workdir "$work/graphs_check" --json "$out/graphs_check.json" ;;
    bench_train)  # train.py eager vs graphs, 4,096 and 16,384 tokens, bucket shapes pinned
        step bench_train "$py" tools/gpu_bench.py --device "$device" \
            --systems train.py,train.py+graphs --max-minutes 60 \
            --workdir "$work/bench_train" --json "$out/bench_train.json" ;;
    anchors)  # torchscale and nn.Transformer (eager), and our flat model, at both sizes
        step anchors "$py" tools/gpu_bench.py --device "$device" \
            --systems torchscale,torch,ours --max-minutes 60 \
            --workdir "$work/anchors" --json "$out/anchors.json" ;;
    precision)  # bf16/fp16 against CPU fp32, checkpointing on = off, Apex if importable
        step precision "$py" tools/gpu_check.py --device "$device" --sections precision,apex \
            --workdir "$work/precision" --json "$out/precision.json" ;;
    compile)  # nn.Transformer under torch.compile at 4,096 tokens (minutes of compiling)
        tokens=$([ "$small" = 1 ] && echo 64 || echo 4096)
        step compile "$py" tools/gpu_bench.py --device "$device" --systems torch-compiled \
            --tokens "$tokens" --max-minutes 60 \
            --workdir "$work/compile" --json "$out/compile.json" ;;
    apex)  # Apex's fused LayerNorm built from a carried source snapshot (optional)
        if [ -d "$apex_src" ]; then
            step apex "$py" tools/apex_check.py --src "$apex_src" --build-dir "$work/apex" \
                --max-seconds 80 --json "$out/apex.json"
        else
            note ""
            note "## apex: not run: no $apex_src (tools/apex_snapshot.sh makes it; carry it)"
        fi ;;
    esac
done
note ""
note "done in $((SECONDS - start)) s: $([ "$failed" -eq 0 ] && echo 'every section exited 0' || echo 'a section failed (see above)')"
exit "$failed"
