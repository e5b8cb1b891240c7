#!/usr/bin/env bash
# The signal lane (issue 32), on the device: `opdkit train` with vLLM as the rollout engine (in the trainer's
# process) on the S1 pair (Qwen2-1.5B shape, full fine-tune: a ~21 GB trainer state, a ~3.5 GB bf16 export),
# its whole process group signalled during real saves and during a rollout; each surviving checkpoint validated.
#
#   bash bench/signal_lane.sh        # from the repository root; carry .lane (bash bench/lane_assets.sh makes it)
#
# One run directory, three starts (the second and third resume it):
#   1. fresh: a state and an export every step; SIGTERM to the group 1 s into the step-1 trainer-state save
#      -> expect 143, trainer_state-1 and checkpoint-1 complete
#   2. resumed: SIGINT to the group 0.3 s into the step-2 export (its .tmp-checkpoint-2-* dir exists)
#      -> expect 130, checkpoint-2 complete (the export finishes before the exit)
#   3. resumed with no periodic saves: SIGTERM to the group 2 s into the rollout of the step after the next one
#      completes -> expect 143 within seconds (the vLLM rollout aborted between engine steps: "abandoned during
#      its rollout" in the log), that step's predecessor saved (export, then state)
# $OUT/signal_lane.jsonl: one JSON line per start (signal, offset, exit code, seconds from the signal to the exit,
# each save's GB and GB/s from run.json, `opdkit validate` of every surviving checkpoint, leftover temporary
# dirs), and $OUT/signal_lane.txt (the log tails). Needs the vLLM tree (/tmp/site, unpacked from /tmp/vparts as
# bench/gpu_lane.sh does) and ~50 GB free in /dev/shm (else /tmp). About 4 minutes (each start pays vLLM's
# start-up; the compile cache makes the second and third shorter).
# SIGNAL_LANE_TINY=1: the CPU dry run (tiny pair, HF engine, saves slowed by a sitecustomize so that a signal can
# land inside them): checks the lane itself before device time is spent on it.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
J="$OUT/signal_lane.jsonl"
T="$OUT/signal_lane.txt"
: > "$J"
: > "$T"
log() { echo "$*" | tee -a "$T"; }
START=$(date +%s)

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source bench/vllm_tree.sh  # /tmp/site from all three parts, or nothing
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
if [ "$(df --output=avail -k /dev/shm | tail -1)" -gt 50000000 ]; then R=/dev/shm/siglane; else R=/tmp/siglane; fi
ENGINE=(-S rollout.engine=vllm)
if [ -n "${SIGNAL_LANE_TINY:-}" ]; then
  R=/tmp/siglane_tiny
  ENGINE=(-S rollout.engine=hf -S runtime.device=cpu -S runtime.threads=1 -S rollout.max_new_tokens=64
          -S runtime.logprob_chunk=4 -S rollout.prompts_per_step=2 -S optim.micro_batch=0)
  mkdir -p "$R/site"
  cat > "$R/site/sitecustomize.py" <<'EOF'
import time
import opdkit.persist.publish as pub, opdkit.persist.tensor_files as tf
real_write, real_pwrite = pub._write_safetensors, tf._pwrite_all
def slow_write(path, tensors):
    time.sleep(1.5); return real_write(path, tensors)
def slow_pwrite(*a, **k):
    time.sleep(0.1); return real_pwrite(*a, **k)
pub._write_safetensors, tf._pwrite_all = slow_write, slow_pwrite
EOF
  export PYTHONPATH="$R/site:$PYTHONPATH"
fi
log "signal lane in $R on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1) at $(date -u +%FT%TZ)"
[ -d "$R/s1/student" ] || python3 bench/real_lane.py prepare --root "$R" --assets .lane --pairs s1 ${SIGNAL_LANE_TINY:+--tiny} >> "$T" 2>&1
RUN="$R/runs/signals"
rm -rf "$RUN" "$RUN.log"
mkdir -p "$R/runs"

train() {  # start the trainer in a session of its own (its process group); extra -S overrides as arguments
  local a=(-m opdkit train --out "$RUN" -p none -r recipes/s1.yaml --quiet
           -S "student.path=$R/s1/student" -S "teacher.path=$R/s1/teacher" -S "data.train=$R/s1/train.jsonl"
           -S "data.eval=$R/s1/train.jsonl" -S budget.max_steps=6 -S budget.max_wall_time_s=3000
           -S rollout.max_new_tokens=1024 -S publish.keep=2 -S publish.keep_states=1 -S tracking=none "${ENGINE[@]}")
  for kv in "$@"; do a+=(-S "$kv"); done
  setsid python3 "${a[@]}" >> "$RUN.log" 2>&1 &
  PID=$!
}

