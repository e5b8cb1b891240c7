#!/usr/bin/env bash
# bench/embedded_grid.py on the device machine (one H200, 16 CPU cores): builds on the GPU, 14 jobs.
# Carry sitemin/ (pip install --no-deps --target sitemin datasets dill multiprocess math-verify latex2sympy2_extended antlr4-python3-runtime==4.9.3: the device lacks them).
# Resumable: a second call while the machine is warm continues in /tmp/grid. Results (JSON only) in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/sitemin:$PWD CUBLAS_WORKSPACE_CONFIG=:4096:8 OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install --no-deps --no-build-isolation -q -e . >/dev/null 2>&1 || true
command -v opdkit >/dev/null || { mkdir -p /tmp/bin; printf '#!/bin/sh\nexec python3 -m opdkit "$@"\n' > /tmp/bin/opdkit; chmod +x /tmp/bin/opdkit; export PATH=/tmp/bin:$PATH; }
timeout "${GRID_TIMEOUT:-540}" python3 bench/embedded_grid.py --out /tmp/grid --device cuda --jobs "${JOBS:-14}" \
  -S rollout.engine=hf "$@" > "$OUT/grid_log.txt" 2>&1; echo "grid rc=$?" >> "$OUT/grid_log.txt"
python3 bench/embedded_grid.py --out /tmp/grid --table-only "$@" > "$OUT/grid_table.txt" 2>&1
cp /tmp/grid/grid.json "$OUT/" 2>/dev/null
(cd /tmp/grid && tar -czf "$OUT/grid_json.tgz" $(find . -name '*.json' -path '*eval*' -o -name 'curve.json' -o -name manifest.json -o -name 'train.jsonl' | grep -v checkpoint)) 2>/dev/null
tail -n 3 /tmp/grid/*/build.log > "$OUT/build_tail.txt" 2>&1
for f in $(find /tmp/grid -name '*.log' | head -400); do if grep -q -i "error\|traceback" "$f"; then echo "== $f"; tail -5 "$f"; fi; done > "$OUT/errors.txt" 2>&1
nvidia-smi --query-gpu=memory.used --format=csv >> "$OUT/grid_log.txt"
cat "$OUT/grid_table.txt" | tail -60
