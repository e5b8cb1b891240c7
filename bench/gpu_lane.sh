#!/usr/bin/env bash
# The GPU lane: what a user runs, on the device machine (one H200; vLLM 0.26.0, carried offline).
# A random-init Qwen2-1.5B-shaped pair (student 151,936 / teacher 152,064 embedding rows) and a
# Qwen3-1.7B-shaped S2 student, all with the real Qwen2.5 tokenizer (151,665 ids, carried in .lane/,
# made by bench/lane_assets.sh), trained by `opdkit train -p none -r recipes/s1.yaml|s2.yaml`
# (bench/real_lane.py). Two calls of at most LANE_BUDGET_S (470 s) each, run from the repository root:
#   bash bench/gpu_lane.sh 1   # the default engine (vLLM) at the recipes' settings:
#                              #   S1 (k1, full FT, 7,168 new tokens) 3 steps; vLLM serves its checkpoint-3
#                              #   as published; the run resumed to step 4; S2 (LoRA, JSD, 1,024 tokens) 2 steps
#   bash bench/gpu_lane.sh 3   # S1's step with the HF teacher vs the vLLM teacher (teacher.source=vllm, colocated
#                              #   in its own engine process, the S1 teacher cut to the tokenizer's ids by opdkit
#                              #   vocab-cut), both with the HF engine's static-cache decoder, 3 steps at 512 new
#                              #   tokens: BENCHMARKS.md's teacher table. LANE_BUDGET_S=170 keeps it under 3 minutes
#   bash bench/gpu_lane.sh 2   # temperature 0.6 / top-p 0.95 through vLLM, then the HF engine (static-cache
#                              #   decoder) at both settings, S1 at 1,024 new tokens there (not 7,168: the device
#                              #   time), no resume (call 1 resumes); then the GPU tests
# Every step runs under `timeout` (its own limit, and never past the call's budget: what does not fit
# is logged as skipped), its result is appended to $OUT/runs.jsonl the moment it exists, and a failing
# step does not stop the next. Out: $OUT/lane.txt (what ran, exit codes, seconds), runs.jsonl,
# lane.md (the table), tests.txt. Runs live in /dev/shm when it has room (a 1.78B full-FT trainer state
# is ~21 GB), and each is deleted once done with.
set -uo pipefail
PHASE=${1:?usage: bash bench/gpu_lane.sh 1|2|3}
OUT=${OUT:-/tmp/out}
BUDGET=${LANE_BUDGET_S:-470}
START=$(date +%s)
mkdir -p "$OUT"
log() { echo "$*" | tee -a "$OUT/lane.txt"; }
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
step() {  # step NAME LIMIT_S MIN_S CMD ...: under timeout min(LIMIT_S, the budget left - 15 s); skipped when
  local name=$1 limit=$2 min=$3 t0 rc l; shift 3  # that is under MIN_S (it could not finish: no half runs)
  l=$(( $(left) - 15 )); [ "$l" -lt "$limit" ] && limit=$l
  if [ "$limit" -lt "$min" ]; then log "$name: skipped (${limit}s of the budget left, needs ${min}s)"; return 0; fi
  t0=$(date +%s); timeout -k 10 "$limit" "$@" > /dev/null 2>> "$OUT/stderr.txt"; rc=$?
  log "$name: rc=$rc in $(( $(date +%s) - t0 ))s (limit ${limit}s)$([ $rc = 124 ] && echo ', TIMED OUT')"
}

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source bench/vllm_tree.sh  # /tmp/site from all three parts, or nothing
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
log "phase $PHASE on $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null) at $(date -u +%FT%TZ)"
python3 -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)" 2>/dev/null | tail -1 | tee -a "$OUT/lane.txt"
if [ "$(df --output=avail -k /dev/shm | tail -1)" -gt 60000000 ]; then R=/dev/shm/lane; else R=/tmp/lane; fi
L="python3 bench/real_lane.py"
A="--root $R --out $OUT${LANE_TINY:+ --tiny}"  # LANE_TINY=1: the CPU dry run (tiny shapes, HF engine)
log "runs in $R ($(df -h --output=avail "$(dirname $R)" | tail -1) free)"
[ -f .lane/tokenizer.json.xz ] || log "no .lane/tokenizer.json.xz: carry .lane (bash bench/lane_assets.sh makes it)"
step prepare 150 30 $L prepare --root $R --assets .lane${LANE_TINY:+ --tiny}$([ "$PHASE" = 3 ] && echo " --pairs s1")
rm -rf "$R/runs"  # runs of an earlier call on this machine
VLLM="-S rollout.engine=vllm"
HF="-S rollout.engine=hf"
HOT="-S rollout.temperature=0.6 -S rollout.top_p=0.95"
SHORT="-S rollout.max_new_tokens=1024"

