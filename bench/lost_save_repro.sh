#!/usr/bin/env bash
# The GPU lane's two lost saves (issue 32), reproduced on a CPU with the embedded default: what the lane's
# harness did, then the same with a wrapper that waits for the trainer.
#
#   bash bench/lost_save_repro.sh        # ~2 minutes on a CPU; prints one line per case
#
# The lane (bench/gpu_lane.sh) ran each training as `timeout -k 10 LIMIT python bench/real_lane.py train ...`,
# and real_lane.py ran the trainer with a plain subprocess.run. When the limit struck, `timeout` signalled its
# child and the process group: real_lane.py died at once (no handler), the trainer (a SIGTERM is a stop request
# to it) went on saving, and `timeout` returned as soon as its own child was gone. gpu_lane.sh then removed the
# run directory (`rm -rf "$R/runs/NAME"`) under the trainer's feet, which reported exactly the issue's errors:
#   "publishing failed ... No such file or directory: .../.tmp-checkpoint-4-<pid>/model.safetensors"
#   "FileNotFoundError: ... state/.tmp-trainer_state-3-.../..." (the previous format: ".metadata.tmp")
# The vLLM runs were the ones that ran into their limits (vLLM's start-up); nothing of vLLM takes part.
# Here the trainer's saves are made slow (a sitecustomize) so that the signal lands inside them, the group is
# signalled as `timeout` does, and the directory is removed as soon as the wrapper has exited.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY=${PYTHON:-python}
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
mkdir -p "$W/site" "$W/marks"
cat > "$W/site/sitecustomize.py" <<'EOF'
import os, pathlib, time
MARKS = pathlib.Path(os.environ["MARKS"])
def mark(name):
    (MARKS / name).touch()
import opdkit.persist.publish as pub, opdkit.persist.tensor_files as tf
real_write, real_pwrite = pub._write_safetensors, tf._pwrite_all
def slow_write(path, tensors):
    mark("export"); time.sleep(3.0); return real_write(path, tensors)
def slow_pwrite(*a, **k):
    mark("state"); time.sleep(0.1); return real_pwrite(*a, **k)
pub._write_safetensors, tf._pwrite_all = slow_write, slow_pwrite
EOF
# the lane's wrapper (real_lane.py's subprocess.run before the fix), and one that waits (run_waiting, run.sh)
LANE='import subprocess, sys; raise SystemExit(subprocess.run(sys.argv[1:]).returncode)'
WAITS='import sys; sys.path.insert(0, sys.argv[1]); from real_lane import run_waiting; raise SystemExit(run_waiting(sys.argv[2:]))'

case_() {  # NAME WRAPPER(lane|waits) SAVE(export|state)
  local name=$1 wrapper=$2 save=$3 out="$W/$1" pid rc
  rm -f "$W/marks/"*
  local args=(-m opdkit train --out "$out" -p none --quiet -S budget.max_wall_time_s=0 -S optim.schedule=constant
              -S budget.max_steps=3 -S publish.every_steps=3 -S rollout.prompts_per_step=2 -S runtime.threads=1
              -S tracking=none)
  if [ "$wrapper" = lane ]; then
    setsid env PYTHONPATH="$W/site:$HERE" MARKS="$W/marks" "$PY" -c "$LANE" "$PY" "${args[@]}" > "$W/$name.log" 2>&1 &
  else
    setsid env PYTHONPATH="$W/site:$HERE" MARKS="$W/marks" "$PY" -c "$WAITS" "$HERE/bench" "$PY" "${args[@]}" \
      > "$W/$name.log" 2>&1 &
  fi
  pid=$!
  until [ -e "$W/marks/$save" ]; do sleep 0.05; kill -0 $pid 2>/dev/null || break; done
  sleep 0.5
  kill -TERM -- "-$pid"   # as `timeout` does: its child, then the whole group
  wait $pid; rc=$?
  local have; have=$(ls -d "$out"/checkpoints/checkpoint-* 2>/dev/null | wc -l)
  rm -rf "$out"           # gpu_lane.sh, as soon as its step has returned
  sleep 20                # an orphaned trainer finishes (or fails) meanwhile
  local err; err=$(grep -h -o -E "publishing failed.{0,200}No such file.{0,120}|FileNotFoundError.{0,160}|training failed.{0,160}" \
    "$W/$name.log" | head -1)
  [ -n "${KEEP_LOGS:-}" ] && cp "$W/$name.log" "$KEEP_LOGS/"
  printf '%s: wrapper exit %s, checkpoints when it returned: %s; trainer: %s\n' "$name" "$rc" "$have" \
    "${err:-no error}"
}

case_ lane-final-export lane export
case_ lane-final-state lane state
case_ waits-final-export waits export
case_ waits-final-state waits state
