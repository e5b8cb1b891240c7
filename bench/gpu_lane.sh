#!/usr/bin/env bash
# The GPU lane (the device machine; VLLM.md's offline recipe): install the carried vLLM tree once,
# then one phase per call, results under $OUT.
#   phase 1: the GPU and real-vLLM tests; S1 through `opdkit train` with vLLM (3 steps)
#   phase 2: resume that run for a 4th step; S1 with the static-cache HF decoder; S2 with vLLM
# Run from the repository root: bash bench/gpu_lane.sh 1|2 (parts in /tmp/vparts/part_*).
set -uo pipefail
PHASE=$1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ ! -d /tmp/site/vllm ]; then
  t0=$(date +%s); mkdir -p /tmp/site && cat /tmp/vparts/part_* | xz -dc | tar -x -C /tmp/site
  echo "vllm tree unpacked in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/lane.txt"
fi
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
R=/tmp/fb; F="python3 bench/fsdp_bench.py"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee -a "$OUT/lane.txt"
python3 -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)" 2>&1 | tail -1 | tee -a "$OUT/lane.txt"
if [ "$PHASE" = 1 ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider -rA tests/test_gpu.py tests/test_vllm_engine.py tests/test_decode.py > "$OUT/tests.txt" 2>&1
  echo "pytest rc=$?" | tee -a "$OUT/lane.txt"; tail -25 "$OUT/tests.txt"
  $F prepare --out $R > /dev/null && echo prepared | tee -a "$OUT/lane.txt"
  timeout 330 $F train --out $R --name s1_vllm --nproc 1 --rollout-batch-size 0 --steps 3 -S rollout.engine=vllm \
    > /dev/null 2>&1; echo "s1_vllm rc=$?" | tee -a "$OUT/lane.txt"
  cp $R/train_s1_vllm.json "$OUT/" 2>/dev/null; tail -c 3000 $R/s1_vllm.log > "$OUT/s1_vllm_log.txt"
  ls $R/s1_vllm/checkpoints >> "$OUT/lane.txt" 2>&1
else
  # resume: the same run to 4 steps (it restarts from the trainer state of step 3)
  timeout 200 $F train --out $R --name s1_vllm --nproc 1 --rollout-batch-size 0 --steps 4 -S rollout.engine=vllm \
    > /dev/null 2>&1; echo "s1_vllm resume rc=$?" | tee -a "$OUT/lane.txt"
  cp $R/train_s1_vllm.json "$OUT/train_s1_vllm_resumed.json" 2>/dev/null; tail -c 2000 $R/s1_vllm.log > "$OUT/resume_log.txt"
  ls $R/s1_vllm/checkpoints >> "$OUT/lane.txt" 2>&1
  rm -rf $R/s1_vllm
  timeout 230 $F train --out $R --name s1_hf --nproc 1 --rollout-batch-size 0 --steps 3 -S rollout.engine=hf \
    > /dev/null 2>&1; echo "s1_hf rc=$?" | tee -a "$OUT/lane.txt"
  cp $R/train_s1_hf.json "$OUT/" 2>/dev/null; rm -rf $R/s1_hf
  timeout 150 python3 bench/opd_bench.py s2 --steps 2 -S rollout.engine=vllm --out "$OUT/s2_vllm.json" > "$OUT/s2_log.txt" 2>&1
  echo "s2_vllm rc=$?" | tee -a "$OUT/lane.txt"; tail -c 1500 "$OUT/s2_log.txt"
fi
cat "$OUT/lane.txt"
