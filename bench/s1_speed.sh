#!/usr/bin/env bash
# Issue 26 on one H200: where a decode step's milliseconds go, what each rollout lever gives, the S1 table
# through `opdkit train -r recipes/s1.yaml` on the GPU lane's real-architecture pair (qwen2 at the 1.5B shape,
# real Qwen2.5 tokenizer, student 151,936 / teacher 152,064 rows), and TRL 1.16 on the same pair, prompts and
# token cap. From the repository root, carried: .lane (bench/lane_assets.sh), .whl and .speed
# (bench/speed_assets.sh); the vLLM tree in /tmp/site (or its parts in /tmp/vparts, as bench/gpu_lane.sh):
#   bash bench/s1_speed.sh table    # ~585 s: at each length of SPEED_LENGTHS (1024 3072 7168): S1 4 steps with the
#                                   #   default (steps 2-4 median), then TRL 1.16 with its own vLLM (SPEED_TRL_STEPS=3;
#                                   #   steps 2.. median) on the same pair, prompts and token cap: the same-call table
#   bash bench/s1_speed.sh levers   # ~480 s: static decoder before/after, opdkit's vLLM engine levers + profile,
#                                   #   bare vllm.LLM with its engine core in its own process / without async scheduling
#   bash bench/s1_speed.sh all      # both, most informative first, within SPEED_BUDGET_S
#   bash bench/s1_speed.sh dev      # ~520 s: tests/test_gpu.py, the static decoder before/after at 1,024 tokens (profile),
#                                   #   scoring + update packed vs row by row (profile, FLOP rate), S1 at 1,024 and 7,168
# Every part runs under `timeout` (its own limit, never past the budget; what cannot finish is logged as
# skipped), appends its result to $OUT/results.jsonl (bench/s1_speed.py) or $OUT/runs.jsonl (bench/real_lane.py)
# the moment it exists, and a failing part does not stop the next. Out (8 files at most): log.txt,
# results.jsonl, runs.jsonl, speed.md (the tables), profile_*.txt, logs.tgz (the parts' output and each run's log).
# SPEED_S1_OPTS: more options for the table's S1 runs (e.g. "-S runtime.grad_checkpointing=false"; said in log.txt).
# SPEED_TINY=1: the CPU dry run (tiny shapes; vLLM parts need vLLM importable, TRL parts TRL).
set -uo pipefail
PHASE=${1:?usage: bash bench/s1_speed.sh levers|table|all}
OUT=${OUT:-/tmp/out}
case $PHASE in levers) D=480 ;; table) D=585 ;; dev) D=540 ;; *) D=585 ;; esac
BUDGET=${SPEED_BUDGET_S:-$D}
START=$(date +%s)
mkdir -p "$OUT"
log() { echo "$*" | tee -a "$OUT/log.txt"; }
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
part() {  # part NAME LIMIT_S MIN_S CMD ...: under timeout min(LIMIT_S, the budget left - 10 s); skipped below MIN_S
  local name=$1 limit=$2 min=$3 t0 rc l; shift 3
  l=$(( $(left) - 10 )); [ "$l" -lt "$limit" ] && limit=$l
  if [ "$limit" -lt "$min" ]; then log "$name: skipped (${limit}s of the budget left, needs ${min}s)"; return 0; fi
  t0=$(date +%s); timeout -k 10 "$limit" "$@" >> "$OUT/parts.log" 2>&1; rc=$?
  log "$name: rc=$rc in $(( $(date +%s) - t0 ))s (limit ${limit}s)$([ $rc = 124 ] && echo ', TIMED OUT')"
}

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
source bench/vllm_tree.sh  # /tmp/site from all three parts, or nothing
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 \
  TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
[ -n "${SPEED_S1_OPTS:-}" ] && echo "S1 runs with: $SPEED_S1_OPTS" >> "$OUT/log.txt"
log "s1_speed $PHASE on $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null) at $(date -u +%FT%TZ), budget ${BUDGET}s"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" 2>/dev/null | tee -a "$OUT/log.txt"
if [ "$(df --output=avail -k /dev/shm | tail -1)" -gt 60000000 ]; then R=/dev/shm/lane; else R=/tmp/lane; fi
T=${SPEED_TINY:+--tiny}
S="python3 bench/s1_speed.py"
L="python3 bench/real_lane.py"
A="--root $R --out $OUT $T"
[ -f .lane/tokenizer.json.xz ] || log "no .lane/tokenizer.json.xz: carry .lane (bash bench/lane_assets.sh makes it)"
part prepare 150 20 $L prepare --root $R --assets .lane --pairs s1 $T
MAIN=""; [ -f .speed/static_main.py ] && MAIN="--static-main .speed/static_main.py"

levers() {
  part static 150 40 $S static $A $MAIN
  part vllm 240 120 $S vllm $A
  part vllm_mp 130 80 $S vllm-raw $A --mp 1
  part vllm_sync 120 80 $S vllm-raw $A --async-scheduling 0
}
table() {  # opdkit and TRL at each length of SPEED_LENGTHS, one after the other (a pair is complete before the next)
  rm -rf "$R/runs"
  if [ -d .whl ] && [ ! -d /tmp/trlsite/trl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/trlsite .whl/*.whl >> "$OUT/parts.log" 2>&1 \
      && log "TRL wheels installed in /tmp/trlsite" || log "TRL wheels: install failed"
  fi
  for T in ${SPEED_LENGTHS:-1024 3072 7168}; do
    part s1_$T 200 40 $L train $A --name s1_$T --recipe s1 --steps 4 -S rollout.max_new_tokens=$T ${SPEED_S1_OPTS:-}
    rm -rf "$R/runs/s1_$T"
    PYTHONPATH=$PYTHONPATH:/tmp/trlsite part trl_$T 240 60 $S trl $A --max-new-tokens $T --steps ${SPEED_TRL_STEPS:-3} --trl-vllm
    rm -rf "$R/trl_out"
  done
}
dev() {  # the decoder and update work: GPU tests, the decoder before/after, the update packed vs by row, S1 at 1,024 / 7,168
  part gpu_tests 170 40 python3 -m pytest -q -o addopts="" -p no:cacheprovider -p no:randomly tests/test_gpu.py
  part static 150 40 $S static $A $MAIN --max-new-tokens 1024
  part update 150 40 $S update $A --max-new-tokens 1024
  part s1_1024 150 60 $L train $A --name s1_1024 --recipe s1 --steps 4 -S rollout.max_new_tokens=1024
  rm -rf "$R/runs/s1_1024"
  part s1_7168 200 100 $L train $A --name s1_7168 --recipe s1 --steps 4
  rm -rf "$R/runs/s1_7168"
}
case $PHASE in
  dev) dev ;;
  levers) levers ;;
  table) table ;;
  all) table; levers ;;
esac
$S report --out "$OUT" > /dev/null 2>> "$OUT/parts.log"
$L report --out "$OUT" > /dev/null 2>> "$OUT/parts.log"
# every log in one file (8 files come back at most): the parts' output, each run's own log
rm -rf /tmp/speed_logs && mkdir -p /tmp/speed_logs && cp "$OUT/parts.log" "$R"/*.log /tmp/speed_logs/ 2>/dev/null
tar -czf "$OUT/logs.tgz" -C /tmp speed_logs; rm -f "$OUT/parts.log" "$OUT/lane.md"
log "s1_speed $PHASE done in $(( $(date +%s) - START ))s"
cat "$OUT/speed.md" "$OUT/lane.md" 2>/dev/null
