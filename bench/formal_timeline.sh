#!/usr/bin/env bash
# The formal replay's end on the device (issue 32's closing note): `bash run.sh` with the orchestrator's
# variables on the lane's S1 pair (Qwen2-1.5B shape, full fine-tune) under MAX_WALL_TIME_SECONDS=300,
# DEADLINE_RESERVE_SECONDS=60, timed from outside; then its timeline from run.json and train.jsonl.
#
#   bash bench/formal_timeline.sh      # from the repository root; carry .lane; ~5.5 minutes
#
# $OUT/formal_timeline.json: run.sh's exit and wall seconds (from before it started to after it returned), the
# trainer's steps (elapsed at each end, step seconds), the stop decision (when, what it reserved: the next step,
# each save measured or estimated, the deadline reserve), every save's GB and GB/s, the end of the final saves
# (ended_s) against the budget, and the final checkpoint's `opdkit validate`. It should show an exit 0, the
# final saves ended and run.sh returned by 300 s (the issue's run: 345 s, a 95 s final save at ~0.3 GB/s).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source bench/vllm_tree.sh  # /tmp/site from all three parts, or nothing
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
if [ "$(df --output=avail -k /dev/shm | tail -1)" -gt 60000000 ]; then R=/dev/shm/lane; else R=/tmp/lane; fi
[ -d "$R/s1/student" ] || python3 bench/real_lane.py prepare --root "$R" --assets .lane --pairs s1 > "$OUT/formal_prepare.txt" 2>&1
rm -rf "$R/formal"
t0=$(date +%s.%N)
OUTPUT_DIR="$R/formal" STUDENT_MODEL="$R/s1/student" TEACHER_MODEL="$R/s1/teacher" TRAIN_DATA="$R/s1/train.jsonl" \
  MAX_WALL_TIME_SECONDS=300 DEADLINE_RESERVE_SECONDS=60 bash run.sh > "$OUT/formal_run.txt" 2>&1
rc=$?
t1=$(date +%s.%N)
python3 - "$R/formal" "$rc" "$t0" "$t1" > "$OUT/formal_timeline.json" <<'EOF'
import json, subprocess, sys
from pathlib import Path
out, rc, t0, t1 = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
run = json.loads((out / "run.json").read_text()) if (out / "run.json").is_file() else {}
rows = [json.loads(ln) for ln in (out / "metrics" / "train.jsonl").read_text().splitlines()] if (out / "metrics" / "train.jsonl").is_file() else []
final = out / "checkpoints" / (run.get("final_checkpoint") or "none")
v = subprocess.run([sys.executable, "-m", "opdkit", "validate", str(final)], capture_output=True, text=True)
print(json.dumps({"run_sh_exit": rc, "run_sh_wall_s": round(t1 - t0, 1), "budget_s": 300, "status": run.get("status"),
                  "steps": [{"step": r["step"], "elapsed_s": r["elapsed_s"], "step_s": round(r["time_rollout_s"] + r["time_score_s"]
                             + r["time_update_s"], 1)} for r in rows],
                  "stop": run.get("stop"), "saves": run.get("saves"), "final_saves_ended_s": run.get("ended_s"),
                  "final_checkpoint": run.get("final_checkpoint"), "validate": v.stdout.strip() or v.stderr.strip()[-500:]},
                 indent=1))
EOF
grep -h "write probe\|stopping at step\|saved the trainer state\|published \|final saves ended" "$OUT/formal_run.txt" | tail -12
rm -rf "$R/formal"
cat "$OUT/formal_timeline.json"