wait_for() {  # SECONDS COMMAND...: until the command succeeds; 1 if the trainer ended first or time ran out
  local until=$(( $(date +%s) + $1 )); shift
  until "$@"; do
    kill -0 "$PID" 2>/dev/null || return 1
    [ "$(date +%s)" -lt "$until" ] || return 1
    sleep 0.02
  done
}
tmp_in() { compgen -G "$1" > /dev/null; }
rows_at_least() { [ -f "$RUN/metrics/train.jsonl" ] && [ "$(wc -l < "$RUN/metrics/train.jsonl")" -ge "$1" ]; }

signal_and_record() {  # NAME SIGNAL OFFSET_S: signal the group OFFSET_S from now, wait for the exit, record
  local name=$1 sig=$2 offset=$3 t0 rc took
  sleep "$offset"
  t0=$(date +%s.%N)
  kill -s "$sig" -- "-$PID"
  wait "$PID"; rc=$?
  took=$(python3 -c "import sys, time; print(round(time.time() - float(sys.argv[1]), 1))" "$t0")
  python3 - "$RUN" "$name" "$sig" "$offset" "$rc" "$took" >> "$J" 2>> "$T" <<'EOF'
import json, sys
from pathlib import Path
run, name, sig, offset, rc, took = Path(sys.argv[1]), *sys.argv[2:]
from opdkit.persist.checkpoints import is_valid_checkpoint, list_checkpoints
# every surviving checkpoint's structure (headers, sizes, shapes: seconds); `opdkit validate` (values, loading) at the end
valid = {c.name: is_valid_checkpoint(c, full=False)[1] for c in list_checkpoints(run / "checkpoints")}
record = json.loads((run / "run.json").read_text()) if (run / "run.json").is_file() else {}
left = sorted(p.name for d in (run / "checkpoints", run / "state") if d.is_dir() for p in d.iterdir() if p.name.startswith("."))
states = sorted(p.name for p in (run / "state").glob("trainer_state-*")) if (run / "state").is_dir() else []
print(json.dumps({"start": name, "signal": sig, "offset_s": float(offset), "exit": int(rc), "exit_after_signal_s": float(took),
                  "status": record.get("status"), "reason": record.get("reason"), "step": record.get("step"),
                  "abandoned_step": (record.get("stop") or {}).get("abandoned_step"), "saves": record.get("saves"),
                  "checkpoints": valid, "states": states, "leftovers": left}))
EOF
  log "$name: $sig ${offset}s in -> exit $rc after ${took}s ($(( $(date +%s) - START ))s into the lane)"
}

# 1. the step-1 trainer-state save (a state and an export every step)
train publish.every_steps=1 publish.state_every_steps=1
if wait_for 400 tmp_in "$RUN/state/.tmp-trainer_state-1-*"; then
  signal_and_record state-save-1s TERM 1.0
else
  wait "$PID"; log "state-save: the step-1 state save never began (trainer exit $?)"
fi
# 2. resumed: the step-2 export
train publish.every_steps=1 publish.state_every_steps=1
if wait_for 400 tmp_in "$RUN/checkpoints/.tmp-checkpoint-2-*"; then
  signal_and_record export-0.3s INT 0.3
else
  wait "$PID"; log "export: the step-2 export never began (trainer exit $?)"
fi
# 3. resumed, no periodic saves: a rollout in flight
n=$( [ -f "$RUN/metrics/train.jsonl" ] && wc -l < "$RUN/metrics/train.jsonl" || echo 0)
train publish.every_steps=100 publish.state_every_steps=0
if wait_for 400 rows_at_least $(( n + 1 )); then
  signal_and_record rollout-2s TERM 2.0
else
  wait "$PID"; log "rollout: no step completed (trainer exit $?)"
fi
# what survives, as `opdkit validate` sees it (values streamed, model and tokenizer loaded)
python3 - "$RUN" >> "$J" 2>> "$T" <<'EOF'
import json, subprocess, sys
from pathlib import Path
ckpts = sorted((Path(sys.argv[1]) / "checkpoints").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
p = subprocess.run([sys.executable, "-m", "opdkit", "validate", *map(str, ckpts)], capture_output=True, text=True) if ckpts else None
print(json.dumps({"validate": p.stdout.strip().splitlines() if p else [], "exit": p.returncode if p else None}))
EOF
tail -c 3000 "$RUN.log" >> "$T"
grep -h "abandoned during its rollout\|saved the trainer state\|published \|received: stopping\|stopping at step" "$RUN.log" >> "$T"
rm -rf "$R/runs"
log "signal lane done in $(( $(date +%s) - START ))s"
cat "$J"
