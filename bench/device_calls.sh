#!/usr/bin/env bash
# One session's device calls on one H200, back to back (the machine goes back 30 s after a call; the vLLM tree
# travels as three parts, one a call, kept in /tmp/vparts). From the repository root:
#   a: carry .lane .v0           GPU tests (decoder kernels, packing, the CUDA paths), the update packed vs row
#                                by row at 1,024 new tokens (bench/s1_speed.py update), the save speeds (~4 min)
#   b: carry .lane .v1           the formal replay under MAX_WALL_TIME_SECONDS=300 (bench/formal_timeline.sh, ~5.5 min)
#   c: carry .lane .v2 .whl      vLLM unpacked; opdkit and TRL + its vLLM at 1,024 / 7,168 / 3,072 new tokens,
#                                pair by pair (bench/s1_speed.sh table, ~9.5 min)
#   vt: as d, the vLLM teacher's tests only (~3 min)
#   g: carry .lane               the decode projections: cuBLAS vs the GEMV kernels (bench/gemv_bench.py), the static
#                                decoder with each (bench/s1_speed.py static), the decoder's GPU tests (~8 min)
#   g2: carry .lane              S1 at 1,024 and 7,168 new tokens, rollout.decode_gemv true / false (~5 min)
#   g3a: carry .lane             the decoder's GPU tests, the projections and the decoder with the GEMV kernels (~4 min)
#   g3b: carry .lane             S1 at 1,024 / 7,168 by default and without gradient checkpointing (7,168: micro-batches
#                                of 2 rows) (~6 min)
#   g4: carry .lane              g3a's tests and decoder, S1 at 1,024 (4 steps) and 7,168 (3) by default (~6 min)
#   f1: carry .lane .speed .v0   the decoder's GPU tests; the static decoder and S1 at 1,024 before (.speed/head: the
#                                kit before the change, SPEED_KIT) and after; the bf16 matrix rate (~7 min)
#   f2: carry .lane .v1          the update at 7,168 (FLOP rate, profile); S1 at 7,168 without gradient checkpointing
#                                in micro-batches of 2 rows (~5 min)
#   h1: carry .speed           the attention kernel's GPU tests; bench/attn_bench.py (the partials kernel before /
#                                after at contexts up to 7,168, its launch settings); the GEMV kernels' warps / stages
#                                (bench/gemv_bench.py --grid tune) (~8 min)
#   h2: carry .lane .speed .v0  the decoder's GPU tests; the static decoder before (.speed/head) / after at 1,024 new
#                                tokens (samples' digest, steps/s, profile); S1 at 7,168 (3 steps) (~7 min)
#   h3: carry .lane .speed      h2's tests, the static decoder at 1,024 (digest), bench/attn_bench.py (~5 min)
#   h4: carry .lane             S1 at 1,024 and 3,072 new tokens, 4 steps each (~3 min)
#   p1: carry .lane .speed .v0  the decoder's GPU tests; the static decoder at 1,024 new tokens: the kit before
#                                (.speed/head), this kit without and with programmatic dependent launch (~5 min)
#   p2: carry .lane .speed .v0  the decoder's GPU tests; the sampling tail before / after (bench/s1_speed.py sample);
#                                the static decoder at 1,024 of the kit before (.speed/head) and this kit, their
#                                recorded log-probs compared (logp_diff.txt) (~5 min)
#   p3: carry .lane .speed .v1  S1 at 1,024 new tokens, 4 steps, the kit before (.speed/head) and this kit (~3.5 min)
#   p4: carry .lane             the decoder's GPU tests, the static decoder at 1,024 (at 1.0 / 1.0 and at the seeds'
#                                0.6 / 0.95), S1 at 1,024 (4 steps) and 7,168 (3) (~7 min)
#   q1: carry .lane .speed       the decoder's GPU tests; the sampling tail at 0.6 / 0.95 (torch sampler vs the nucleus
#                                kernels); the static decoder at 1,024 at 0.6 / 0.95 (batch 8) and 0.7 / 0.9 (batch 64, the
#                                evaluations'), the kit before (.speed/head) and this kit, and this kit at 1.0 / 1.0 (~8 min)
#   q2: carry .lane              the GPU test of runtime.checkpoint_keep_attention; S1 at 7,168 (3 steps) by default and
#                                with it; at 1,024 (4 steps) with it (~6 min)
#   q3: carry .lane .speed       the sampling kernels' GPU tests; the sampling tail at 0.6 / 0.95 over launch settings;
#                                the static decoder at 1,024, 0.6 / 0.95 (batch 8) and 0.7 / 0.9 (batch 64), the kit before
#                                (.speed/head) and this kit with its default and the fastest settings (~7 min)
#   q4: carry .lane              (a short call) the static decoder at 1,024 at 0.6 / 0.95 (batch 8); the sampling kernels'
#                                GPU test; the sampling tail at 0.6 / 0.95; the decoder at 0.7 / 0.9, batch 64 (~4 min)
#   r1: carry .lane .speed .v0   the attention kernels before (.speed/head) / after over blocks, stages and splits at the
#                                capacities of 1,024 / 3,072 / 7,168 new tokens (bench/attn_bench.py); the static decoder
#                                at 1,024 and 7,168 new tokens, the kit before and this kit (digests, log-probs) (~7 min)
#   r2: carry .lane .v1          the decoder's GPU tests; the static decoder at 1,024 / 7,168; S1 at 7,168 (3 steps) and
#                                1,024 (4 steps) (~8 min)
#   r3: carry .lane              timing only: the static decoder at 1,024 with the attention's merge and / or the add +
#                                norm after the output projection left out (s1_speed.py static --ablate): what folding
#                                those kernels into the ones before could gain at most (~3 min)
#   u1: carry .lane .speed .v0   S1 at 1,024 (4 steps) and 7,168 (3 steps), the kit before (.speed/head) and this kit
#                                (runtime.unchecked_layers_memory: layers left unchecked where memory allows) (~9 min)
#   u2: carry .lane .v1          the GPU test of the unchecked layers; S1 at 7,168 (3 steps) with a share of 0.7; r3's
#                                timing-only ablation of the merge / the add + norm (~6 min)
#   u3: carry .lane              the GPU test of the unchecked layers; S1 at 7,168 (3 steps, twice) and 1,024 (4 steps) by
#                                default (~6 min)
#   u4: carry .lane              the update's attention: varlen FlashAttention vs sdpa's cuDNN / flash row by row
#                                (bench/update_attn_bench.py); S1 at 7,168 (3 steps) (~4 min; on 2026-12-04 it also ran
#                                S1 through sdpa's cuDNN kernel row by row, a switch since taken out: slower)
#   v1: carry .lane              the GEMV GPU tests (PRE: blocks of weights loaded before the wait); the decoder's GEMV
#                                launch settings in place (bench/gemv_pre_bench.py), the best written into a copy of the
#                                kit at /tmp/kit_best (~7 min)
#   v2: carry .lane              (after v1, the machine still warm) S1 at 7,168 (3 steps) and 1,024 (4 steps), this kit
#                                and /tmp/kit_best (~5 min)
#   v3: carry .lane              the decoder's and the GEMV's GPU tests in test_gpu.py; one S1 step's scoring and update at
#                                7,168 new tokens, packed, with the unchecked layers (s1_speed.py update): times, FLOP
#                                rate, kernels and the ops that launched them (~6 min)
#   w0: carry .lane              the GPU tests (tests/test_gpu.py, the decoder's and the kernels' files) after the launch
#                                options pinned FP fusion (48ac587) and the checkpointing switch moved to its new name
#                                (1058438) (~4 min)
#   w1: carry .lane              S1 as issue 31 times it: 7,168 new tokens, 4 steps (steps 2-4); 1,024, 4 steps; the static
#                                decoder at 1,024 beside the weights-only bound measured in the same call (~6 min)
#   w2: carry .lane              (after w1, the machine still warm) S1 at 7,168 new tokens, 4 steps, twice (~5 min)
#   w12: carry .lane             w1 with a second 7,168 run in one call (~7.5 min); then w0b: carry .lane, w0's tests and
#                                a third 7,168 run (~6 min)
#   x1: carry .lane              the attention's split count: bench/attn_bench.py --programs 128,64 at the capacities of
#                                7,168 and 1,024 new tokens; the static decoder at 7,168 of this kit and of copies whose
#                                AttentionPlan defaults to 128 / 64 programs (/tmp/kit_p128, /tmp/kit_p64) (~8 min)
#   x2: carry .lane              (after x1; the copy is remade if the machine is fresh) S1 at 7,168, 4 steps: this kit,
#                                this kit with runtime.checkpoint_keep_matmuls off, /tmp/kit_p$X2_PROGRAMS (128) (~8 min)
#   y1: carry .lane              (an H200) S1 at 7,168, 4 steps: runtime.checkpoint_keep_matmuls on, off, on (~7 min)
#   y2: carry .lane              the update's profile at 7,168 with the copies by shape (v3's); the down projection's
#                                GEMV settings in the decoder (gemv_pre_bench --only down); the decoder at 1,024 (~7 min)
#   z1: (nothing carried)        what a dependent step between two phases costs apart from the work: 224 phases as PDL
#                                kernels in one graph vs one persistent kernel waiting on a grid-wide counter, with and
#                                without weights streamed a phase (bench/sync_floor.py, ~2 min)
#   e0: carry .lane              e1's evaluation through the kit's decoder alone (~3 min with the pair's preparation)
#   e1: carry .lane              (vLLM already unpacked by earlier calls' parts) opdkit eval of the S1 student, 64
#                                questions x 4 samples x 2,048 new tokens, eval.engine=hf then vllm: wall seconds each
#                                (eval_times.txt) and their summaries (~6 min)
#   t: carry .lane .v0 (any part) the GPU tests only (~3 min); copy: carry one part, keep it in /tmp/vparts (seconds)
#   d: carry .lane .whl (vLLM in /tmp/site) the signal lane with vLLM in the process
#                                (bench/signal_lane.sh, ~6 min), then the vLLM teacher's tests (the fixture needs datasets,
#                                from .whl) (~10 min; run the tests apart with vt where the call is short)
# Each writes what it measured under $OUT (8 files at most come back).
set -uo pipefail
PHASE=${1:?usage: bash bench/device_calls.sh a|b|c|d}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/vparts
# ONLY_ON=H200: stop at once (before the preparation) on any other card, so a call that finds an H100 costs seconds
if [ -n "${ONLY_ON:-}" ] && ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q "$ONLY_ON"; then
  echo "ONLY_ON=$ONLY_ON: this is a $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); nothing run" \
    | tee "$OUT/calls.txt"
  exit 0
