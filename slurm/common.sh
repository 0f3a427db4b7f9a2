# shellcheck shell=bash
# Shared body of the sbatch launchers in slurm/ (sourced by them, never run on its own).
#
# One process per rank through `srun` (docs/design.md §12: the `deepspeed` launcher swallows
# SIGUSR1 and the requeue exit code). Each rank's RANK/WORLD_SIZE/LOCAL_RANK come from
# SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID (megatron_branchnorm.training.environment.setup_process_env);
# MASTER_ADDR is the job's first node, MASTER_PORT derives from the job id. On SIGUSR1 (sent
# by `#SBATCH --signal=USR1@LEAD` or `scancel --signal=USR1 JOBID`) every rank checkpoints and
# exits 75; the job then requeues itself and the next run resumes from SAVE_DIR/latest.
#
# Environment overrides (read when the job starts; sbatch exports the submitting shell's):
#   CONFIG         shipped config name or YAML path            (launcher default)
#   DATA           data.dataset (a preprocessed DATA_DIR or "synthetic")
#   SAVE_DIR       train.save_dir (checkpoints, metrics.jsonl)
#   DS_CONFIG      train.deepspeed_config (ds_configs/*.json)
#   EXTRA_ARGS     more section.key=value overrides, space-separated
#   GPUS_PER_NODE  ranks per node (default: the allocation's tasks per node)
#   VENV           a virtualenv to activate; otherwise `python` from PATH
#   PYTHON         interpreter name or path (default: python)
#   MASTER_PORT    rendezvous port (default: 20000 + job id mod 12000: below Linux's ephemeral
#                  range, 32768-60999, so no outgoing connection holds it)
#   GPU_MEMORY     per-GPU memory for the start-up plan printed by tools/plan_memory.py
#   NO_REQUEUE=1   exit 75 instead of requeueing (for debugging)
#   MB_SIGNAL_LEAD the --signal lead in seconds, when --signal is given on the sbatch command
#                  line (the job cannot see it; see mb_signal_lead)
#
# Every number read from the environment (these and SLURM's own: SLURM_JOB_ID,
# SLURM_JOB_NUM_NODES, SLURM_NNODES, SLURM_NTASKS_PER_NODE, SLURM_CPUS_PER_TASK,
# SLURM_RESTART_COUNT, SBATCH_SIGNAL's lead) is checked by mb_int before any use: bash evaluates
# a variable's value inside $(( )), (( )) and [[ -lt ]] as an expression, so a value such as
# x[$(cmd)] would run cmd.

MB_REQUEUE_EXIT_CODE=75 # megatron_branchnorm.training.exit_codes.REQUEUE_EXIT_CODE

mb_log() {
    printf '[%s] %s\n' "$(date '+%F %T')" "$*"
}

mb_die() {
    mb_log "error: $*" >&2
    exit 2
}

# mb_int NAME MIN MAX [WHAT]: refuse (one line naming WHAT, default NAME=value; exit 2) unless
# $NAME is a plain decimal integer from MIN to MAX, and rewrite it in base 10 ("08" -> 8). Only
# then may NAME reach arithmetic: bash evaluates the value of a variable used there as an
# expression, and x[$(cmd)] in it runs cmd.
mb_int() {
    local _mb_name=$1 _mb_min=$2 _mb_max=$3 _mb_value _mb_what
    _mb_value=${!_mb_name-}
    # the regex first: only digits may reach the comparison
    if [[ ! $_mb_value =~ ^[0-9]{1,10}$ ]] ||
        ((10#$_mb_value < _mb_min || 10#$_mb_value > _mb_max)); then
        _mb_what="${4:-$_mb_name=$_mb_value}: expected a whole number from $_mb_min to $_mb_max"
        mb_die "${_mb_what//[^[:print:]]/?}"
    fi
    printf -v "$_mb_name" '%d' "$((10#$_mb_value))"
}

# mb_int for each of these variables that is set and not empty.
mb_int_if_set() {
    local min=$1 max=$2 name
    shift 2
    for name in "$@"; do
        [[ -z ${!name:-} ]] || mb_int "$name" "$min" "$max"
    done
}

# Activate $VENV when set; then check that the interpreter imports the package.
mb_setup_python() {
    if [[ -n ${VENV:-} ]]; then
        [[ -f "$VENV/bin/activate" ]] || mb_die "VENV=$VENV has no bin/activate"
        # shellcheck source=/dev/null
        source "$VENV/bin/activate"
    fi
    PYTHON=${PYTHON:-python}
    command -v "$PYTHON" >/dev/null || mb_die "no '$PYTHON' on PATH (set VENV or PYTHON)"
    PYTHONPATH="$MB_ROOT${PYTHONPATH:+:$PYTHONPATH}"
    export PYTHONPATH
}

# MASTER_ADDR/MASTER_PORT, rank count and threads from SLURM's variables.
mb_setup_rendezvous() {
    [[ -n ${SLURM_JOB_ID:-} ]] || mb_die "not inside a SLURM job: submit with sbatch"
    mb_int SLURM_JOB_ID 1 4294967295
    mb_int_if_set 1 65535 MASTER_PORT
    mb_int_if_set 1 100000 SLURM_JOB_NUM_NODES SLURM_NNODES SLURM_CPUS_PER_TASK
    mb_int_if_set 1 1024 GPUS_PER_NODE
    local per_node=${SLURM_NTASKS_PER_NODE:-}
    per_node=${per_node%%(*} # "8(x4)" -> "8"
    if [[ -n $per_node ]]; then
        mb_int per_node 1 1024 "SLURM_NTASKS_PER_NODE=$SLURM_NTASKS_PER_NODE"
    fi
    MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 12000))}
    export MASTER_ADDR MASTER_PORT
    NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
    GPUS_PER_NODE=${GPUS_PER_NODE:-${per_node:-1}}
    WORLD_SIZE_PLANNED=$((NNODES * GPUS_PER_NODE))
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
    unset RANK WORLD_SIZE LOCAL_RANK # each srun task derives its own from SLURM_PROCID
}

