#!/usr/bin/env bash
# Formal headless replay: one long OPD run from the fixed student under a wall-clock budget
# (docs/design.md, "run.sh"). A thin driver: `opdkit train` does the work; this maps the environment
# to params overrides, runs it, and reports an honest exit status.
#
#   [STUDENT_MODEL=dir] [TEACHER_MODEL=dir] [TRAIN_DATA=file.parquet|.jsonl]
#   [MAX_WALL_TIME_SECONDS=s] [DEADLINE_RESERVE_SECONDS=s] [OUTPUT_DIR=dir] [EXPERIMENT_NAME=name]
#   [CKPT_DIR=dir] [RECIPE=file.yaml|none] [OPSD_*=...] [NPROC=1] [PARAMS=none|file.yaml] [PYTHON=python]
#   bash run.sh [key=value ...]
#
# The recipe: RECIPE if set (none: no recipe); else, given STUDENT_MODEL, S1's formal replay
# (recipes/s1_cosine.yaml: the submitted wall-clock cosine candidate of seed 000); else none, and
# the run trains the shipped embedded default. Params: opdkit's built-in defaults < the recipe <
# the environment < the trailing key=value arguments. CKPT_DIR holds the trainer state (resume;
# default OUTPUT_DIR/state) under a lock of its own. The OPSD log's switches (OPSD_PAD_SIDE,
# OPSD_STUDENT_PROMPT, OPSD_TEACHER_CONTEXT, OPSD_CLIP_MODE, OPSD_DATA_SELECT, OPSD_WAVG_LAST; unset
# = the released behaviour) map to params keys (opdkit/recipes.py OPSD_SWITCHES); an unknown OPSD_*
# variable or value is bad input. Running it again on the same OUTPUT_DIR resumes.
#
# OUTPUT_DIR unset: /out when it exists and is writable (the contract's layout: checkpoints in
# /out/checkpoints/checkpoint-<step>/), else ./out, with a line saying why; set OUTPUT_DIR to choose
# (OPDKIT_CONTRACT_OUT names another directory than /out: for tests and other layouts).
#
# Locks: the trainer holds the GPU workload lock shared (opdkit/persist/fsutil.py DeviceLock; `opdkit eval`
# takes it exclusively) and exclusive locks on OUTPUT_DIR and CKPT_DIR; it releases them when it has
# exited, before this script returns (so an evaluation started after it finds the GPU free).
#
# Exit status: 0 only when training reached its intended end (step horizon or wall clock) and
# the final checkpoint validates (`opdkit validate`); 2 bad input (one line; OUTPUT_DIR left as it
# was); 3 values went non-finite (nothing non-finite saved or published; the last good state and
# checkpoints stay); 75 another run holds OUTPUT_DIR or CKPT_DIR, or an evaluation holds the GPU;
# 128+N stopped by signal N (SIGTERM/SIGINT: after the step in flight, with its state and
# checkpoint); otherwise the trainer's own status (1: a crash, a disk that fills or turns read-only
# during the run, out of memory), after a line that lists the checkpoints that survive and are valid.
# An OUTPUT_DIR or CKPT_DIR that cannot be written at all is bad input (2), refused before anything loads.
set -euo pipefail
# the wall budget counts from here (start-up included): the trainer reads it (opdkit/deadline.py started_at)
export OPDKIT_LAUNCHED_AT="${OPDKIT_LAUNCHED_AT:-$(date +%s.%N)}"

say() { printf 'run.sh: %s\n' "$*"; }
fail() { printf 'run.sh: %s\n' "$*" >&2; }

if [[ -z "${OUTPUT_DIR:-}" ]]; then  # the contract puts the checkpoints under /out/checkpoints/
    contract_out="${OPDKIT_CONTRACT_OUT:-/out}"
    if [[ -d "$contract_out" && -w "$contract_out" ]]; then
        OUTPUT_DIR="$contract_out"
        say "OUTPUT_DIR unset: writing to $contract_out (the contract's layout: checkpoints in $contract_out/checkpoints/)"
    else
        if [[ -d "$contract_out" ]]; then why="is not writable"; else why="does not exist"; fi
        OUTPUT_DIR="out"
        say "OUTPUT_DIR unset and $contract_out $why: writing to ./out (set OUTPUT_DIR to choose)"
    fi
fi
NPROC="${NPROC:-1}"
PYTHON="${PYTHON:-python}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# The replay runs opdkit's built-in defaults (a 180 s wall-clock budget) under its recipe, not the
# pipeline's params.yaml (whose 120-step horizon would end a wall-clock run early); PARAMS=file opts in.
PARAMS="${PARAMS:-none}"
if [[ -n "${RECIPE:-}" ]]; then
    recipe="$RECIPE"