if [ "$PHASE" = 3 ]; then  # the teacher in vLLM: same student, same rollouts engine, same 3 steps
  T512="-S rollout.max_new_tokens=512"
  [ -d "$R/s1/teacher-cut" ] || step vocab_cut 40 10 python3 -m opdkit vocab-cut --model "$R/s1/teacher" --out "$R/s1/teacher-cut"
  ( while sleep 5; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits; done > "$OUT/gpu_mem.txt" 2>/dev/null ) &
  MON=$!  # the GPU's memory in use every 5 s: the teacher's engine process is not in the trainer's peak_mem_gb
  step s1_teacher_vllm 110 60 $L train $A --name s1_teacher_vllm --recipe s1 --steps 3 $HF $T512 \
    -S teacher.source=vllm -S teacher.path="$R/s1/teacher-cut" -S teacher.gpu_memory_utilization=0.15
  log "GPU memory in use during s1_teacher_vllm, max: $(sort -n "$OUT/gpu_mem.txt" | tail -1) MiB"
  rm -rf "$R/runs/s1_teacher_vllm"
  : > "$OUT/gpu_mem.txt"
  step s1_teacher_hf 75 40 $L train $A --name s1_teacher_hf --recipe s1 --steps 3 $HF $T512
  log "GPU memory in use during s1_teacher_hf, max: $(sort -n "$OUT/gpu_mem.txt" | tail -1) MiB"
  kill $MON 2>/dev/null
  rm -rf "$R/runs/s1_teacher_hf"
elif [ "$PHASE" = 1 ]; then
  step s1_vllm 300 150 $L train $A --name s1_vllm --recipe s1 --steps 3 $VLLM
  step vllm_load 90 40 $L vllm-load --ckpt "$R/runs/s1_vllm/checkpoints/checkpoint-3" --out "$OUT"
  step s1_vllm_resume 200 100 $L train $A --name s1_vllm --recipe s1 --steps 4 $VLLM
  rm -rf "$R/runs/s1_vllm"
  step s2_vllm 160 110 $L train $A --name s2_vllm --recipe s2 --steps 2 $VLLM
  rm -rf "$R/runs/s2_vllm"
else  # the most informative first: what does not fit in the budget is skipped, and logged so
  step s1_vllm_hot 220 130 $L train $A --name s1_vllm_hot --recipe s1 --steps 3 $VLLM $HOT $SHORT
  rm -rf "$R/runs/s1_vllm_hot"
  step s2_vllm_hot 140 100 $L train $A --name s2_vllm_hot --recipe s2 --steps 2 $VLLM $HOT
  rm -rf "$R/runs/s2_vllm_hot"
  step s1_hf_hot 160 70 $L train $A --name s1_hf_hot --recipe s1 --steps 3 $HF $HOT $SHORT
  rm -rf "$R/runs/s1_hf_hot"
  step s2_hf_hot 100 50 $L train $A --name s2_hf_hot --recipe s2 --steps 2 $HF $HOT
  rm -rf "$R/runs/s2_hf_hot"
  step s2_hf 100 50 $L train $A --name s2_hf --recipe s2 --steps 2 $HF
  rm -rf "$R/runs/s2_hf"
  step s1_hf 160 70 $L train $A --name s1_hf --recipe s1 --steps 3 $HF $SHORT
  rm -rf "$R/runs/s1_hf"
  # the real vLLM engine at 0.6 / 0.95 on a model with padding rows; CUDA-graph decoding against eager
  step tests 150 60 python3 -m pytest -p no:cacheprovider -o addopts="" -q -rA \
    tests/test_vllm_engine.py::test_vllm_samples_the_live_student tests/test_gpu.py tests/test_decode.py \
    tests/test_vllm_teacher.py::test_the_colocated_vllm_teacher_agrees_with_the_hf_teacher \
    tests/test_teachers.py::test_a_teacher_on_the_cpu_beside_a_student_on_the_gpu \
    --junitxml="$OUT/tests.xml"
  python3 - "$OUT/tests.xml" > "$OUT/tests.txt" 2>&1 <<'EOF'
import sys, xml.etree.ElementTree as ET
try:
    for case in ET.parse(sys.argv[1]).iter("testcase"):
        bad = [c for c in case if c.tag in ("failure", "error", "skipped")]
        print(f"{bad[0].tag.upper() if bad else 'PASSED'} {case.get('classname')}::{case.get('name')} {case.get('time')}s"
              + (f"\n  {(bad[0].get('message') or '')[:400]}" if bad else ""))
except FileNotFoundError:
    print("no test results (the tests step did not run)")
EOF
  rm -f "$OUT/tests.xml"
fi
$L report --out "$OUT" > /dev/null 2>> "$OUT/stderr.txt"
tail -c 4000 "$OUT/stderr.txt" > "$OUT/stderr_tail.txt" 2>/dev/null; rm -f "$OUT/stderr.txt"
log "phase $PHASE done in $(( $(date +%s) - START ))s"
cat "$OUT/lane.md" 2>/dev/null