# "[D-]HH:MM:SS", "HH:MM", "MM" (SLURM's time formats) -> seconds; "" for UNLIMITED and the like.
mb_seconds() {
    local t=$1 days=0 h=0 m=0 s=0
    [[ $t =~ ^([0-9]+-)?[0-9]+(:[0-9]+){0,2}$ ]] || return 0
    if [[ $t == *-* ]]; then
        days=${t%%-*}
        t=${t#*-}
        IFS=: read -r h m s <<<"$t" # D-HH[:MM[:SS]]
    else
        local parts
        IFS=: read -r -a parts <<<"$t"
        case ${#parts[@]} in
        1) m=${parts[0]} ;;
        2) m=${parts[0]} s=${parts[1]} ;;
        *) h=${parts[0]} m=${parts[1]} s=${parts[2]} ;;
        esac
    fi
    echo $(((10#$days * 24 + 10#${h:-0}) * 3600 + 10#${m:-0} * 60 + 10#${s:-0}))
}

# The SIGUSR1 lead: sets MB_LEAD (seconds, "" when the job asks for no signal) and
# MB_LEAD_FROM (where it was read). SLURM shows a job's --signal to no client
# (slurm_job_info_t has no such field, up to 26.x: not `scontrol show job`, not squeue), so
# this reads what sbatch read: MB_SIGNAL_LEAD (seconds; set it when --signal is given on the
# sbatch command line), else SBATCH_SIGNAL (sbatch's own variable, exported into the job),
# else the `#SBATCH --signal` line of the job script ($0 is sbatch's copy of it).
mb_signal_lead() {
    local spec=""
    MB_LEAD="" MB_LEAD_FROM=""
    if [[ -n ${MB_SIGNAL_LEAD:-} ]]; then
        mb_int MB_SIGNAL_LEAD 0 65535 # SLURM's range for --signal's lead
        MB_LEAD=$MB_SIGNAL_LEAD MB_LEAD_FROM="MB_SIGNAL_LEAD=$MB_SIGNAL_LEAD"
        return 0
    elif [[ -n ${SBATCH_SIGNAL:-} ]]; then
        spec=$SBATCH_SIGNAL MB_LEAD_FROM="SBATCH_SIGNAL=$SBATCH_SIGNAL"
    elif [[ -r $0 ]]; then
        spec=$(sed -n -E 's/^#SBATCH[[:space:]]+--signal[=[:space:]]+([^[:space:]]+).*/\1/p' "$0" |
            tail -n 1)
        MB_LEAD_FROM="#SBATCH --signal=$spec"
    fi
    [[ -n $spec ]] || return 0
    if [[ $spec == *@* ]]; then MB_LEAD=${spec##*@}; else MB_LEAD=60; fi # SLURM's default: 60
    mb_int MB_LEAD 0 65535 "${MB_LEAD_FROM}: its signal lead"
}

# Refuse a time limit at or below the signal lead: SLURM would send SIGUSR1 as soon as the
# job starts, while the ranks are still importing, and kill them all (exit 138, no requeue).
mb_check_time_limit() {
    local limit_text limit
    limit_text=$(scontrol show job "$SLURM_JOB_ID" |
        sed -n -E 's/.*[[:space:]]TimeLimit=([^[:space:]]+).*/\1/p')
    limit=$(mb_seconds "$limit_text")
    mb_signal_lead
    [[ -n $limit && -n $MB_LEAD ]] || return 0
    if ((limit <= MB_LEAD)); then
        mb_die "time limit ${limit_text} (${limit} s) is at or below the SIGUSR1 lead of" \
            "${MB_LEAD} s (${MB_LEAD_FROM}): the signal would reach the ranks while they start;" \
            "ask for a longer --time or a shorter lead (SBATCH_SIGNAL=USR1@SECONDS sbatch ...)"
    fi
}

# Collect the trainer's key=value overrides into the array MB_OVERRIDES. (It is expanded as
# ${MB_OVERRIDES[@]+"${MB_OVERRIDES[@]}"}: bash < 4.4 treats an empty array as unset under -u.)
mb_collect_overrides() {
    MB_OVERRIDES=()
    [[ -n ${DATA:-} ]] && MB_OVERRIDES+=("data.dataset=$DATA")
    [[ -n ${SAVE_DIR:-} ]] && MB_OVERRIDES+=("train.save_dir=$SAVE_DIR")
    [[ -n ${DS_CONFIG:-} ]] && MB_OVERRIDES+=("train.deepspeed_config=$DS_CONFIG")
    if [[ -n ${EXTRA_ARGS:-} ]]; then
        local extra
        read -r -a extra <<<"$EXTRA_ARGS"
        MB_OVERRIDES+=("${extra[@]}")
    fi
    return 0
}

# Run the trainer on every rank; requeue the job when it exits with the requeue code.
mb_launch() {
    [[ -n ${MB_ROOT:-} ]] || mb_die "MB_ROOT is not set (the launcher sets it)"
    : "${CONFIG:?CONFIG is not set}"
    mb_setup_python
    mb_setup_rendezvous
    mb_check_time_limit
    mb_collect_overrides
    mb_int_if_set 0 1000000000 SLURM_RESTART_COUNT
    mb_log "job ${SLURM_JOB_ID} (restart ${SLURM_RESTART_COUNT:-0}) on ${SLURM_JOB_NODELIST}:" \
        "${NNODES} node(s) x ${GPUS_PER_NODE} rank(s); master ${MASTER_ADDR}:${MASTER_PORT}"
    mb_log "python: $(command -v "$PYTHON"); config: ${CONFIG} ${MB_OVERRIDES[*]:-}"

    # Fail in seconds on a bad config or a stage count that does not divide the world size,
    # and print the memory plan; not fitting is a warning only (the estimate is conservative).
    local plan_status=0
    "$PYTHON" "$MB_ROOT/tools/plan_memory.py" --config "$CONFIG" --gpus "$WORLD_SIZE_PLANNED" \
        --gpu-memory "${GPU_MEMORY:-80GB}" ${MB_OVERRIDES[@]+"${MB_OVERRIDES[@]}"} || plan_status=$?
    if ((plan_status == 2)); then
        mb_die "the configuration is invalid (see above)"
    elif ((plan_status != 0)); then
        mb_log "warning: tools/plan_memory.py estimates it does not fit in ${GPU_MEMORY:-80GB}"
    fi

    # srun in the background so that a signal sent to this batch shell (`--signal=B:USR1`,
    # `scancel --batch`) is forwarded to the ranks instead of killing the shell.
    srun --nodes="$NNODES" --ntasks-per-node="$GPUS_PER_NODE" \
        --ntasks="$WORLD_SIZE_PLANNED" --kill-on-bad-exit=0 \
        "$PYTHON" -u "$MB_ROOT/megatron_branchnorm/train.py" --config "$CONFIG" \
        ${MB_OVERRIDES[@]+"${MB_OVERRIDES[@]}"} &
    local srun_pid=$!
    # shellcheck disable=SC2064  # expand srun_pid now
    trap "kill -USR1 $srun_pid 2>/dev/null || true" USR1
    # shellcheck disable=SC2064
    trap "kill -TERM $srun_pid 2>/dev/null || true" TERM
    local status=0
    while true; do
        status=0
        wait "$srun_pid" || status=$?
        # wait returns > 128 when a trapped signal interrupts it: keep waiting for srun
        if ((status > 128)) && kill -0 "$srun_pid" 2>/dev/null; then
            continue
        fi
        break
    done
    trap - USR1 TERM

    if ((status == MB_REQUEUE_EXIT_CODE)); then
        if [[ ${NO_REQUEUE:-0} == 1 ]]; then
            mb_log "trainer checkpointed and exited ${status}; NO_REQUEUE=1: not requeueing"
            exit "$status"
        fi
        mb_log "trainer checkpointed and exited ${status}: requeueing job ${SLURM_JOB_ID}"
        scontrol requeue "$SLURM_JOB_ID"
        exit 0
    fi
    mb_log "trainer exited ${status}"
    exit "$status"
}