elif [[ -n "${STUDENT_MODEL:-}" ]]; then
    recipe="$HERE/recipes/s1_cosine.yaml"  # S1's formal replay
else
    recipe=none  # the embedded default
fi
# OpenMP threads that spin while waiting make every step several times slower as soon as another
# process wants the CPU; passive waiting costs little on an idle machine (see bench/cpu_busy.py).
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"

if ! [[ "$NPROC" =~ ^[1-9][0-9]*$ ]]; then
    fail "error: NPROC must be a positive integer, got '$NPROC'"
    exit 2
fi

yaml_str() { printf "'%s'" "${1//\'/\'\'}"; }  # a YAML single-quoted string, whatever it holds

args=(train --out "$OUTPUT_DIR")
if [[ -n "$PARAMS" ]]; then args+=(-p "$PARAMS"); fi
if [[ "$recipe" == none ]]; then args+=(-r ""); else args+=(-r "$recipe"); fi
# env -> params overrides (first), then the trailing key=value arguments (they win)
if [[ -n "${STUDENT_MODEL:-}" ]]; then args+=(-S "student.path=$STUDENT_MODEL"); fi
if [[ -n "${TEACHER_MODEL:-}" ]]; then args+=(-S "teacher.path=$TEACHER_MODEL"); fi
if [[ -n "${TRAIN_DATA:-}" ]]; then args+=(-S "data.train=$TRAIN_DATA"); fi
if [[ -n "${MAX_WALL_TIME_SECONDS:-}" ]]; then args+=(-S "budget.max_wall_time_s=$MAX_WALL_TIME_SECONDS"); fi
if [[ -n "${DEADLINE_RESERVE_SECONDS:-}" ]]; then args+=(-S "budget.deadline_reserve_s=$DEADLINE_RESERVE_SECONDS"); fi
if [[ -n "${EXPERIMENT_NAME:-}" ]]; then args+=(-S "experiment_name=$(yaml_str "$EXPERIMENT_NAME")"); fi
if [[ -n "${CKPT_DIR:-}" ]]; then args+=(-S "runtime.state_dir=$(yaml_str "$CKPT_DIR")"); fi
# the OPSD log's switches (an unknown one: exit 2, one line); no pipe into `grep -q`: under pipefail, grep's early exit
# could end compgen with SIGPIPE in a large environment and the switches were then silently dropped
if [[ -n "$(compgen -e OPSD_ || true)" ]]; then
    opsd_status=0
    opsd=$("$PYTHON" -m opdkit.recipes opsd-env) || opsd_status=$?
    if ((opsd_status != 0)); then exit "$opsd_status"; fi
    while IFS= read -r kv; do
        if [[ -n "$kv" ]]; then args+=(-S "$kv"); fi
    done <<< "$opsd"
fi
for kv in "$@"; do args+=(-S "$kv"); done

if ((NPROC > 1)); then
    # torchrun reports any worker failure as 1: check inputs and the lock first, so that bad input
    # is still 2 and a held OUTPUT_DIR still 75.
    check_status=0  # WORLD_SIZE: the checks for NPROC processes (prompts per rank, engines)
    WORLD_SIZE="$NPROC" "$PYTHON" -m opdkit "${args[@]}" --check >/dev/null || check_status=$?
    if ((check_status != 0)); then exit "$check_status"; fi
    # --standalone: a rendezvous on a free local port, so two runs on one machine do not collide on 29500
    cmd=(torchrun --standalone --nproc-per-node "$NPROC" -m opdkit "${args[@]}")
    # torchrun passes a stop signal to every rank, then kills them after this grace (its default, 30 s, is
    # shorter than a step plus saving a large state); a rank stuck in a collective ends first, at
    # runtime.collective_timeout_s (300 s)
    export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-600}"
else
    cmd=("$PYTHON" -m opdkit "${args[@]}")
fi

say "experiment ${EXPERIMENT_NAME:-(unnamed)}, output ${OUTPUT_DIR}, recipe ${recipe}"
say "running: $(printf '%q ' "${cmd[@]}")"