fi
for d in .v0 .v1 .v2; do [ -d $d ] && cp $d/part_* /tmp/vparts/; done
source bench/vllm_tree.sh  # once all three parts are there
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
if [ "$(df --output=avail -k /dev/shm | tail -1)" -gt 60000000 ]; then R=/dev/shm/lane; else R=/tmp/lane; fi
lim() { local s=$1; shift; timeout -k 10 "$s" "$@"; echo "$* -> rc=$? ($(date -u +%T))" >> "$OUT/calls.txt"; }
# the decoder's GPU tests in SECONDS; the static decoder at 1,024 (digest, steps/s, profile) of the kit before
# (.speed/head, SPEED_KIT) and after
decoder_tests() { lim "$1" python3 -m pytest -q -o addopts="" -p no:cacheprovider -rfE tests/test_gpu.py tests/test_decode.py \
  tests/test_decode_kernels.py > "$OUT/tests.txt" 2>&1; }
static_before_after() {  # [IMPLS]: this kit's decoders (default new); the kit before runs new
  for kit in .speed/head ""; do
    lim 150 env SPEED_KIT=$kit python3 bench/s1_speed.py static --root "$R" --out "$OUT" --max-new-tokens 1024 \
      --impls "$([ -n "$kit" ] && echo new || echo "${1:-new}")" >> "$OUT/parts.txt" 2>&1
  done
}
s1_run() {  # NAME STEPS SECONDS [ARGS]: S1 (bench/real_lane.py train) into $R/runs/NAME, removed once its row is written
  local name=$1 steps=$2 secs=$3
  shift 3
  lim "$secs" python3 bench/real_lane.py train --root "$R" --out "$OUT" --name "$name" --recipe s1 --steps "$steps" "$@" \
    >> "$OUT/parts.txt" 2>&1
  rm -rf "$R/runs/$name"
}
logp_diff() {  # DIR WHAT: the recorded log-probs of the kit before (DIR/head_new.pt) and this kit (DIR/this_new.pt)
  lim 60 python3 -c "import torch; a, b = torch.load('$1/head_new.pt'), torch.load('$1/this_new.pt'); \
d = (a - b).abs(); print(f'$2: recorded log-probs, kit before vs this kit: max |d| {d.max():.3e}, mean {d.mean():.3e}, \
{int((d > 0).sum())} of {d.numel()} differ')" >> "$OUT/logp_diff.txt" 2>&1
}
kit_programs() {  # P: /tmp/kit_pP, a copy of this kit whose AttentionPlan defaults to P programs
  [ -d "/tmp/kit_p$1/opdkit" ] && return
  mkdir -p "/tmp/kit_p$1" && cp -r opdkit "/tmp/kit_p$1/"
  sed -i "s/programs: int = 256,/programs: int = $1,/" "/tmp/kit_p$1/opdkit/engines/decode_kernels.py"
  grep -c "programs: int = $1," "/tmp/kit_p$1/opdkit/engines/decode_kernels.py" >> "$OUT/calls.txt"
}
s1_1024_before_after() {  # SECONDS: S1 at 1,024 new tokens, 4 steps, of the kit before (.speed/head) and this kit
  s1_run s1_1024_before 4 "$1" --kit .speed/head -S rollout.max_new_tokens=1024
  s1_run s1_1024 4 "$1" -S rollout.max_new_tokens=1024
}
[ "$PHASE" = copy ] || [ "$PHASE" = vt ] || [ "$PHASE" = z1 ] || [ "$PHASE" = h1 ] || [ -d "$R/s1/student" ] || lim 150 python3 bench/real_lane.py prepare --root "$R" --assets .lane --pairs s1 >> "$OUT/parts.txt" 2>&1
case $PHASE in
  copy) ;;
  h1)
    lim 120 python3 -m pytest -q -o addopts="" -p no:cacheprovider -rfE tests/test_gpu.py -k "decode_kernels or graph_replay" \
      > "$OUT/tests.txt" 2>&1
    lim 170 python3 bench/attn_bench.py --out "$OUT" --before .speed/head/opdkit/engines/decode_triton.py \
      --budget-s 150 > "$OUT/attn_log.txt" 2>&1
    lim 240 python3 bench/gemv_bench.py --out "$OUT" --grid tune --budget-s 210 > "$OUT/gemv_log.txt" 2>&1
    ;;
  h2)
    lim 90 python3 bench/attn_bench.py --out "$OUT" --before .speed/head/opdkit/engines/decode_triton.py \
      --budget-s 70 > "$OUT/attn_log.txt" 2>&1
    decoder_tests 170
    static_before_after
    s1_run s1_7168 3 150 -S rollout.max_new_tokens=7168
    ;;
  h3)
    decoder_tests 170
    lim 100 python3 bench/s1_speed.py static --root "$R" --out "$OUT" --max-new-tokens 1024 --impls new >> "$OUT/parts.txt" 2>&1
    lim 60 python3 bench/attn_bench.py --out "$OUT" --before .speed/head/opdkit/engines/decode_triton.py \
      --budget-s 40 > "$OUT/attn_log.txt" 2>&1
    ;;
  p1)
    decoder_tests 170
    static_before_after nopdl,new
    ;;
  p2)
    decoder_tests 170
    lim 90 python3 bench/s1_speed.py sample --out "$OUT" >> "$OUT/parts.txt" 2>&1
    for kit in .speed/head ""; do
      lim 150 env SPEED_KIT=$kit python3 bench/s1_speed.py static --root "$R" --out "$OUT" --max-new-tokens 1024 \
        --impls new --save-logp /tmp/logp >> "$OUT/parts.txt" 2>&1
    done
    lim 60 python3 -c "import torch; a, b = torch.load('/tmp/logp/head_new.pt'), torch.load('/tmp/logp/this_new.pt'); \
d = (a - b).abs(); print(f'recorded log-probs, kit before vs this kit: max |d| {d.max():.3e}, mean {d.mean():.3e}, \
{int((d > 0).sum())} of {d.numel()} differ')" > "$OUT/logp_diff.txt" 2>&1
    ;;
  p3)
    s1_1024_before_after 110
    ;;
  p4)
    decoder_tests 170
    lim 90 python3 bench/s1_speed.py static --root "$R" --out "$OUT" --max-new-tokens 1024 --impls new >> "$OUT/parts.txt" 2>&1
    lim 90 python3 bench/s1_speed.py static --root "$R" --out "$OUT" --max-new-tokens 1024 --impls new \
      --temperature 0.6 --top-p 0.95 >> "$OUT/parts.txt" 2>&1  # the seeds' sampling: the torch sampler
    s1_run s1_1024 4 150 -S rollout.max_new_tokens=1024
    s1_run s1_7168 3 150 -S rollout.max_new_tokens=7168
    ;;
  q1)
    decoder_tests 170
    lim 90 python3 bench/s1_speed.py sample --out "$OUT" --temperature 0.6 --top-p 0.95 >> "$OUT/parts.txt" 2>&1
    for setting in "0.6 0.95 2" "0.7 0.9 16"; do
      set -- $setting
      for kit in .speed/head ""; do
        lim 100 env SPEED_KIT=$kit python3 bench/s1_speed.py static --root "$R" --out "$OUT" --max-new-tokens 1024 \
          --impls new --temperature "$1" --top-p "$2" --prompts "$3" --save-logp "/tmp/logp_$1" >> "$OUT/parts.txt" 2>&1
      done
      lim 60 python3 -c "import torch; a, b = torch.load('/tmp/logp_$1/head_new.pt'), torch.load('/tmp/logp_$1/this_new.pt'); \
d = (a - b).abs(); print(f'$1 / $2: recorded log-probs, kit before vs this kit: max |d| {d.max():.3e}, mean {d.mean():.3e}, \
{int((d > 0).sum())} of {d.numel()} differ')" >> "$OUT/logp_diff.txt" 2>&1
    done
    lim 60 python3 bench/s1_speed.py static --root "$R" --out "$OUT" --max-new-tokens 1024 --impls new >> "$OUT/parts.txt" 2>&1
    ;;
  q2)
    lim 100 python3 -m pytest -q -o addopts="" -p no:cacheprovider -rfE tests/test_gpu.py -k "keeping or bf16_step" \
      > "$OUT/tests.txt" 2>&1
    s1_run s1_7168 3 150 -S rollout.max_new_tokens=7168
    s1_run s1_7168_keep_attn 3 150 -S rollout.max_new_tokens=7168 -S runtime.checkpoint_keep_attention=true
    s1_run s1_1024_keep_attn 4 110 -S rollout.max_new_tokens=1024 -S runtime.checkpoint_keep_attention=true
    ;;
  q3)
    lim 100 python3 -m pytest -q -o addopts="" -p no:cacheprovider -rfE tests/test_gpu.py -k "nucleus or keeping or \
decode_kernels or graph_replay" > "$OUT/tests.txt" 2>&1
    lim 100 python3 bench/s1_speed.py sample --out "$OUT" --temperature 0.6 --top-p 0.95 >> "$OUT/parts.txt" 2>&1
    BEST=$(python3 -c "import json; r = [json.loads(l) for l in open('$OUT/results.jsonl')]; \
r = min((x for x in r if x.get('variant') == 'sample_token'), key=lambda x: x['us_per_step']); \
print(f\"{r['block']},{r['warps']}\")")
    echo "fastest nucleus settings: $BEST" >> "$OUT/calls.txt"
    for setting in "0.6 0.95 2" "0.7 0.9 16"; do
      set -- $setting
      lim 80 env SPEED_KIT=.speed/head python3 bench/s1_speed.py static --root "$R" --out "$OUT" --max-new-tokens 1024 \
        --impls new --temperature "$1" --top-p "$2" --prompts "$3" >> "$OUT/parts.txt" 2>&1
      for plan in "" "$BEST"; do
        lim 80 python3 bench/s1_speed.py static --root "$R" --out "$OUT" --max-new-tokens 1024 --impls new \
          --temperature "$1" --top-p "$2" --prompts "$3" --plan "$plan" >> "$OUT/parts.txt" 2>&1
      done
    done
    ;;
  q4)
    lim 70 python3 bench/s1_speed.py static --root "$R" --out "$OUT" --max-new-tokens 1024 --impls new \
      --temperature 0.6 --top-p 0.95 >> "$OUT/parts.txt" 2>&1
    lim 60 python3 -m pytest -q -o addopts="" -p no:cacheprovider -rfE tests/test_gpu.py -k "nucleus or decode_kernels" \
      > "$OUT/tests.txt" 2>&1
    lim 50 python3 bench/s1_speed.py sample --out "$OUT" --temperature 0.6 --top-p 0.95 >> "$OUT/parts.txt" 2>&1
    lim 70 python3 bench/s1_speed.py static --root "$R" --out "$OUT" --max-new-tokens 1024 --impls new \
      --temperature 0.7 --top-p 0.9 --prompts 16 >> "$OUT/parts.txt" 2>&1
    ;;
  r1)
    lim 200 python3 bench/attn_bench.py --out "$OUT" --before .speed/head/opdkit/engines/decode_triton.py \
      --budget-s 180 > "$OUT/attn_log.txt" 2>&1
    for T in 1024 7168; do
      for kit in .speed/head ""; do
        lim 100 env SPEED_KIT=$kit python3 bench/s1_speed.py static --root "$R" --out "$OUT" --max-new-tokens $T \
          --impls new --save-logp "/tmp/logp_$T" >> "$OUT/parts.txt" 2>&1
      done
      logp_diff "/tmp/logp_$T" "$T new tokens"
    done
    ;;
  r2)
    decoder_tests 240
    for T in 1024 7168; do
      lim 100 python3 bench/s1_speed.py static --root "$R" --out "$OUT" --max-new-tokens $T --impls new \
        --save-logp "/tmp/logp2_$T" >> "$OUT/parts.txt" 2>&1
      cp "/tmp/logp_$T/head_new.pt" "/tmp/logp2_$T/" 2>/dev/null && logp_diff "/tmp/logp2_$T" "$T new tokens (r2)"
    done
    s1_run s1_7168 3 150 -S rollout.max_new_tokens=7168
    s1_run s1_1024 4 100 -S rollout.max_new_tokens=1024
    ;;
  r3)
    for ab in "" merge o_norm merge,o_norm; do
      lim 80 python3 bench/s1_speed.py static --root "$R" --out "$OUT" --max-new-tokens 1024 --impls new \
        --ablate "$ab" >> "$OUT/parts.txt" 2>&1
    done
    ;;
  u1)
    s1_1024_before_after 110
    s1_run s1_7168_before 3 170 --kit .speed/head -S rollout.max_new_tokens=7168
    s1_run s1_7168 3 170 -S rollout.max_new_tokens=7168
    ;;
  u2)
    lim 90 python3 -m pytest -q -o addopts="" -p no:cacheprovider -rfE tests/test_gpu.py -k "unchecked or keeping" \
      > "$OUT/tests.txt" 2>&1
    s1_run s1_7168_share07 3 170 -S rollout.max_new_tokens=7168 -S runtime.unchecked_layers_memory=0.7
    for ab in "" merge o_norm merge,o_norm; do
      lim 70 python3 bench/s1_speed.py static --root "$R" --out "$OUT" --max-new-tokens 1024 --impls new \
        --ablate "$ab" >> "$OUT/parts.txt" 2>&1
    done
    ;;
  u3)
    lim 90 python3 -m pytest -q -o addopts="" -p no:cacheprovider -rfE tests/test_gpu.py -k "unchecked or keeping" \
      > "$OUT/tests.txt" 2>&1
    s1_run s1_7168 3 170 -S rollout.max_new_tokens=7168
    s1_run s1_7168_again 3 170 -S rollout.max_new_tokens=7168
    s1_run s1_1024 4 110 -S rollout.max_new_tokens=1024
    ;;
  v1)
    lim 150 python3 -m pytest -q -o addopts="" -p no:cacheprovider -rfE tests/test_gpu.py -k "gemv or programmatic" \
      > "$OUT/tests.txt" 2>&1
    lim 290 python3 bench/gemv_pre_bench.py --root "$R" --out "$OUT" --budget-s 250 > "$OUT/gemv_log.txt" 2>&1
    lim 30 python3 bench/gemv_pre_bench.py --write-kit /tmp/kit_best --best "$OUT/gemv_best.json"
    ;;
  v2)
    s1_run s1_7168 3 150 -S rollout.max_new_tokens=7168
    s1_run s1_7168_best 3 150 --kit /tmp/kit_best -S rollout.max_new_tokens=7168
    s1_run s1_1024 4 90 -S rollout.max_new_tokens=1024
    s1_run s1_1024_best 4 90 --kit /tmp/kit_best -S rollout.max_new_tokens=1024
    ;;
  w0)
    decoder_tests 230
    ;;
  w1)
    s1_run s1_7168 4 150 -S rollout.max_new_tokens=7168
    s1_run s1_1024 4 90 -S rollout.max_new_tokens=1024
    lim 100 python3 bench/s1_speed.py static --root "$R" --out "$OUT" --max-new-tokens 1024 --impls new >> "$OUT/parts.txt" 2>&1
    ;;
  x1)
    lim 130 python3 bench/attn_bench.py --out "$OUT" --programs 128,64 --capacities 7408,1264 --budget-s 110 \
      > "$OUT/attn_log.txt" 2>&1
    for P in 128 64; do kit_programs "$P"; done
    for kit in "" /tmp/kit_p128 /tmp/kit_p64; do
      lim 100 env SPEED_KIT=$kit python3 bench/s1_speed.py static --root "$R" --out "$OUT" --max-new-tokens 7168 \
        --impls new >> "$OUT/parts.txt" 2>&1
    done
    ;;
  x2)  # (~8 min with the preparation; 7,168 runs took 106-116 s on 2026-12-05)
    P=${X2_PROGRAMS:-128}
    kit_programs "$P"
    s1_run s1_7168 4 140 -S rollout.max_new_tokens=7168
    s1_run s1_7168_no_keepmm 4 140 -S rollout.max_new_tokens=7168 -S runtime.checkpoint_keep_matmuls=false
    s1_run "s1_7168_p$P" 4 140 --kit "/tmp/kit_p$P" -S rollout.max_new_tokens=7168
    ;;
  y1)  # S1 at 7,168, 4 steps, runtime.checkpoint_keep_matmuls on / off / on (~7 min with the preparation; 7,168
    # runs took 95-118 s on 2026-12-05; the switch is on by default since that day's H200 run)
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> "$OUT/calls.txt"
    s1_run s1_7168_keepmm 4 135 -S rollout.max_new_tokens=7168 -S runtime.checkpoint_keep_matmuls=true
    s1_run s1_7168 4 135 -S rollout.max_new_tokens=7168 -S runtime.checkpoint_keep_matmuls=false
    s1_run s1_7168_keepmm_2 4 135 -S rollout.max_new_tokens=7168 -S runtime.checkpoint_keep_matmuls=true
    ;;
  y2)  # v3's update profile at 7,168 (the copies by input shape); the down projection's GEMV settings in the decoder;
    # the static decoder at 1,024 beside the bound (~7 min)
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> "$OUT/calls.txt"
    lim 200 python3 bench/s1_speed.py update --root "$R" --out "$OUT" --max-new-tokens 7168 --modes packed \
      > "$OUT/update_log.txt" 2>&1
    lim 130 python3 bench/gemv_pre_bench.py --root "$R" --out "$OUT" --only down --budget-s 100 > "$OUT/gemv_log.txt" 2>&1
    lim 80 python3 bench/s1_speed.py static --root "$R" --out "$OUT" --max-new-tokens 1024 --impls new >> "$OUT/parts.txt" 2>&1
    ;;
  z1)
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> "$OUT/calls.txt"
    lim 240 python3 bench/sync_floor.py --out "$OUT" --programs 132,264 --weights 0,6291456,27525120 \
      > "$OUT/sync_log.txt" 2>&1
    ;;
  e0|e1)  # e0: the kit's decoder alone (no vLLM needed)
    for eng in hf $([ "$PHASE" = e1 ] && echo vllm); do
      t0=$(date +%s)
      lim 280 python3 -m opdkit eval --quiet --model "$R/s1/student" --data "$R/s1/train.jsonl" --out "$R/eval_$eng.json" \
        -p none -S eval.engine=$eng -S eval.max_questions=64 -S eval.n_samples=4 -S eval.max_new_tokens=2048 \
        >> "$OUT/parts.txt" 2>&1
      echo "eval.engine=$eng: $(( $(date +%s) - t0 )) s in all (64 questions x 4 samples x 2,048 new tokens)" \
        >> "$OUT/eval_times.txt"
      cp "$R/eval_$eng.json" "$OUT/" 2>/dev/null
    done
    ;;
  w12)  # w1 with a second 7,168 run, in one call (~7.5 min; limits 590 s with the preparation's 150; on 2026-12-05 the
    # 7,168 runs took 106-116 s, the 1,024 run 52, the decoder 48)
    s1_run s1_7168 4 140 -S rollout.max_new_tokens=7168
    s1_run s1_1024 4 80 -S rollout.max_new_tokens=1024
    lim 80 python3 bench/s1_speed.py static --root "$R" --out "$OUT" --max-new-tokens 1024 --impls new >> "$OUT/parts.txt" 2>&1
    s1_run s1_7168_2 4 140 -S rollout.max_new_tokens=7168
    ;;
  w0b)  # (after w12, the machine still warm) w0's GPU tests and a third S1 run at 7,168 (~6 min)
    decoder_tests 230
    s1_run s1_7168_3 4 150 -S rollout.max_new_tokens=7168
    ;;
  w2)
    s1_run s1_7168_2 4 150 -S rollout.max_new_tokens=7168
    s1_run s1_7168_3 4 150 -S rollout.max_new_tokens=7168
    ;;
  v3)
    lim 120 python3 -m pytest -q -o addopts="" -p no:cacheprovider -rfE tests/test_gpu.py -k "decod or gemv or graph" \
      > "$OUT/tests.txt" 2>&1
    lim 220 python3 bench/s1_speed.py update --root "$R" --out "$OUT" --max-new-tokens 7168 --modes packed \
      > "$OUT/update_log.txt" 2>&1
    ;;
  u4)
    lim 100 python3 bench/update_attn_bench.py > "$OUT/update_attn.jsonl" 2>> "$OUT/parts.txt"
    s1_run s1_7168 3 150 -S rollout.max_new_tokens=7168
    ;;
  h4)
    for T in 1024 3072; do
      s1_run "s1_$T" 4 110 -S rollout.max_new_tokens=$T
    done
    ;;
  g)
    lim 140 python3 bench/gemv_bench.py --out "$OUT" --budget-s 110 > "$OUT/gemv_log.txt" 2>&1
    lim 150 python3 bench/s1_speed.py static --root "$R" --out "$OUT" --max-new-tokens 1024 >> "$OUT/parts.txt" 2>&1
    decoder_tests 180
    ;;
  g3a)
    decoder_tests 170
    lim 60 python3 bench/gemv_bench.py --out "$OUT" --quick > "$OUT/gemv_log.txt" 2>&1
    lim 120 python3 bench/s1_speed.py static --root "$R" --out "$OUT" --max-new-tokens 1024 >> "$OUT/parts.txt" 2>&1
    ;;
  g4)
    lim 120 python3 -m pytest -q -o addopts="" -p no:cacheprovider -rfE tests/test_gpu.py tests/test_decode_kernels.py \
      > "$OUT/tests.txt" 2>&1
    lim 100 python3 bench/s1_speed.py static --root "$R" --out "$OUT" --max-new-tokens 1024 >> "$OUT/parts.txt" 2>&1
    s1_run s1_1024 4 150 -S rollout.max_new_tokens=1024
    s1_run s1_7168 3 150 -S rollout.max_new_tokens=7168
    ;;
  f1)
    decoder_tests 170
    static_before_after
    lim 60 python3 bench/s1_speed.py matmul --out "$OUT" >> "$OUT/parts.txt" 2>&1
    s1_1024_before_after 90
    ;;
  f2)
    lim 150 python3 bench/s1_speed.py update --root "$R" --out "$OUT" --max-new-tokens 7168 >> "$OUT/parts.txt" 2>&1
    s1_run s1_7168_no_ckpt_mb2 4 150 -S rollout.max_new_tokens=7168 -S runtime.grad_checkpointing=false \
      -S optim.micro_batch=2
    ;;
  g3b)
    for run in "1024 default" "1024 no_ckpt -S runtime.grad_checkpointing=false" \
               "7168 default" "7168 no_ckpt_mb2 -S runtime.grad_checkpointing=false -S optim.micro_batch=2"; do
      set -- $run; T=$1; N=$2; shift 2
      s1_run "s1_${T}_$N" 4 170 -S rollout.max_new_tokens=$T "$@"
    done
    ;;
  g2)
    for T in 1024 7168; do
      for G in true false; do
        s1_run "s1_${T}_gemv_$G" 4 200 -S rollout.max_new_tokens=$T -S rollout.decode_gemv=$G
      done
    done
    ;;
  t)
    lim 200 python3 -m pytest -q -o addopts="" -p no:cacheprovider -rfE tests/test_gpu.py tests/test_decode.py \
      tests/test_packing.py tests/test_decode_kernels.py > "$OUT/tests.txt" 2>&1
    ;;
  a)
    lim 170 python3 -m pytest -q -o addopts="" -p no:cacheprovider -rfE tests/test_gpu.py tests/test_decode.py \
      tests/test_packing.py > "$OUT/tests.txt" 2>&1
    lim 120 python3 bench/s1_speed.py update --root "$R" --out "$OUT" --max-new-tokens 1024 >> "$OUT/parts.txt" 2>&1
    lim 150 python3 bench/save_speed.py --device cuda --dirs /dev/shm/save_speed --reps 1 > "$OUT/save_speed.jsonl" 2>> "$OUT/parts.txt"
    ;;
  b)
    lim 380 bash bench/formal_timeline.sh >> "$OUT/parts.txt" 2>&1
    ;;
  c)
    SPEED_BUDGET_S=${SPEED_BUDGET_S:-560} SPEED_LENGTHS="${SPEED_LENGTHS:-1024 7168 3072}" SPEED_TRL_STEPS=3 \
      bash bench/s1_speed.sh table >> "$OUT/parts.txt" 2>&1
    ;;
  d|vt)
    [ "$PHASE" = vt ] || lim 380 bash bench/signal_lane.sh >> "$OUT/parts.txt" 2>&1
    [ -d /tmp/trlsite/datasets ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/trlsite \
      .whl/*.whl >> "$OUT/parts.txt" 2>&1
    PYTHONPATH=$PYTHONPATH:/tmp/trlsite OPDKIT_FIXTURE_DIR=$PWD/.lane lim 210 python3 -m pytest -p no:cacheprovider -o addopts="" -q -rfE \
      tests/test_vllm_teacher.py > "$OUT/tests_vllm.txt" 2>&1
    ;;
esac
tail -c 20000 "$OUT/parts.txt" > "$OUT/parts_tail.txt" 2>/dev/null; rm -f "$OUT/parts.txt"
ls "$OUT"