# Run the trainer in the background so that a SIGTERM/SIGINT/SIGHUP sent to this script reaches
# it as SIGTERM (it then finishes a pending export and exits 143); background jobs of a
# non-interactive shell ignore SIGINT, hence TERM. The first `wait` returns early when a trapped
# signal arrives: wait again for the trainer's real status.
started=$(date +%s)
"${cmd[@]}" &
child=$!
trap 'kill -TERM "$child" 2>/dev/null || true' TERM INT HUP
status=0
wait "$child" || status=$?
while kill -0 "$child" 2>/dev/null; do
    status=0
    wait "$child" || status=$?
done
trap - TERM INT HUP

checkpoints_dir="$OUTPUT_DIR/checkpoints"
# torchrun reports any ending of its workers other than 0 as its own status: the trainer's run.json
# says whether values went non-finite (3) or a signal stopped it (128+N)
if ((NPROC > 1 && status != 0)); then
    recorded=$("$PYTHON" -c 'import json, os, signal, sys
r = json.load(open(sys.argv[1])) if os.path.getmtime(sys.argv[1]) >= float(sys.argv[2]) else {}  # this run'"'"'s
print(3 if r.get("nonfinite") else 128 + signal.Signals[r["reason"]] if r.get("status") == "stopped" else "")' \
        "$OUTPUT_DIR/run.json" "$started" 2>/dev/null) || recorded=""
    if [[ -n "$recorded" ]]; then status=$recorded; fi
fi

list_survivors() {
    local dirs=()
    if [[ -d "$checkpoints_dir" ]]; then
        mapfile -t dirs < <(find "$checkpoints_dir" -mindepth 1 -maxdepth 1 -type d -name 'checkpoint-*' | sort -V)
    fi
    if ((${#dirs[@]} == 0)); then
        fail "no checkpoint survives in $checkpoints_dir"
        return
    fi
    local valid=() line
    while IFS= read -r line; do
        if [[ "$line" == *": valid" ]]; then valid+=("$(basename "${line%: valid}")"); fi
    done < <("$PYTHON" -m opdkit validate "${dirs[@]}" 2>/dev/null || true)
    if ((${#valid[@]} == 0)); then
        fail "no valid checkpoint survives in $checkpoints_dir"
    else
        fail "surviving valid checkpoints in $checkpoints_dir: ${valid[*]}"
    fi
}

case "$status" in
    0) ;;
    2 | 75) exit "$status" ;; # bad input / locked: the trainer said why in one line, nothing ran
    *)
        if ((status > 128)); then  # run.json (this run's) says whether the trainer stopped on it or was killed
            stopped_by=$("$PYTHON" -c 'import json, os, sys
r = json.load(open(sys.argv[1])) if os.path.getmtime(sys.argv[1]) >= float(sys.argv[2]) else {}
print(r["reason"] if r.get("status") == "stopped" and str(r.get("reason", "")).startswith("SIG") else "")' \
                "$OUTPUT_DIR/run.json" "$started" 2>/dev/null) || stopped_by=""
            if [[ -n "$stopped_by" ]]; then
                fail "training stopped on $stopped_by (exit $status)"
            else
                fail "training was killed by signal $((status - 128)) (exit $status)"
            fi
        elif ((status == 3)); then
            fail "training stopped: values went non-finite (exit 3); nothing non-finite was saved"
        else
            fail "training failed (exit $status)"
        fi
        list_survivors
        exit "$status"
        ;;
esac

# The trainer says it reached its end: check that the final checkpoint is really there (checkpoint-<step>, or the
# newer one of an earlier start that this one replayed behind: run.json's final_checkpoint).
final_name=$("$PYTHON" -c 'import json, sys; r = json.load(open(sys.argv[1]))
print((r.get("final_checkpoint") or "checkpoint-%d" % r["step"]) if r.get("status") == "completed" else "")' \
    "$OUTPUT_DIR/run.json" 2>/dev/null) || final_name=""
if [[ -z "$final_name" ]]; then
    fail "error: the trainer exited 0 but $OUTPUT_DIR/run.json does not record a completed run"
    list_survivors
    exit 1
fi
final="$checkpoints_dir/$final_name"
newest=$(find "$checkpoints_dir" -mindepth 1 -maxdepth 1 -type d -name 'checkpoint-*' 2>/dev/null | sort -V | tail -n 1) || newest=""
if [[ "$newest" != "$final" ]]; then
    fail "error: the final checkpoint should be $final but the newest is ${newest:-none}"
    list_survivors
    exit 1
fi
if ! "$PYTHON" -m opdkit validate "$final"; then
    fail "error: the final checkpoint $final does not validate"
    list_survivors
    exit 1
fi
say "done: training reached its end at step ${final_name#checkpoint-}; final checkpoint $final"
